"""Weight formats: which one a model group runs in, and the fastest on the machine at hand.

A decode step is a handful of tokens against every weight of the model, so what matters is
how fast a small-M matmul reads the weights (specdec_bench/RESULTS.md has the figures).

- "bfloat16" is fast where the CPU has native bf16 (avx512_bf16 / AMX). Without it PyTorch's
  bf16 GEMM costs about M times a single-token step, so a verify becomes a loss.
- "float16" on a CPU: fp16 weights packed for FBGEMM with fp32 activations
  (`quantized.linear_dynamic_fp16`): half of fp32's bytes, small-M GEMMs stay efficient on
  AVX2. On CUDA it is plain fp16.
- "int8-dynamic": int8 weights per output channel, activations quantized per tensor at run
  time (FBGEMM's `quantized.linear_dynamic`): a quarter of fp32's bytes, 8-bit integer
  arithmetic. A row's output depends on the other rows of its batch (the activation scale
  is the batch's), so it is for the draft only: exactness never depends on the draft's
  numbers, only acceptance does.
- "w8a8" gives every row its own activation scale and accumulates in integers (FBGEMM's
  static u8 x s8 -> s32 kernel on rows pre-divided by their scale): a row's logits are
  bit-identical alone and inside any batch, so a target may use it. "int8" adds a second
  int8 level per row for its rounding error, to stay as close to the checkpoint as
  llama.cpp's own arithmetic (int8_linear.py).
- "q4k" keeps what a GGUF file stores as Q4_K or Q6_K in its very blocks and runs them with
  our own kernel (q4k.py, q6k.py: int8 activations per 256 columns of a row, integer dot
  products, so batch-independent too): 4.6 and 6.6 bits read a weight against int8's 8, the
  bytes a CPU decode step is bound by. Tensors in other quantized types (Q5, Q8) run as
  `int8`; float weights are quantized to Q4_K blocks. It is the CPU target's default.
- "int4": every projection in Q4_K blocks through the same kernel, whatever the file stores
  (Q5/Q6/Q8 tensors rounded to 4 bits, partial blocks zero-padded): the fewest bytes, and
  further from the file, so for drafts: a draft's rounding moves acceptance, never exactness.
- "auto" picks bf16 on CUDA; on a CPU it measures the candidates it has (bf16 where the CPU
  has native bf16, fp16 packed where FBGEMM runs) on a projection of the real size and keeps
  the faster, else fp32: CPU flags alone chose wrong.

Exactness tests always run float32.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path

import torch

from specdec.model.formats import kquant_choice
from specdec.model.formats.int8_linear import DynamicInt8Linear, RowInt8Linear
from specdec.model.formats.linear import DenseLinear, Linear, PackedFp16Linear
from specdec.vocabulary import FORMATS

_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str                  # its name in the table (specdec/vocabulary.py)
    weight_dtype: torch.dtype  # how weights are stored
    act_dtype: torch.dtype     # activations (the KV cache: kv_dtype)
    packed: bool               # fp16 weights packed for FBGEMM (CPU)
    int8: bool = False         # int8 weights and activations (FBGEMM, CPU)
    # Batch-independent rows: int8 activations scaled per row, every token attending alone
    # (specdec/model/formats/token_attention.py) over an fp16 cache.
    per_row: bool = False
    levels: int = 2            # per-row int8 levels: 2 (int8) or 1 (w8a8)
    q4k: bool = False          # Q4_K blocks through our kernel, the rest as int8
    round_all_to_q4k: bool = False  # every projection in Q4_K blocks, whatever the file (int4)

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores. The batch-invariant CPU formats keep K/V in fp16 (half
        of fp32's bytes, llama.cpp's default), read by the token-attention kernel as they
        are; the others in the activations' dtype, for SDPA."""
        return torch.float16 if self.per_row else self.act_dtype

    def linear(self, weight, bias: torch.Tensor | None = None) -> Linear:
        """weight: a float tensor, or under q4k/int4 a kquant_choice.FileWeight."""
        if self.q4k:
            return kquant_choice.linear(weight, bias, self.round_all_to_q4k)
        if self.int8:
            return RowInt8Linear(weight, bias, self.levels) if self.per_row else \
                DynamicInt8Linear(weight, bias)
        if self.packed:
            return PackedFp16Linear(weight, bias)
        w = weight.to(self.weight_dtype)
        return DenseLinear(w, None if bias is None else bias.to(self.act_dtype))

    def linear_rows(self, parts: list, bias: torch.Tensor | None = None) -> Linear:
        """One linear over weights stacked by rows (q|k|v, gate|up). Under q4k/int4, parts the
        file stores differently (a Q6_K v beside Q4_K q and k) each keep their own storage."""
        if self.q4k:
            return kquant_choice.linear_rows(parts, bias, self.round_all_to_q4k)
        return self.linear(torch.cat(parts), bias)


