"""One placement group for a replica's target shards and draft: each actor its own bundle,
so on GPUs every shard and the draft sit on their own devices (the draft possibly on
another node), and Ray frees them together.

A draft that reserves nothing borrows the cores of target rank 0 (sequential speculation:
the two never compute at once), so it is placed in rank 0's bundle, on the same node. So is
a Serve replica that reserves nothing: it only schedules, and on a small machine a bundle
of its own would not fit beside a target that reserves every core.
"""

from __future__ import annotations

from specdec.engine.spec import EngineSpec

# Ray refuses a bundle that reserves nothing; a target shard that reserves nothing still
# needs a bundle to be placed by. A thousandth of a CPU is Ray's smallest "nothing".
_NOTHING = {"CPU": 0.001}


def bundles_for(spec: EngineSpec, replica_cpus: float | None = None
                ) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """Bundles [replica?, target rank 0..N-1, draft rank 0..M-1] and the indices of each.
    replica_cpus: a Serve replica's own reservation (None: no replica; 0: it shares bundle
    0 with target rank 0)."""
    bundles: list[dict[str, float]] = [{"CPU": replica_cpus}] if replica_cpus else []
    t_idx = list(range(len(bundles), len(bundles) + spec.target.tp))
    bundles += [spec.target.resources.bundle() or dict(_NOTHING) for _ in range(spec.target.tp)]
    d_idx: list[int] = []
    draft = spec.draft
    if draft is not None:
        if draft.resources.reserves_nothing:
            d_idx = [t_idx[0]]
        else:
            d_idx = list(range(len(bundles), len(bundles) + draft.tp))
            bundles += [draft.resources.bundle() for _ in range(draft.tp)]
    return bundles, t_idx, d_idx
