"""Resolve a model reference to a local checkpoint directory.

A reference is a pack name (see specdec.pack.offline), a local checkpoint directory, a GGUF file
(as llama.cpp users have them; see specdec.model.checkpoint.gguf_file), or a hub id.
Hub ids are handed to transformers' own download machinery and only work where a hub is
reachable; nothing in tests or the default configuration uses one.
"""

from __future__ import annotations

from pathlib import Path

from specdec.pack import offline as pack


class ModelNotFound(RuntimeError):
    pass


def resolve(ref: str, fetch_missing: bool = False) -> Path:
    if ref in pack.PACK:
        if pack.is_fetched(ref):
            return pack.verify(ref)
        if fetch_missing:
            return pack.fetch(ref)
        raise ModelNotFound(
            f"pack model {ref!r} is not fetched yet; run `specdec models fetch {ref}`"
        )
    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {ref!r} does not exist")
        return path
    if path.is_dir():
        if not (path / "config.json").exists() and not list(path.glob("*.gguf")):
            raise ModelNotFound(f"{path} is a directory but holds no config.json checkpoint "
                                "and no GGUF file")
        return path
    if path.exists() or ref.startswith((".", "/", "~")):
        raise ModelNotFound(f"{ref!r} is not a checkpoint directory")
    if ref.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds
            raise ModelNotFound(f"hub id {ref!r} could not be loaded: {exc}") from exc
    known = ", ".join(pack.PACK)
    raise ModelNotFound(
        f"unknown model {ref!r}: give a pack name ({known}), a checkpoint directory or a hub id"
    )


def transformers_args(path: str | Path) -> tuple[str, dict]:
    """(directory, keyword arguments) for transformers' from_pretrained on a resolved
    reference: a GGUF is named by `gguf_file` (transformers dequantizes it itself, which
    makes it an independent reference for our loader)."""
    from specdec.model.checkpoint.gguf_file import gguf_in

    path = Path(path)
    gguf = gguf_in(path)
    if gguf is None:
        return str(path), {}
    return str(gguf.parent), {"gguf_file": gguf.name}


def transformers_model(path: str | Path, dtype):
    """transformers' own model for a resolved reference (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    where, kw = transformers_args(path)
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw)
