"""Forward scenarios run identically on a local model and on a tensor-parallel group."""

from __future__ import annotations

import torch

from specdec.model.step.batch import BatchInput


def scenario_logits(model, cache, seqs: list[list[int]], argmax: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Prefill, step-by-step decode, ragged batch, mixed decode/verify, rollback.
    argmax: the same forwards asking for argmax ids only (they rewrite the same cache
    positions with the same values, so the scenario can run twice on one cache)."""
    out = {}
    a = seqs[0]
    out["prefill"] = model(BatchInput.build([(0, 0, a)]), cache, torch.arange(len(a)),
                           argmax=argmax)
    out["decode"] = torch.cat([model(BatchInput.build([(1, i, [t])]), cache, argmax=argmax)
                               for i, t in enumerate(a)])
    rows = [(3, 0, seqs[0]), (0, 0, seqs[1]), (2, 0, seqs[2])]
    n = sum(len(s) for s in seqs)
    out["ragged"] = model(BatchInput.build(rows), cache, torch.arange(n), argmax=argmax)
    rows = [(3, len(seqs[0]), [5]), (0, len(seqs[1]), [7, 8, 9])]
    out["mixed"] = model(BatchInput.build(rows), cache, torch.arange(4), argmax=argmax)
    out["rollback"] = model(BatchInput.build([(0, 4, [11, 12, 13])]), cache, torch.arange(3),
                            argmax=argmax)
    return out


def run_rank(rank: int, world: int, port: int, ckpt: str, seqs, result_path: str,
             vocab_limit: int | None = None, step: str = "eager",
             dtype: str = "float32") -> None:
    """Entry point of one spawned process: build the shard, lead or follow. step: how
    every rank runs its forwards (specdec/model/step/static_step.py)."""
    from specdec.model.checkpoint.sharding import ShardSpec
    from specdec.model.step.decoder import Decoder
    from specdec.model.step.parallel import Group, LeaderDecoder, follow
    from specdec.model.step.step_mode import with_step

    torch.set_num_threads(1)
    group = Group(rank, world, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
    local = Decoder.from_checkpoint(ckpt, dtype, shard=ShardSpec(rank, world),
                                    vocab_limit=vocab_limit)
    group.attach(local)
    local = with_step(local, step)
    cache = local.new_cache(4, 128)
    if rank == 0:
        leader = LeaderDecoder(local, group, cache)
        logits = scenario_logits(leader, cache, seqs)
        logits.update({f"{mode}:argmax": ids for mode, ids
                       in scenario_logits(leader, cache, seqs, argmax=True).items()})
        leader.stop_followers()
        torch.save(logits, result_path)
    else:
        follow(local, group, cache)
    # The graphs each rank ran, in order: a capture under TP records exactly these.
    torch.save([repr(g) for g in getattr(local, "graph_order", [])], f"{result_path}.rank{rank}")
    group.destroy()
