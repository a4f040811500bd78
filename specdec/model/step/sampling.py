"""Logits -> probabilities (temperature, top-k, top-p) and seeded draws.

The same transform is applied to target and draft logits before p and q are formed: the
rejection rule is exact for whatever distribution p is, so p must be the distribution the
user asked for (the warped one), and q must be warped alike or acceptance collapses.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.step.grammar import GrammarSpec
from specdec.model.step.host_copy import to_device, to_device_all

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# vLLM's sampling epsilon: a temperature below it decodes greedily (its limit).
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Report each emitted token's log-probability and this many top alternatives (None: no
    # log-probabilities). They are the target's raw distribution (its logits' log-softmax,
    # before temperature, top-k and top-p), as vLLM reports by default: the same numbers
    # whether a token was decoded plainly or kept from a guess.
    logprobs: int | None = None
    # History-dependent controls (logits_process.py), applied to the target's logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end the request like EOS (kept in the output)
    # Drop tokens less likely than min_p times the most likely one (after temperature).
    min_p: float = 0.0
    # Structured output: the output must match this grammar (model/grammar.py).
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            # NaN fails this too. Below MIN_TEMPERATURE the logits / temperature overflow in
            # fp32 (a denormal is flushed to 0): callers take such a request as greedy.
            raise ValueError(f"temperature must be 0 or a finite number >= {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in -2..2")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10:  # NaN fails these too
            # A positive logit is divided by it: below this it overflows to infinity.
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in -100..100")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in {SEED_MIN}..{SEED_MAX} (what a generator takes)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def raced(self) -> bool:
        """A seeded sampled request: its tokens come from the seeded race
        (specdec/model/step/seeded.py), verified by equality like greedy ones."""
        return self.seed is not None and not self.greedy


# Where unseeded requests' streams take their seeds: the OS's entropy, unless a test made
# them repeatable (seed_unseeded). Seeded requests use no stream (specdec/model/step/seeded.py).
_unseeded: torch.Generator | None = None


def seed_unseeded(seed: int | None) -> None:
    """Make the streams of unseeded requests in this process repeatable from `seed` (None:
    the OS's entropy again)."""
    global _unseeded
    _unseeded = None if seed is None else torch.Generator().manual_seed(seed)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is not None:
        g.manual_seed(seed)
    elif _unseeded is not None:
        g.manual_seed(int(torch.randint(0, 1 << 62, (), generator=_unseeded)))
    else:
        g.seed()
    return g


def warp_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 probabilities [N, V] for N rows of logits; row i uses params[i].

    Greedy rows become one-hot at the argmax, so every consumer (sampler, rejection rule)
    treats greedy as the deterministic limit without a special case leaking into the maths.
    """
    logits = logits.float()
    n = logits.shape[0]
    if len(params) != n:
        raise ValueError(f"{n} rows of logits but {len(params)} sampling params")
    out = torch.empty_like(logits)
    # Rows are chosen from the params the host holds, never by reading the device (a read
    # would wait for the forward on a GPU).
    greedy = [i for i, p in enumerate(params) if p.greedy]
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = to_device(torch.tensor(greedy), logits.device)
        out[idx] = 0.0
        out[idx, logits[idx].argmax(-1)] = 1.0
    if hot:
        idx, temps = to_device_all([torch.tensor(hot), torch.tensor(
            [float(params[i].temperature) for i in hot])], logits.device)
        scaled = logits[idx] / temps.unsqueeze(1)
        min_p = [params[i].min_p for i in hot]
        if any(min_p):
            scaled = _cut_min_p(scaled, min_p)
        top_k = [params[i].top_k for i in hot]
        top_p = [params[i].top_p for i in hot]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            scaled = _cut_top_k_top_p(scaled, top_k, top_p)
        out[idx] = torch.softmax(scaled, dim=-1)
    return out


def _cut_min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's: in logits, below
    the top logit + log(min_p)."""
    m = to_device(torch.tensor([float(x) for x in min_p]), scaled.device).unsqueeze(1)
    floor = scaled.amax(-1, keepdim=True) + torch.log(m)  # log 0 = -inf: nothing dropped
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _cut_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    V = scaled.shape[-1]
    rank = torch.arange(V, device=scaled.device).unsqueeze(0)
    k, p = to_device_all([torch.tensor([kk if kk > 0 else V for kk in top_k]),
                          torch.tensor([float(x) for x in top_p])], scaled.device)
    k, p = k.unsqueeze(1), p.unsqueeze(1)
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
    # it already reaches top_p. The top token always stays.
    before = probs.cumsum(-1) - probs
    drop |= before >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from probs [N, V]; row i draws from generators[i] (reproducible)."""
    u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators])
    return draw_with_uniform(probs, u.to(probs.device))


def draw_with_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the token whose cumulative mass first exceeds u * total."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can land on the last edge through rounding: clamp to the last token with mass.
    last_nonzero = (probs > 0).float().cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)
