"""Linear layers in the weight format that runs fastest on the machine at hand.

A decode step is a handful of tokens against every weight of the model, so what matters is
how fast a small-M matmul reads the weights. Measured on x86 CPUs (2 threads, one
8960 x 1536 projection, then the whole Qwen2.5-Coder-1.5B step):

- bf16 weights are fast where the CPU has native bf16 (avx512_bf16 / AMX). Without it
  (AVX2 only) PyTorch's bf16 GEMM costs M times a single-token step: a 5-token verify took
  4x a plain step (774 vs 191 ms), which makes speculation a loss.
- fp16 weights packed for FBGEMM with fp32 activations (`torch.ops.quantized.
  linear_dynamic_fp16`) read half the bytes of fp32 and keep small-M GEMMs efficient on
  AVX2: the 1.5B step took 116 ms for 1 token and 152 ms for 5 (fp32: 346 / 1017 ms).

- int8 weights (per output channel) with activations quantized per tensor at run time
  (FBGEMM's dynamic int8, `torch.ops.quantized.linear_dynamic`) read a quarter of fp32's
  bytes and compute in 8-bit integers: one 8960 x 1536 projection took 0.40 / 0.71 ms for
  1 / 5 rows against 0.82 / 1.35 for fp16 packed. A row's output then depends on the other
  rows of its batch (the activation scale is the batch's), so "int8-dynamic" is for the
  draft only: exactness never depends on the draft's numbers, only acceptance does (the q
  the rejection rule uses is what the draft really sampled from, whatever produced it).
- "w8a8" gives every row its own activation scale and accumulates in integers (FBGEMM's
  static u8 x s8 -> s32 kernel on rows pre-divided by their scale): a row's logits are then
  bit-identical alone and inside any batch, so the target may use it and greedy speculative
  output stays token-identical to plain. The 8960 x 1536 projection: 0.23 / 0.33 ms for
  1 / 5 rows against fp16 packed's 0.52 / 1.05 (same run, a busy machine). "int8" adds a
  second int8 level per row for its rounding error, to stay as close to the checkpoint as
  llama.cpp's own arithmetic is (specdec/int8_linear.py).

Formats: "float32", "bfloat16", "float16", "int8", "w8a8", "int8-dynamic" (draft only) and
"auto". On a CPU
"float16" means fp16 weights with fp32 activations through FBGEMM; on CUDA it is plain fp16.
"auto" picks bf16 on CUDA; on a CPU it measures the candidates it has (bf16 where the CPU
has native bf16, fp16 packed where FBGEMM runs) on a projection of the real size and keeps
the faster, else fp32. Flags alone mislead: on a 2-core AMD EPYC with avx512_bf16 the 1.5B's
plain step took 160-220 ms in bf16 and 62-104 ms fp16 packed. Exactness tests always run
float32.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

FORMATS = ("auto", "float32", "bfloat16", "float16", "int8", "w8a8", "int8-dynamic")
# Formats whose row results depend on the other rows of a batch: never for a target.
BATCH_DEPENDENT = frozenset({"int8-dynamic"})
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str                  # float32 | bfloat16 | float16
    weight_dtype: torch.dtype  # how weights are stored
    act_dtype: torch.dtype     # activations, KV cache
    packed: bool               # fp16 weights packed for FBGEMM (CPU)
    int8: bool = False         # int8 weights and activations (FBGEMM, CPU)
    per_row: bool = False      # int8 activations scaled per row (batch-independent)
    levels: int = 2            # per-row int8 levels: 2 (int8) or 1 (w8a8)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        if self.int8:
            from specdec.int8_linear import RowInt8Linear

            return RowInt8Linear(weight, bias, self.levels) if self.per_row else \
                DynamicInt8Linear(weight, bias)
        if self.packed:
            return PackedFp16Linear(weight, bias)
        w = weight.to(self.weight_dtype)
        return DenseLinear(w, None if bias is None else bias.to(self.act_dtype))


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.lru_cache(maxsize=1)
def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_format(name: str | torch.dtype, device: str | torch.device = "cpu") -> WeightFormat:
    """A format name (or torch dtype) -> what to store and compute in on this device."""
    if isinstance(name, torch.dtype):
        name = {v: k for k, v in _TORCH.items()}.get(name, str(name))
    name = _ALIASES.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"dtype must be one of {list(FORMATS)}, got {name!r}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "bfloat16" if cuda else fastest_cpu_format(torch.get_num_threads())
    if name in ("int8", "w8a8", "int8-dynamic"):
        if cuda or not fbgemm_available():
            # Where FBGEMM's int8 does not run, the config still starts, in the fastest
            # format here (a batch-independent one: the target may be asking).
            warnings.warn(f"dtype {name!r} needs FBGEMM on a CPU (x86); using 'auto' here",
                          stacklevel=2)
            return resolve_format("auto", device)
        # The embedding table is only indexed: kept in fp16, cast per lookup.
        return WeightFormat(name, torch.float16, torch.float32, packed=False, int8=True,
                            per_row=name != "int8-dynamic", levels=2 if name == "int8" else 1)
    if name == "float16" and not cuda and fbgemm_available():
        return WeightFormat(name, torch.float16, torch.float32, packed=True)
    return WeightFormat(name, _TORCH[name], _TORCH[name], packed=False)


def cpu_candidates() -> list[str]:
    """The CPU formats worth measuring here, in order of preference on a tie."""
    out = []
    if cpu_has_native_bf16():
        out.append("bfloat16")
    if fbgemm_available():
        out.append("float16")
    return out or ["float32"]


@functools.cache
def fastest_cpu_format(threads: int) -> str:
    """The candidate with the shortest plain step + verify on one MLP projection of a
    1.5B model (8960 x 1536), measured with this process's threads (once per process)."""
    candidates = cpu_candidates()
    if len(candidates) == 1:
        return candidates[0]
    return choose_fastest(candidates, _time_formats(candidates).get)


