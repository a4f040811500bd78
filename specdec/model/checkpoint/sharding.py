"""Which slice of each weight a tensor-parallel rank owns (Megatron-style).

q/k/v and gate/up are split by output rows (column-parallel), o and down by input columns
(row-parallel); one all_reduce after attention and one after the MLP restores the full
activations. Query heads are split evenly. KV heads follow the query heads that read them:
when there are fewer KV heads than ranks, a KV head is replicated on every rank whose query
heads need it, which keeps grouped-query attention exact for any rank count that divides the
query heads.
"""

from __future__ import annotations

import dataclasses

from specdec.model.checkpoint.config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    rank: int = 0
    world: int = 1

    def check(self, cfg: DecoderConfig) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside world size {self.world}")
        for what, n in (("attention heads", cfg.num_heads),
                        ("intermediate size", cfg.intermediate_size)):
            if n % self.world:
                raise ValueError(
                    f"tensor parallel size {self.world} must divide the model's {what} ({n})"
                )

    def q_heads(self, cfg: DecoderConfig) -> range:
        per = cfg.num_heads // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: DecoderConfig) -> range:
        group = cfg.num_heads // cfg.num_kv_heads
        q = self.q_heads(cfg)
        return range(q.start // group, (q.stop - 1) // group + 1)

    def kv_index_of_local_q(self, cfg: DecoderConfig) -> list[int]:
        """For each local query head, the index of its KV head among the local KV heads."""
        group = cfg.num_heads // cfg.num_kv_heads
        first_kv = self.kv_heads(cfg).start
        return [h // group - first_kv for h in self.q_heads(cfg)]

    def vocab_rows(self, n: int) -> range:
        """This rank's slice of the output layer's n rows (vocabulary-parallel): contiguous,
        ceil(n / world) each, the last rank's shorter where n does not divide."""
        per = -(-n // self.world)
        return range(min(n, self.rank * per), min(n, (self.rank + 1) * per))

    def intermediate(self, cfg: DecoderConfig) -> range:
        per = cfg.intermediate_size // self.world
        return range(self.rank * per, (self.rank + 1) * per)
