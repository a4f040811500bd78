"""One placement group for a replica's target shards and draft: each actor its own bundle,
so on GPUs every shard and the draft sit on their own devices (the draft possibly on
another node), and Ray frees them together."""

from __future__ import annotations

from deployments.config import DraftGroupConfig, ModelGroupConfig


def bundles_for(target: ModelGroupConfig, draft: DraftGroupConfig | None,
                replica_bundle: dict[str, float] | None = None
                ) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """Bundles [replica?, target rank 0..N-1, draft rank 0..M-1] and the indices of each."""
    bundles: list[dict[str, float]] = [replica_bundle] if replica_bundle is not None else []
    t_idx = list(range(len(bundles), len(bundles) + target.tp))
    bundles += [target.resources.bundle() for _ in range(target.tp)]
    d_idx: list[int] = []
    if draft is not None:
        d_idx = list(range(len(bundles), len(bundles) + draft.tp))
        bundles += [draft.resources.bundle() for _ in range(draft.tp)]
    return bundles, t_idx, d_idx