def choose_fastest(candidates: list[str], time_fn) -> str:
    """time_fn(name) -> seconds of a 1-row plus a 5-row forward; the fastest name (the
    first on a tie)."""
    times = {name: time_fn(name) for name in candidates}
    return min(candidates, key=lambda n: (times[n], candidates.index(n)))


def _time_formats(names: list[str], reps: int = 12) -> dict[str, float]:
    """Seconds of a 1-row plus a 5-row forward per format. The formats take turns call by
    call and each keeps its fastest call: a busy machine (the app often starts beside a
    build) only ever adds time, and it must not add it to one format more than another.
    On a busy start the medians of separate blocks once chose bf16, 2.9x slower here."""
    import time

    gen = torch.Generator().manual_seed(0)
    # Two weights, 55 MB together in bf16: more than a big L3, so weights stream from memory
    # as they do in a whole model.
    weights = [torch.randn(8960, 1536, generator=gen) * 0.02 for _ in range(2)]
    layers = {}
    for name in names:
        fmt = resolve_format(name)
        layers[name] = (fmt, [fmt.linear(w) for w in weights])
    best = {(n, rows): float("inf") for n in names for rows in (1, 5)}
    xs = {rows: torch.randn(rows, 1536, generator=gen) for rows in (1, 5)}
    for i in range(reps + 1):
        for rows in (1, 5):
            for name in names:
                fmt, ls = layers[name]
                x = xs[rows].to(fmt.act_dtype)
                t = time.perf_counter()
                ls[i % 2](x)
                if i:  # the first round pays for kernel selection
                    best[name, rows] = min(best[name, rows], time.perf_counter() - t)
    return {n: best[n, 1] + best[n, 5] for n in names}


class Linear:
    """y = x W^T + b for one (possibly sharded) weight, whatever its storage."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def first_rows(self, n: int) -> Linear:
        """The same layer limited to its first n outputs (a draft's vocabulary limit)."""
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + b

    def first_rows(self, n: int) -> DenseLinear:
        return DenseLinear(self.weight[:n], None if self.bias is None else self.bias[:n])


class PackedFp16Linear(Linear):
    """fp16 weights in FBGEMM's packed layout, fp32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        # Round to fp16 first, so the packed values are exactly the fp16 weights.
        w = weight.to(torch.float16).float().contiguous()
        self.bias = None if bias is None else bias.float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else 4 * self.bias.numel()
        return 2 * self.out_features * self.in_features + b

    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(self._packed)[0]

    def first_rows(self, n: int) -> PackedFp16Linear:
        return PackedFp16Linear(self.weight()[:n],
                                None if self.bias is None else self.bias[:n])


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """FBGEMM's packed int8 weights, one symmetric scale per output channel."""
    w = weight.float().contiguous()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13;
        warnings.simplefilter("ignore", UserWarning)  # FBGEMM's packing still takes them
        q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long),
                                       0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, bias)


class PackedInt8Linear(Linear):
    """FBGEMM-packed int8 weights (one scale per output channel) and an fp32 bias; the
    subclasses differ only in how they quantize activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.float()

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else 4 * self.bias.numel()
        return self.out_features * self.in_features + 8 * self.out_features + b

    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack(self._packed)[0].dequantize()


class DynamicInt8Linear(PackedInt8Linear):
    """int8 weights per output channel (symmetric), activations quantized per call; fp32
    in and out (FBGEMM). Batch-dependent: see the module docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self._packed = pack_int8(weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        # reduce_range: 7-bit activations, which FBGEMM's AVX2 kernels need to avoid
        # overflowing their 16-bit intermediate sums.
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def first_rows(self, n: int) -> DynamicInt8Linear:
        # Per-row scales: the kept rows requantize to the same integers.
        return DynamicInt8Linear(self.weight()[:n],
                                 None if self.bias is None else self.bias[:n])
