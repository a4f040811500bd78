"""The decoder's shape, read from a Hugging Face checkpoint's config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specdec.model.checkpoint.architectures import SUPPORTED_ARCHITECTURES, UnsupportedModel


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, cfg: dict) -> DecoderConfig:
        model_type = cfg.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModel(f"rope scaling {rope_type!r} is not supported (only default)")
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qwen = model_type == "qwen2"
        window = None
        if model_type == "mistral" or (qwen and cfg.get("use_sliding_window")):
            window = cfg.get("sliding_window")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Mistral have them only when configured.
            qkv_bias=qwen or bool(cfg.get("attention_bias", False)),
            o_bias=(not qwen) and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> DecoderConfig:
        """From a checkpoint directory's config.json, else from a GGUF file's metadata."""
        path = Path(path)
        if (path / "config.json").exists():
            return cls.from_dict(json.loads((path / "config.json").read_text()))
        from specdec.model.checkpoint.gguf_file import config_dict, gguf_in

        gguf = gguf_in(path)
        if gguf is None:
            raise UnsupportedModel(f"{path} holds neither a config.json nor a GGUF file")
        return cls.from_dict(config_dict(gguf))
