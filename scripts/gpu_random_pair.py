"""GPU check for a CUDA machine that cannot fetch the offline pack: the Qwen pair's real
architectures with random weights.

A forward's time does not depend on the weights' values, so step costs (c, v), the
engine's overhead per step and plain decoding speed measured here are the pair's. What does
depend on the values is acceptance (a random draft agrees with a random target about as
often as chance), so the speedup is predicted from these costs and the acceptance measured
with the real pair on CPU (acceptance is a property of the two models, not of the device).

    python3 scripts/gpu_random_pair.py KIT OUT
KIT holds qwen15/ and qwen05/ with each model's config.json, tokenizer and templates (no
weights); random bf16 checkpoints are written under OUT.

It also writes a "planted" pair (OUT/qwen15p, OUT/qwen05p): the same architectures, so the
same step costs, with weights that make greedy decoding follow a fixed next-token map (every
layer's output projections zeroed, so the residual stream stays the token's embedding, and
the output rows set so the target's argmax after id t is sigma(t)); the draft follows the
same map except on a random share 1 - ALPHA of the ids. A round then keeps each guess with
probability ALPHA, independently, so speculative decoding on a GPU runs end to end at the
acceptance the real pair reaches on CPU (SPECDEC_ALPHA, default 0.88: the real pair's on
code prompts, specdec_bench/RESULTS.md) instead of a random pair's chance agreement.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder

DEVICE = os.environ.get("SPECDEC_DEVICE", "cuda")  # cpu: a smoke run of this script
ALPHA = float(os.environ.get("SPECDEC_ALPHA", "0.88"))
PLANTED_IDS = 32768  # the map stays among the ids a draft with vocab_limit 32768 scores
ROWS = [int(r) for r in os.environ.get("SPECDEC_ROWS", "1 4 8 16").split()]
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "chat_template.jinja")


def build(kit: Path, out: Path, name: str) -> Path:
    dst = out / name
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(kit / name),
                                             dtype=torch.bfloat16)
    m.save_pretrained(dst)
    for f in FILES:
        shutil.copy(kit / name / f, dst / f)
    del m
    return dst


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def plant(src: Path, dst: Path, sigma: torch.Tensor, seed: int) -> Path:
    """A copy of src whose greedy next token after id t is sigma[t % n] (see the docstring)."""
    from safetensors.torch import save_file

    sd = _state(src)
    n = sigma.numel()
    vocab, hidden = sd["model.embed_tokens.weight"].shape
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, hidden, generator=g)
    e /= e.norm(dim=1, keepdim=True)
    # After the final RMSNorm a unit row becomes sqrt(hidden) long: the planted logit is 16,
    # every other about N(0, 0.4^2).
    head = torch.zeros(vocab, hidden)
    head[sigma] = e * (16.0 / hidden ** 0.5)
    sd["model.embed_tokens.weight"] = e.repeat((vocab + n - 1) // n, 1)[:vocab]
    sd["lm_head.weight"] = head
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", *FILES):
        shutil.copy(src / f, dst / f)
    return dst


def planted_pair(target: Path, draft: Path, out: Path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(1)
    sigma = torch.randperm(PLANTED_IDS, generator=g)
    # The draft's map: sigma after a permutation that moves a share 1 - ALPHA of the ids
    # (one cycle through them), so it guesses sigma(t) exactly where t was not moved.
    moved = torch.randperm(PLANTED_IDS, generator=g)[: round((1 - ALPHA) * PLANTED_IDS)]
    tau = torch.arange(PLANTED_IDS)
    tau[moved] = moved.roll(1)
    t = plant(target, out / "qwen15p", sigma, seed=2)
    d = plant(draft, out / "qwen05p", sigma[tau], seed=3)
    print(f"planted pair: acceptance {ALPHA} per guess ({len(moved)} of {PLANTED_IDS} ids "
          "moved)")
    return t, d


def logits_check(path: Path) -> None:
    """Our decoder against transformers' on CUDA in fp32 (the exactness dtype)."""
    ids = list(range(100, 164))
    ours = Decoder.from_checkpoint(path, torch.float32, DEVICE)
    with torch.no_grad():
        got = ours(BatchInput.build([(0, 0, ids)], DEVICE), ours.new_cache(1, 128),
                   torch.arange(len(ids), device=DEVICE))
    del ours
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    with torch.no_grad():
        exp = ref(torch.tensor([ids], device=DEVICE)).logits[0].float()
    del ref
    diff = (got - exp).abs().max().item()
    same = (got.argmax(-1) == exp.argmax(-1)).float().mean().item()
    print(f"{path.name}: {DEVICE} fp32 logits vs transformers: max abs diff {diff:.2e} "
          f"(logit scale {exp.abs().max().item():.2f}), argmax agreement {same:.3f}")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_ms(m: Decoder, rows: int, tokens: int, context: int = 256, repeats: int = 20) -> float:
    """Median wall time of one forward: `rows` rows of `tokens` new tokens each after
    `context` cached tokens (the cache is rewritten at the same positions every repeat)."""
    cache = m.new_cache(rows, context + 16)
    with torch.no_grad():
        m(BatchInput.build([(r, 0, list(range(100, 100 + context))) for r in range(rows)],
                           m.device), cache)
        batch = BatchInput.build([(r, context, list(range(300, 300 + tokens)))
                                  for r in range(rows)], m.device)
        every = torch.arange(rows * tokens, device=m.device)  # a verify needs all positions
        ts = []
        for _ in range(repeats + 3):
            _sync()
            t = time.perf_counter()
            m(batch, cache, every)
            _sync()
            ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts[3:])