@dataclasses.dataclass(frozen=True)
class FormatEntry:
    """One weight format: how it stores and runs a weight on a CPU, what that needs, and
    what it may serve."""

    cpu: WeightFormat | None        # on a CPU where `needs` run (None: "auto" decides)
    # What must run here, each with the format used instead where it does not ("plain":
    # the format's own torch dtype, unpacked).
    needs: tuple[tuple[str, str], ...] = ()
    on_cuda: bool = False           # runs on CUDA as its plain torch dtype (else "auto")
    # A row's result depends on the other rows of its batch (the activation scale is the
    # batch's): greedy speculative output would not stay identical to plain.
    batch_dependent: bool = False
    # Why a target may not run in it (None: it may): a target's rows must not depend on
    # their batch, and it must stay as close to its checkpoint as the peer's arithmetic of
    # the same file (`bench formats`). Exactness never depends on the draft's numbers.
    draft_only: str | None = None


def _per_row(name: str, levels: int, **kw) -> WeightFormat:
    """The int8 family: fp16 embedding table (only indexed, cast per lookup), fp32
    activations, per-row int8 activations where per_row."""
    return WeightFormat(name, torch.float16, torch.float32, packed=False, int8=True,
                        levels=levels, **kw)


_FBGEMM = ("fbgemm", "auto")    # int8 GEMMs run on FBGEMM (x86 CPUs)
_KQUANT = ("kquant", "int8")    # our Q4_K/Q6_K kernel (a C++ compiler, AVX512-VNNI)

# The table: one entry per format name (specdec/vocabulary.py spells the names).
TABLE: dict[str, FormatEntry] = {
    "auto": FormatEntry(None),
    "float32": FormatEntry(WeightFormat("float32", torch.float32, torch.float32, False),
                           on_cuda=True),
    "bfloat16": FormatEntry(WeightFormat("bfloat16", torch.bfloat16, torch.bfloat16, False),
                            on_cuda=True),
    "float16": FormatEntry(WeightFormat("float16", torch.float16, torch.float32, packed=True),
                           needs=(("fbgemm", "plain"),), on_cuda=True),
    "int8": FormatEntry(_per_row("int8", 2, per_row=True), needs=(_FBGEMM,)),
    "w8a8": FormatEntry(_per_row("w8a8", 1, per_row=True), needs=(_FBGEMM,)),
    "int8-dynamic": FormatEntry(
        _per_row("int8-dynamic", 1), needs=(_FBGEMM,), batch_dependent=True,
        draft_only="its rows' results depend on the other rows of a batch, so greedy "
                   "speculative output would not stay identical to plain"),
    # Both attend per token through the token-attention kernel (int4 too: at long contexts
    # it is faster than the padded grid).
    "q4k": FormatEntry(_per_row("q4k", 2, per_row=True, q4k=True),
                       needs=(_FBGEMM, _KQUANT)),
    "int4": FormatEntry(
        _per_row("int4", 2, per_row=True, q4k=True, round_all_to_q4k=True),
        needs=(_FBGEMM, _KQUANT),
        draft_only="it rounds every projection to 4 bits, whatever the file stores: further "
                   "from the checkpoint than a target may be"),
}
assert set(TABLE) == set(FORMATS), set(TABLE) ^ set(FORMATS)

# Formats a target may not run in, and why (EngineSpec refuses them for target.dtype).
DRAFT_ONLY = {name: e.draft_only for name, e in TABLE.items() if e.draft_only}

_WITHOUT = {
    "fbgemm": "needs FBGEMM on a CPU (x86)",
    "kquant": "needs its kernel, which did not build here (a C++ compiler and torch's "
              "headers) or has no SIMD form for this CPU (AVX512-VNNI)",
}


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
    """A format name (or torch dtype) -> what to store and compute in on this device: the
    table's entry, or where something it needs does not run here, the entry it names."""
    if isinstance(name, torch.dtype):
        name = {v: k for k, v in _TORCH.items()}.get(name, str(name))
    name = _ALIASES.get(name, name)
    if name not in TABLE:
        raise ValueError(f"dtype must be one of {list(FORMATS)}, got {name!r}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "bfloat16" if cuda else fastest_cpu_format(torch.get_num_threads())
    entry = TABLE[name]
    if cuda:
        if entry.on_cuda:
            return _plain(name)
        # Where FBGEMM's int8 does not run, the config still starts, in the fastest format
        # here (a batch-independent one: the target may be asking).
        warnings.warn(f"dtype {name!r} {_WITHOUT['fbgemm']}; using 'auto' here", stacklevel=2)
        return resolve_format("auto", device)
    for need, instead in entry.needs:
        if not _runs_here(need):
            if instead == "plain":
                return _plain(name)
            warnings.warn(f"dtype {name!r} {_WITHOUT[need]}; using {instead!r} here",
                          stacklevel=2)
            return resolve_format(instead, device)
    return entry.cpu


def _plain(name: str) -> WeightFormat:
    return WeightFormat(name, _TORCH[name], _TORCH[name], packed=False)


def _runs_here(need: str) -> bool:
    if need == "fbgemm":
        return fbgemm_available()
    from specdec.model.formats.q4k import available  # builds the kernel on first use

    return available()


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
    build) only ever adds time, and it must not add it to one format more than another
    (medians of separate blocks can pick the slower format on a busy start)."""
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
