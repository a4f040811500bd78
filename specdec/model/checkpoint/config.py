"""The decoder's shape and its family's features, read from a Hugging Face checkpoint's
config.json (a GGUF file's metadata is first turned into the same dict: gguf_file.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from specdec.model.checkpoint.architectures import SUPPORTED_ARCHITECTURES, UnsupportedModel
from specdec.model.checkpoint.family import Family, family_of_model_type
from specdec.model.checkpoint.rope import Rope

_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    model_type: str  # the family's name (specdec.model.checkpoint.family.FAMILIES)
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
    rope: Rope = None  # the global layers' rotary embedding
    rope_local: Rope | None = None  # the sliding-window layers', where it differs (Gemma 3)
    layer_windows: tuple[int | None, ...] = ()  # each layer's window (None: all keys)
    attn_scale: float = 0.0  # on q.k (0: 1 / sqrt(head_dim))
    embed_scale: float | None = None  # on the embeddings (Gemma: sqrt(hidden))

    @functools.cached_property
    def family(self) -> Family:  # read in every layer of every forward
        return family_of_model_type(self.model_type)

    @property
    def context_limit(self) -> int:
        """The longest context this checkpoint is served to exactly."""
        return min(self.max_position_embeddings, self.rope.context_limit or 1 << 62)

    def rope_of(self, layer: int) -> Rope:
        local = self.rope_local is not None and self.layer_windows[layer] is not None
        return self.rope_local if local else self.rope

    @classmethod
    def from_dict(cls, cfg: dict) -> DecoderConfig:
        model_type = cfg.get("model_type", "?")
        fam = family_of_model_type(model_type)
        if fam is None:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_unimplemented(cfg, fam)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 4096)
        rope, rope_local = _ropes(cfg, fam, head_dim, max_pos)
        window = cfg.get("sliding_window")
        windows = tuple(window if t == "sliding_attention" else None
                        for t in _layer_types(cfg, fam, layers))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        bias = bool(cfg.get("attention_bias", False))
        scalar = cfg.get("query_pre_attn_scalar") if fam.name == "gemma3" else None
        return cls(
            model_type=fam.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (and no o bias); the others where configured.
            qkv_bias=fam.qkv_bias or bias,
            o_bias=(not fam.qkv_bias) and bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window if any(windows) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope=rope,
            rope_local=rope_local,
            layer_windows=windows,
            attn_scale=float(scalar) ** -0.5 if scalar else head_dim ** -0.5,
            embed_scale=cfg["hidden_size"] ** 0.5 if fam.embed_scale else None,
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


def _refuse_unimplemented(cfg: dict, fam: Family) -> None:
    """A setting that changes the maths and that the block does not implement."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or \
        ("gelu_pytorch_tanh" if fam.activation == "gelu_tanh" else "silu")
    if act not in _ACTIVATIONS[fam.activation]:
        raise UnsupportedModel(f"{fam.name}: activation {act!r} is not supported (this family "
                               f"runs {_ACTIVATIONS[fam.activation][0]!r})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModel(f"{fam.name}: {key} {cfg[key]} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{fam.name}: bidirectional attention (an embedding model) is "
                               "not a decoder this server runs")
    if cfg.get("layer_types") and set(cfg["layer_types"]) - {"full_attention",
                                                              "sliding_attention"}:
        raise UnsupportedModel(f"{fam.name}: layer types {sorted(set(cfg['layer_types']))} "
                               "are not supported (full_attention, sliding_attention)")


def _layer_types(cfg: dict, fam: Family, layers: int) -> list[str]:
    """Each layer's attention: what the config lists, else what the family's reference
    derives (transformers' configs of each family)."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != layers:
            raise UnsupportedModel(f"layer_types lists {len(types)} layers of {layers}")
        return types
    window = cfg.get("sliding_window")
    if not window:
        return ["full_attention"] * layers
    if fam.name == "gemma3":
        p = cfg.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(layers)]
    if fam.name in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return ["full_attention"] * layers
        first = cfg.get("max_window_layers", layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["sliding_attention"] * layers  # mistral, phi3: every layer


def _ropes(cfg: dict, fam: Family, head_dim: int, max_pos: int) -> tuple[Rope, Rope | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    per_type = isinstance(params.get("full_attention"), dict)
    glob = dict(params.get("full_attention", {}) if per_type else params)
    theta = float(cfg.get("rope_theta", glob.get("rope_theta", 10000.0)))
    if "original_max_position_embeddings" not in glob and cfg.get(
            "original_max_position_embeddings"):
        glob["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    partial = float(cfg.get("partial_rotary_factor", 1.0))

    def build(p: dict, base: float) -> Rope:
        rope = Rope.from_parameters(p, base, head_dim, max_pos, partial)
        if rope.kind not in fam.rope_kinds:
            raise UnsupportedModel(f"{fam.name}: rope scaling {rope.kind!r} is not supported "
                                   f"for this family; supported: {', '.join(fam.rope_kinds)}")
        return rope

    rope = build(glob, theta)
    divisors = cfg.get("rope_freq_divisors")  # a GGUF file's rope_freqs (gguf_config.py)
    if divisors:
        if len(divisors) != rope.dim // 2:
            raise UnsupportedModel(f"rope_freqs holds {len(divisors)} factors for "
                                   f"{rope.dim // 2} rotary frequencies")
        rope = dataclasses.replace(rope, freq_divisors=tuple(divisors))
    local = None
    if per_type and "sliding_attention" in params:
        local = build(dict(params["sliding_attention"]), theta)
    elif cfg.get("rope_local_base_freq") is not None:
        local = build({}, float(cfg["rope_local_base_freq"]))
    elif fam.name == "gemma3":
        local = build({}, 10000.0)  # transformers' and llama.cpp's default for Gemma 3
    return rope, local
