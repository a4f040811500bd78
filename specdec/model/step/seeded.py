"""Seeded sampling whose tokens depend on the seed and the target alone: the seeded race.

A seeded request must give the same tokens again, however it was decoded: whatever k the
policy chose round by round, whatever shared its batch, speculative or plain. Draws from a
per-request generator cannot promise that: a round consumes k + 1 numbers, so the stream's
alignment follows the schedule of k (the load, probes, overlap cuts).

So a seeded request draws nothing from a stream. Every token v at output position t has
its own u_v = hash(key(seed, t), v) in (0, 1), and the token emitted at t is the winner of a
race, argmax_v log(u_v) / p_t(v): an exact draw from the target's (warped) p_t
(Efraimidis-Spirakis: -log u_v is Exp(1), and min_v Exp(1) / p_v lands on v with
probability p_v). Positions have independent draws, so a sequence of them is an exact
sample of the target's sequence distribution.

Speculation then verifies by equality. The draft guesses by running the same race over
its own q with the same u_v (the winner under q), the target computes the winner under p at
every verified position, and the guesses are kept while they equal it; the first
difference is replaced by the target's winner. The emitted tokens are the target's winners
whatever the draft guessed, so they are exact by construction and identical with any k,
with none, and in any batch (the batch-invariant target gives the same p_t). A guess is
kept when both races have the same winner, which happens with probability close to
1 - TV(p, q) (at least (1 - TV) / (1 + TV)), a little below the rejection rule's 1 - TV:
the price of reproducibility, paid by seeded requests alone. Unseeded requests keep the
rejection rule (specdec/spec_decode/rejection.py).

Three implementations of the same hash: the C++ kernel (kernels/seeded_race.cpp) on CPUs
that can build it, numpy on those that cannot, torch ops on a GPU; they agree on every u
bit for bit (tests/model/test_seeded.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (the kernel's mix)."""
    x ^= x >> 30
    x = (x * M1) & MASK
    x ^= x >> 27
    x = (x * M2) & MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def race_keys(pairs: list[tuple[int, int]]) -> torch.Tensor:
    """The keys of (seed, position) pairs as a host int64 tensor."""
    return torch.tensor([race_key(s, t) for s, t in pairs], dtype=torch.long)


def race_key(seed: int, position: int) -> int:
    """The key of output position `position` (the token's index in prompt + output) of a
    request seeded `seed`, as a signed 64-bit int (what a tensor holds)."""
    return _signed(_mix((seed & MASK) ^ _mix((position * GOLDEN + 1) & MASK)))


@functools.cache
def _kernel():
    from specdec.model.formats.kernels.build import KernelUnavailable, race

    try:
        return race()
    except KernelUnavailable:
        return None


def uniforms_np(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[rows, width] float32 u of each (key, id) (keys [rows], ids [rows, width] or [width])."""
    k = keys.astype(np.int64).view(np.uint64).reshape(-1, 1)
    v = ids.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        x = k + (v + np.uint64(1)) * np.uint64(GOLDEN)
        x ^= x >> np.uint64(30)
        x *= np.uint64(M1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(M2)
        x ^= x >> np.uint64(31)
    return ((x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)


def _uniforms_torch(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The same u with torch's int64 ops on any device: products wrap as uint64 would, and
    right shifts are masked to be logical."""
    def shr(x, n):
        return (x >> n) & ((1 << (64 - n)) - 1)

    x = keys.view(-1, 1) + (ids + 1) * _signed(GOLDEN)
    x = x ^ shr(x, 30)
    x = x * _signed(M1)
    x = x ^ shr(x, 27)
    x = x * _signed(M2)
    x = x ^ shr(x, 31)
    return (shr(x, 40).float() + 0.5) * 2.0**-24


def _pick(scores: torch.Tensor) -> torch.Tensor:
    """argmax of each row of log(u) / p (p = 0 scores -inf); -1 where nothing could win."""
    best = scores.argmax(-1)
    alive = torch.isfinite(scores.gather(-1, best.unsqueeze(-1)).squeeze(-1))
    return torch.where(alive, best, torch.full_like(best, -1))


def race_pick(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's winner over the whole vocabulary: probs [N, V] float32, keys [N] int64 (on
    probs' device, or the host) -> token ids [N] (long, on probs' device; -1 for a row
    without positive mass)."""
    keys = keys.contiguous()
    if probs.device.type != "cpu":
        ids = torch.arange(probs.shape[-1], device=probs.device)
        return _pick(_scores(_uniforms_torch(keys, ids), probs))
    probs = probs.float().contiguous()
    ops = _kernel()
    if ops is not None:
        return ops.race_pick(probs, keys)
    u = torch.from_numpy(uniforms_np(keys.numpy(), np.arange(probs.shape[-1])))
    return _pick(_scores(u, probs))


def race_pick_among(ids: torch.Tensor, probs: torch.Tensor, keys: torch.Tensor
                    ) -> torch.Tensor:
    """Each row's winner among its candidates: ids, probs [N, m] (zero probability: not a
    candidate), keys [N] -> the winning column [N] (long, on probs' device)."""
    ids, keys = ids.long(), keys.contiguous()
    if probs.device.type != "cpu":
        return _pick(_scores(_uniforms_torch(keys, ids), probs)).clamp(min=0)
    probs, ids = probs.float().contiguous(), ids.contiguous()
    ops = _kernel()
    if ops is not None:
        return ops.race_pick_among(ids, probs, keys).clamp(min=0)
    u = torch.from_numpy(uniforms_np(keys.numpy(), ids.numpy()))
    return _pick(_scores(u, probs)).clamp(min=0)


def _scores(u: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """log(u) / p, -inf where p is not positive (or NaN)."""
    alive = probs > 0
    return (torch.log(u) / torch.where(alive, probs, 1.0)).masked_fill(~alive, float("-inf"))
