"""The Ray backend of specdec.engine.assemble: target and draft as actor groups in a placement
group (the Serve replica's own, or one made for `specdec generate --tp`)."""

from __future__ import annotations

from pathlib import Path

from deployments.actors.draft import RayDraftProposer
from deployments.actors.placement import bundles_for
from deployments.actors.target import RayTargetRunner
from specdec.engine.spec import EngineSpec


class RayBackend:
    def __init__(self, placement_group=None, replica_cpus: float | None = None) -> None:
        """replica_cpus: what the calling Serve replica reserved in the group (see
        placement.bundles_for); None when the caller is not part of the group."""
        self.pg = placement_group
        self.replica_cpus = replica_cpus
        self.runners: list = []

    def _indices(self, spec: EngineSpec) -> tuple[list[int] | None, list[int] | None]:
        if self.pg is None:
            return None, None
        _, t_idx, d_idx = bundles_for(spec, self.replica_cpus)
        return t_idx, d_idx

    def target(self, spec: EngineSpec, path: Path) -> RayTargetRunner:
        runner = RayTargetRunner(spec.target, spec.runtime, self.pg, self._indices(spec)[0])
        self.runners.append(runner)
        return runner

    def draft(self, spec: EngineSpec, path: Path) -> RayDraftProposer:
        draft = RayDraftProposer(spec.draft, spec.runtime, self.pg, self._indices(spec)[1])
        self.runners.append(draft)
        return draft

    def close(self) -> None:
        for r in self.runners:
            r.shutdown()
        self.runners = []
