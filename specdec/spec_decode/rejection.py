"""The batched rejection sampler: exact speculative sampling (Leviathan et al., Chen et al.).

For draft tokens x_1..x_k drawn from q and target distributions p_1..p_{k+1}:
keep x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw one token
from normalize(max(0, p_i - q_i)) and stop; if all k are kept draw a bonus token from
p_{k+1}. The emitted tokens are distributed exactly as sampling from p alone.

A draft without a real q (n-gram lookup, greedy draft) is q = one-hot(x): keep with
probability p(x); the residual max(0, p - one-hot(x)) is p with x removed. The same formula
covers both, so one code path serves them.

Greedy rows (temperature 0) use the argmax rule: keep while x_i == argmax p_i, replace the
first mismatch by argmax p_i. No random numbers are consumed for them. Seeded rows use the
same rule against their race winners (`choice`; specdec/model/step/seeded.py says why).
"""

from __future__ import annotations

import torch

from specdec.model.step.sampling import draw_with_uniform

PLACEHOLDER = -1  # output slots after the last emitted token


def row_uniforms(num_draft: list[int], width: int,
                 generators: list[torch.Generator]) -> torch.Tensor:
    """[B, width] uniforms on the host, one seeded stream per row: row b's accept draws in
    columns :num_draft[b], its final draw in the last column. Each row consumes exactly
    num_draft[b] + 1 numbers, so a seeded request's draws do not depend on what else shares
    its batch. Built from host-held counts: nothing here waits for the device."""
    if len(generators) != len(num_draft):
        raise ValueError(f"{len(num_draft)} rows but {len(generators)} generators")
    u = torch.zeros(len(num_draft), width)
    for b, (g, n) in enumerate(zip(generators, num_draft, strict=True)):
        r = torch.rand(n + 1, generator=g, device=g.device)
        r = r if r.device.type == "cpu" else r.cpu()  # a device generator's draws
        u[b, :n] = r[:n]
        u[b, width - 1] = r[n]
    return u


def _uniforms(num_draft: torch.Tensor, width: int, generator, device) -> torch.Tensor:
    """[B, k+1] uniforms for one generator for the batch, or one per row (row_uniforms)."""
    B = num_draft.shape[0]
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(B, width, generator=generator, device=device)
    if len(generator) != B:
        raise ValueError(f"{B} rows but {len(generator)} generators")
    return row_uniforms(num_draft.tolist(), width, generator).to(device)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | list[torch.Generator] | None = None,
    *,
    num_draft: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    choice: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts.

    draft_token_ids [B, k] int64; draft_probs [B, k, V] or None (one-hot q);
    target_probs [B, k+1, V]. generator: one for the batch or one per row (seeded requests).
    num_draft [B]: each row's own k (rows of one batch may differ; padding is ignored).
    greedy [B] bool: rows decided by the argmax rule.
    uniforms [B, k+1]: the draws, made beforehand (row_uniforms); then generator is unused.
    choice [B, k+1]: the token a greedy row must match at each position (default: argmax
    p); a seeded row's race winners (specdec/model/step/seeded.py), verified like greedy.
    Returns (output_token_ids [B, k+1] with -1 after the last emitted token, num_emitted [B]).
    """
    B, k = draft_token_ids.shape
    if target_probs.shape[:2] != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], "
                         f"got {list(target_probs.shape)}")
    device = target_probs.device
    if num_draft is None:
        num_draft = torch.full((B,), k, dtype=torch.long, device=device)
    if greedy is None:
        greedy = torch.zeros(B, dtype=torch.bool, device=device)
    x = draft_token_ids.clamp(min=0)
    u = _uniforms(num_draft, k + 1, generator, device) if uniforms is None else uniforms
    target_argmax = target_probs.argmax(-1) if choice is None else choice  # [B, k+1]
    num_accepted = _accepted_counts(x, draft_probs, target_probs, target_argmax, u[:, :k],
                                    num_draft, greedy)
    final = _final_token(x, draft_probs, target_probs, target_argmax, u[:, k], num_accepted,
                         num_draft, greedy)
    rows = torch.arange(B, device=device)
    out = torch.full((B, k + 1), PLACEHOLDER, dtype=torch.long, device=device)
    keep = torch.arange(k, device=device).unsqueeze(0) < num_accepted.unsqueeze(1)
    out[:, :k] = torch.where(keep, x, out[:, :k])
    out[rows, num_accepted] = final
    return out, num_accepted + 1


def _accepted_counts(x, draft_probs, target_probs, target_argmax, u, num_draft, greedy):
    """How many of each row's guesses are kept: the index of the first rejected one."""
    k = x.shape[1]
    p_draft = target_probs[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1)  # p_i(x_i)  [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    # u * q < p  <=>  u < p / q, without dividing by a q that rounding made zero.
    accept = u * q_draft < p_draft
    accept = torch.where(greedy.unsqueeze(1), x == target_argmax[:, :k], accept)
    accept &= torch.arange(k, device=x.device).unsqueeze(0) < num_draft.unsqueeze(1)
    return torch.cumprod(accept.long(), dim=1).sum(1)


def _final_token(x, draft_probs, target_probs, target_argmax, u, num_accepted, num_draft,
                 greedy):
    """The one token drawn by the target at position num_accepted: a residual draw after a
    rejection, a bonus draw from p_{k+1} after a full acceptance."""
    B, k = x.shape
    rows = torch.arange(B, device=x.device)
    rejected = num_accepted < num_draft
    p_at = target_probs[rows, num_accepted]  # [B, V]
    q_at = torch.zeros_like(p_at)  # q where the rejection happened (unused otherwise)
    if k:
        j = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at[rows, x[rows, j]] = 1.0
        else:
            q_at = draft_probs[rows, j].to(p_at.dtype)
    residual = torch.clamp(p_at - q_at, min=0.0)
    dist = torch.where(rejected.unsqueeze(1), residual, p_at)
    # A residual that rounding emptied (p == q up to float error) falls back to p.
    empty = dist.sum(-1) <= 0
    dist = torch.where(empty.unsqueeze(1), p_at, dist)
    drawn = draw_with_uniform(dist, u)
    return torch.where(greedy, target_argmax[rows, num_accepted], drawn)
