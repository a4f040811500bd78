"""Rotary position embedding: each RoPE kind a checkpoint may name, as transformers computes
it (the reference a checkpoint is served equal to), and the per-frequency divisors that
llama.cpp's converter stores in a GGUF file instead of a scaling type (`rope_freqs`).

A kind gives inverse frequencies for the rotary dimensions and a factor on cos and sin.
Two kinds depend on the context in transformers: `dynamic` recomputes its frequencies from
each call's longest position once past `max_position_embeddings` (cached keys would then
have been rotated by other frequencies, so no cache is exact there: the context is capped
at it), and `longrope` takes its long factors for a sequence longer than the original
context; here the choice follows the cache's length, as llama.cpp's does (its `n_ctx`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specdec.model.checkpoint.architectures import UnsupportedModel

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    dim: int  # the rotated dimensions of a head (partial rotary: fewer than the head's)
    kind: str = "default"
    factor: float | None = None
    original_max: int | None = None  # the pre-training context the scaling extends
    max_position_embeddings: int = 4096
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # yarn, longrope: cos and sin are scaled by it
    long_factor: tuple[float, ...] = ()  # longrope
    short_factor: tuple[float, ...] = ()
    freq_divisors: tuple[float, ...] = ()  # GGUF rope_freqs: frequency i is divided by it

    @classmethod
    def from_parameters(cls, params: dict, theta: float, head_dim: int,
                        max_position_embeddings: int, partial: float = 1.0) -> Rope:
        """From a config's `rope_parameters` / `rope_scaling` dict (either spelling)."""
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind == "su":
            kind = "longrope"
        if kind not in KINDS:
            raise UnsupportedModel(f"rope scaling {kind!r} is not supported; supported: "
                                   f"{', '.join(KINDS)}")
        partial = params.get("partial_rotary_factor", partial)
        dim = int(head_dim * partial)
        if dim % 2 or not 0 < dim <= head_dim:
            raise UnsupportedModel(f"partial_rotary_factor {partial} gives {dim} rotary "
                                   f"dimensions of {head_dim}")

        def need(key):
            if params.get(key) is None:
                raise UnsupportedModel(f"rope scaling {kind!r} needs {key!r} in its parameters")
            return params[key]

        if kind in ("linear", "dynamic", "llama3"):
            need("factor")
        if kind in ("llama3", "yarn", "longrope"):
            need("original_max_position_embeddings")
        if kind == "longrope":
            for key in ("long_factor", "short_factor"):
                if len(need(key)) != dim // 2:
                    raise UnsupportedModel(f"longrope {key} has {len(params[key])} entries "
                                           f"for {dim // 2} rotary frequencies")
        return cls(
            theta=float(params.get("rope_theta", theta)), dim=dim, kind=kind,
            factor=None if params.get("factor") is None else float(params["factor"]),
            original_max=params.get("original_max_position_embeddings"),
            max_position_embeddings=max_position_embeddings,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            long_factor=tuple(params.get("long_factor") or ()),
            short_factor=tuple(params.get("short_factor") or ()))

    @property
    def context_limit(self) -> int | None:
        """The longest context served exactly (dynamic: see the module's docstring)."""
        return self.max_position_embeddings if self.kind == "dynamic" else None

    def _base(self) -> torch.Tensor:
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        return self.theta ** exponent

    def tables(self, context: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [dim / 2] fp32, the factor on cos and sin) for a cache of
        `context` positions."""
        inv = 1.0 / self._base()
        scale = 1.0
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = self._llama3(inv)
        elif self.kind == "yarn":
            inv, scale = self._yarn()
        elif self.kind == "longrope":
            inv, scale = self._longrope(context)
        if self.freq_divisors:
            inv = inv / torch.tensor(self.freq_divisors, dtype=torch.float32)
        return inv, scale

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old = self.original_max
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self) -> tuple[torch.Tensor, float]:
        factor = self.factor or self.max_position_embeddings / self.original_max
        scale = self.attention_factor
        if scale is None:
            scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def dim_for(rotations: float) -> float:
            return (self.dim * math.log(self.original_max / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        base = self._base()
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
        return inv, float(scale)

    def _longrope(self, context: int) -> tuple[torch.Tensor, float]:
        factor = self.factor or self.max_position_embeddings / self.original_max
        scale = self.attention_factor
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(
                1 + math.log(factor) / math.log(self.original_max))
        ext = self.long_factor if context > self.original_max else self.short_factor
        inv = 1.0 / (torch.tensor(ext, dtype=torch.float32) * self._base())
        return inv, float(scale)