def costs(target_path: Path, draft_path: Path) -> None:
    target = Decoder.from_checkpoint(target_path, torch.bfloat16, DEVICE)
    draft = Decoder.from_checkpoint(draft_path, torch.bfloat16, DEVICE).limit_vocab(32768)
    print("\nstep costs, bf16, context 256, medians of 20 (ms); c = draft step / target step,"
          " v_k = target step of k+1 tokens per row / plain step")
    print("rows  target_1  target_3  target_5  draft_1   c      v_2    v_4")
    table = {}
    for rows in ROWS:
        t1, t3, t5 = (step_ms(target, rows, n) for n in (1, 3, 5))
        d1 = step_ms(draft, rows, 1)
        table[rows] = (t1, t3, t5, d1)
        print(f"{rows:<5} {t1:8.2f}  {t3:8.2f}  {t5:8.2f}  {d1:7.2f}  {d1 / t1:5.2f}  "
              f"{t3 / t1:5.2f}  {t5 / t1:5.2f}")
    print("\npredicted speedup over plain, sequential round k*c + v_k, tokens per round "
          "(1 - a^(k+1)) / (1 - a); a = per-token acceptance (the pair's, measured on CPU)")
    print("rows  a     k=2    k=4")
    for rows, (t1, t3, t5, d1) in table.items():
        c = d1 / t1
        for a in (0.6, 0.8, 0.9):
            gains = []
            for k, v in ((2, t3 / t1), (4, t5 / t1)):
                gains.append((1 - a ** (k + 1)) / (1 - a) / (k * c + v))
            print(f"{rows:<5} {a:.1f}  {gains[0]:5.2f}  {gains[1]:5.2f}")


def main() -> int:
    kit, out = Path(sys.argv[1]), Path(sys.argv[2])
    print(torch.__version__, torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)
    t = time.perf_counter()
    target, draft = build(kit, out, "qwen15"), build(kit, out, "qwen05")
    print(f"random checkpoints built in {time.perf_counter() - t:.1f} s")
    logits_check(target)
    logits_check(draft)
    planted_pair(target, draft, out)
    if os.environ.get("SPECDEC_COSTS", "1") == "1":
        costs(target, draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
