"""The GGUF header reader: every field and every tensor's bytes as the `gguf` package's own
reader sees them (every value type, string arrays undecoded until asked), on a file written
by the `gguf` package and on a file of the pack; files it cannot read are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from specdec.model.checkpoint.gguf_header import GGUFFormatError, GGUFHeader, StringArray, plain


def assert_same_as_gguf_package(path) -> GGUFHeader:
    ours, ref = GGUFHeader(path), GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        if field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.ARRAY]:
            continue  # the package flattens arrays of arrays; ours keeps their shape
        got, want = plain(ours.fields[key]), field.contents()
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.shape == tuple(int(x) for x in b.shape), a.name
        assert a.tensor_type == int(b.tensor_type) and a.n_bytes == int(b.n_bytes), a.name
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name
    return ours


@pytest.fixture
def every_value_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = GGUFWriter(str(path), "llama")
    for i, vtype in enumerate((GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
                               GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
                               GGUFValueType.UINT64, GGUFValueType.INT64)):
        w.add_key_value(f"t.int{i}", 7 + i, vtype)
    w.add_key_value("t.f32", 0.25, GGUFValueType.FLOAT32)
    w.add_key_value("t.f64", -1.5e-300, GGUFValueType.FLOAT64)
    w.add_key_value("t.bool", True, GGUFValueType.BOOL)
    w.add_string("t.str", "héllo \u2603")
    w.add_array("t.ints", [3, -1, 2**31 - 1])
    w.add_array("t.floats", [0.5, 2.0])
    w.add_array("t.strs", ["", "a", "\u00e9\u00e9", "x" * 300])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    q = quantize(rng.standard_normal((4, 256)).astype(np.float32), Q.Q8_0)
    w.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.add_tensor("c.weight", rng.standard_normal(7).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_reads_as_the_gguf_package_reads_it(every_value_type):
    header = assert_same_as_gguf_package(every_value_type)
    strs = header.fields["t.strs"]
    assert isinstance(strs, StringArray) and len(strs) == 4 and strs.tolist()[3] == "x" * 300
    assert header.fields["t.nested"] == [[1, 2], [3]]
    assert [t.data.size for t in header.tensors] == [3 * 5 * 4, 4 * 256 // 32 * 34, 7 * 2]


def test_files_it_cannot_read_are_refused_by_name(every_value_type, tmp_path):
    raw = every_value_type.read_bytes()
    for name, data, match in (
            ("magic.gguf", b"GGML" + raw[4:], r"magic.gguf: not a GGUF file"),
            ("version.gguf", raw[:4] + (9).to_bytes(4, "little") + raw[8:],
             r"version.gguf: GGUF version 9 is not supported"),
            ("cut.gguf", raw[:-40],
             r"cut.gguf: tensor '.\.weight': its \d+ bytes at offset \d+ run past the end")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFFormatError, match=match):
            GGUFHeader(tmp_path / name)


@pytest.mark.real_model
def test_a_pack_file_reads_as_the_gguf_package_reads_it(smollm2_path):
    """SmolLM2's file: a 49,152-token vocabulary and its merges as string arrays, Q4_1."""
    header = assert_same_as_gguf_package(smollm2_path / "model.gguf")
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152
