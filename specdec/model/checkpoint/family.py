"""A model family as a description: what its decoder block does beyond the common one (norms
around attention and the MLP, q/k norms, the activation, biases, the embedding's scale), and
where its checkpoints keep each weight, under Hugging Face names and under llama.cpp's GGUF
names. The block (specdec.model.step.block) reads the description; a new family is an entry
here (and, where it needs one, an op), never a copy of the block.

The loader asks for weights by one canonical name per role, the Llama layout's
(`model.layers.{i}.self_attn.q_proj.weight`, ...) plus the roles Llama has not:
`self_attn.q_norm` / `k_norm` (per-head norms before the rotary embedding),
`attn_output_norm` and `mlp_output_norm` (norms on the attention's and the MLP's output,
before each residual add). A family maps each to where its checkpoint stores it, possibly as
a range of rows of a fused tensor (Phi-3's q|k|v and gate|up).
"""

from __future__ import annotations

import dataclasses
import re

# Canonical role (after "model.layers.{i}.", without .weight/.bias) -> GGUF name (after
# "blk.{i}."): llama.cpp's tensor names, the same for every family.
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "attn_output_norm": "post_attention_norm", "mlp_output_norm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?$")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                      # the GGUF architecture and our name for it
    hf_model_types: tuple[str, ...]  # config.json's model_type values it serves
    qkv_bias: bool = False         # q/k/v biases always present (Qwen2)
    qk_norm: bool = False          # RMSNorm of each q and k head before the rotary embedding
    output_norms: bool = False     # attn_output_norm and mlp_output_norm (Gemma 3)
    norm_plus_one: bool = False    # RMSNorm scales by (1 + w); GGUF files store 1 + w
    activation: str = "silu"       # of the gate: "silu" or "gelu_tanh"
    embed_scale: bool = False      # embeddings multiplied by sqrt(hidden size)
    gguf_permute_qk: bool = False  # llama.cpp's converter reorders q/k rows (Llama, Mistral)
    fused_qkv: bool = False        # q|k|v stored as one tensor (HF qkv_proj, GGUF attn_qkv)
    fused_gate_up: bool = False    # gate|up as one (HF gate_up_proj, GGUF ffn_up)
    # Canonical role -> this family's HF role, where they differ.
    hf_renames: tuple[tuple[str, str], ...] = ()
    rope_kinds: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")

    def hf_role(self, role: str) -> str:
        return dict(self.hf_renames).get(role, role)

    @property
    def norm_roles(self) -> tuple[str, ...]:
        roles = ["input_layernorm", "post_attention_layernorm"]
        if self.qk_norm:
            roles += ["self_attn.q_norm", "self_attn.k_norm"]
        if self.output_norms:
            roles += ["attn_output_norm", "mlp_output_norm"]
        return tuple(roles)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), gguf_permute_qk=True),
    Family("mistral", ("mistral",), gguf_permute_qk=True),
    Family("qwen2", ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), qk_norm=True),
    Family("gemma3", ("gemma3_text", "gemma3"), qk_norm=True, output_norms=True,
           norm_plus_one=True, activation="gelu_tanh", embed_scale=True,
           hf_renames=(("post_attention_layernorm", "pre_feedforward_layernorm"),
                       ("attn_output_norm", "post_attention_layernorm"),
                       ("mlp_output_norm", "post_feedforward_layernorm")),
           rope_kinds=("default", "linear")),
    Family("phi3", ("phi3",), fused_qkv=True, fused_gate_up=True,
           rope_kinds=("default", "linear", "longrope")),
)}

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of_model_type(model_type: str) -> Family | None:
    return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a canonical weight is stored: a tensor, or `rows` rows of it from `offset`."""
    name: str
    offset: int = 0
    rows: int | None = None


def fused_part(role: str, q_rows: int, kv_rows: int, inter: int) -> tuple[str, int, int] | None:
    """(the fused role, first row, rows) of a role stored inside a fused tensor."""
    parts = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
             "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
             "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
             "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
             "mlp.up_proj": ("mlp.gate_up_proj", inter, inter)}
    return parts.get(role)
