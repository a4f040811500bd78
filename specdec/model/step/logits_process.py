"""A request's sampling controls that depend on what it generated: logit_bias, min_tokens,
repetition_penalty, presence_penalty and frequency_penalty, applied to the target's
logits at each verified position before temperature, min_p, top-k and top-p.

Under speculation, guess j of a row is verified at a position whose history is the output
so far plus guesses 0..j-1: the penalties there count those guesses as if they were kept,
because they are kept exactly when the rule reaches position j. So every position's p is
the distribution plain decoding would use after the same tokens, and the rejection rule,
exact for any p, keeps the output the processed target's. The draft's q may ignore all of
it (exact for any q; it only costs acceptance).

The order, fixed (vLLM's, with the bias first): logit_bias is added; below min_tokens the
end-of-sequence ids and stop_token_ids are masked; repetition_penalty divides a positive
logit (multiplies a negative one) of every token seen in prompt or output; frequency and
presence penalties subtract count * frequency + (count > 0) * presence over the output.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.step.host_copy import to_device


@dataclasses.dataclass
class RowHistory:
    """What a row's processing needs from its sequence, sent only for rows that need it."""

    output: list[int]                  # generated so far (the row's pending tokens included)
    prompt: list[int] | None = None    # only for repetition_penalty
    end_ids: tuple[int, ...] = ()      # masked below min_tokens: EOS and stop_token_ids


def needs_history(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias
                or params.repetition_penalty != 1.0 or params.min_tokens)


def history_of(tokens: list[int], prompt_len: int, params, eos_ids) -> RowHistory:
    """A sequence's history for its next verified positions: its output so far, its prompt
    where repetition_penalty reads it, and the ids min_tokens holds back (EOS unless
    ignored, and stop_token_ids)."""
    end = () if params.ignore_eos else tuple(eos_ids)
    return RowHistory(tokens[prompt_len:],
                      tokens[:prompt_len] if params.repetition_penalty != 1.0 else None,
                      tuple(sorted(set(end) | set(params.stop_token_ids)))
                      if params.min_tokens else ())


def process_row(logits: torch.Tensor, params, history: RowHistory,
                guesses: list[int]) -> torch.Tensor:
    """logits [n + 1, V] of one row's verified positions (n = len(guesses)), processed for
    position j after output + guesses[:j]. Returns a new tensor."""
    out = logits.float().clone()
    V, dev = out.shape[-1], out.device
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        out[:, to_device(torch.tensor(ids), dev)] += to_device(torch.tensor(bias), dev)
    seen_out = list(history.output)
    counts = torch.bincount(torch.tensor(seen_out, dtype=torch.long), minlength=V).float() \
        if seen_out else torch.zeros(V)
    in_prompt = None
    if params.repetition_penalty != 1.0 and history.prompt:
        in_prompt = torch.zeros(V, dtype=torch.bool)
        in_prompt[torch.tensor(history.prompt, dtype=torch.long)] = True
    for j in range(out.shape[0]):
        if j:
            counts[guesses[j - 1]] += 1  # the guesses before this position, as if kept
        row = out[j]
        if len(history.output) + j < params.min_tokens and history.end_ids:
            row[to_device(torch.tensor(history.end_ids), dev)] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = counts > 0 if in_prompt is None else (counts > 0) | in_prompt
            seen = to_device(seen, dev)
            rp = params.repetition_penalty
            row[:] = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
        if params.frequency_penalty or params.presence_penalty:
            c = to_device(counts, dev)
            row -= c * params.frequency_penalty + (c > 0).float() * params.presence_penalty
    return out
