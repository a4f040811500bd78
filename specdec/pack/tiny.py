"""Tiny random checkpoints made on the fly (a 96-word vocabulary, two layers): what the
tests and the local autoscaling demo serve where a real model's load time or size would
only get in the way. Weights are seeded from the architecture and overrides alone, so
every run makes the same checkpoint."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch


def save_tiny_tokenizer(path: Path) -> None:
    """A word-level tokenizer for the tiny vocabulary ("w3" .. "w95", eos "</s>" = 2), so the
    fixtures can be served over HTTP like real checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 96)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    t = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>")
    t.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    t.save_pretrained(path)


def make_tiny_checkpoint(path: Path, arch: str, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False, initializer_range=0.15)
    common.update(overrides)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    # A stable seed: Python's hash() of a str changes per process, which would give every
    # test run different weights (and statistical tests a different draw each time).
    torch.manual_seed(zlib.crc32(repr((arch, sorted(overrides.items()))).encode()))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Random biases so that Qwen2's q/k/v biases are exercised (HF inits them at zero).
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    if common["vocab_size"] == 96:
        save_tiny_tokenizer(path)
    return path


def make_perturbed_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """A draft for a tiny target: the same weights plus noise, so it agrees often but not
    always (a random unrelated model would reject nearly everything)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=1e-3))
    model.save_pretrained(dst)
    if (Path(src) / "tokenizer.json").exists():
        save_tiny_tokenizer(dst)
    return dst
