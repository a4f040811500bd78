"""Findings of the review of the kernel, the loader, the engine and the ingress, each held:
token ids checked at admission, a draft that could guess ids the target lacks refused, a row
whose values go non-finite failed alone, the kernels' non-finite and tiny inputs, the kernel
cache refusing directories others could write, the detokenizer's work per step bounded, a
set but empty API key refused."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, load, make_engine, plain_reference, random_prompts

from specdec.engine.request import Request
from specdec.errors import ConfigError, EngineError
from specdec.model.step.sampling import SamplingParams


def test_prompt_ids_are_checked_against_the_models_at_admission(tiny_llama, tiny_llama_draft):
    engine = make_engine(tiny_llama, tiny_llama_draft)
    good = random_prompts((6,), seed=1)[0]
    with pytest.raises(EngineError, match=r"outside the models' vocabulary \(0\.\.95\)") as e:
        engine.add_request(Request("bad", good + [96], greedy(4)))
    assert e.value.param == "prompt"
    with pytest.raises(EngineError):
        engine.add_request(Request("neg", [-1, 5], greedy(4)))
    # Nothing of it reached a step: the next request is served as usual.
    out = engine.run([Request("ok", good, greedy(8))])["ok"]
    assert out.error is None and out.token_ids == plain_reference(tiny_llama, [good], 8)[0]


def test_a_draft_with_more_ids_than_its_target_is_refused(tiny_llama, tmp_path):
    from conftest import make_tiny_checkpoint

    from specdec.engine.assemble import check_spec
    from specdec.engine.spec import EngineSpec

    big = make_tiny_checkpoint(tmp_path / "big", "llama", vocab_size=128)
    spec = EngineSpec.model_validate({"target": {"model": str(tiny_llama)},
                                      "draft": {"model": str(big)},
                                      "runtime": {"max_len": 128}})
    with pytest.raises(ConfigError, match=r"draft.model: its vocabulary \(128 ids\) exceeds "
                                          r"the target's \(96\)"):
        check_spec(spec, tiny_llama, big)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_gone_non_finite_fails_alone(tiny_llama, tiny_llama_draft, temperature):
    """A NaN in one request's values (here its prompt's embedding) fails that request with
    an error and no tokens; the rows beside it run on to plain decoding's tokens."""
    engine = make_engine(tiny_llama, tiny_llama_draft)
    model = load(tiny_llama)
    saved = model.embed[7].clone()
    try:
        model.embed[7] = float("nan")
        prompts = random_prompts((5, 8, 6), seed=2)
        prompts = [[p for p in ps if p != 7] for ps in prompts]
        poisoned = [9, 7, 11]
        params = SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True,
                                seed=3)
        out = engine.run([Request(f"r{i}", p, params, "draft", 2) for i, p in
                          enumerate(prompts)] + [Request("nan", poisoned, params, "draft", 2)])
    finally:
        model.embed[7] = saved
    assert out["nan"].finish_reason == "error" and "non-finite" in out["nan"].error
    assert out["nan"].token_ids == []
    for i in range(3):  # (a sampled row may draw token 7 itself, and fail from there)
        r = out[f"r{i}"]
        assert (r.error is None and len(r.token_ids) == 10) or r.token_ids[-1:] == [7]
    if temperature == 0.0:
        expected = plain_reference(tiny_llama, prompts, 10)
        assert [out[f"r{i}"].token_ids for i in range(3)] == expected


def test_the_q4k_kernel_keeps_nan_visible_and_tiny_rows_finite():
    from specdec.model.formats import q4k

    if not q4k.available():
        pytest.skip("the q4k kernel needs a C++ compiler and AVX512-VNNI")
    g = torch.Generator().manual_seed(0)
    layer = q4k.Q4KLinear(q4k.quantize(torch.randn(32, 512, generator=g)))
    x = torch.randn(5, 512, generator=g)
    clean = layer(x)
    x[1, 300] = float("nan")
    x[3, 10] = float("inf")
    x[4] = 1e-38  # a scale of 127 / 1e-38 overflows
    got = layer(x)
    assert torch.isnan(got[1]).all() and torch.isnan(got[3]).all()
    assert torch.isfinite(got[4]).all()
    assert torch.equal(got[[0, 2]], clean[[0, 2]])  # the other rows are untouched
    with pytest.raises(ValueError, match="input of width 511, the layer takes 512"):
        layer(x[:, :511])


def test_the_kernel_cache_refuses_directories_others_could_write(tmp_path, monkeypatch):
    import os

    from specdec.model.formats.kernels import build

    mine = tmp_path / "kernels"
    assert build._private_dir(mine) == mine and (mine.stat().st_mode & 0o777) == 0o700
    mine.chmod(0o777)
    with pytest.raises(build.KernelUnavailable, match="writable by others"):
        build._private_dir(mine)
    mine.chmod(0o700)
    uid = os.getuid()
    monkeypatch.setattr(build.os, "getuid", lambda: uid + 1)
    with pytest.raises(build.KernelUnavailable, match="belongs to uid"):
        build._private_dir(mine)


def test_the_kernel_cache_is_created_owner_only_under_a_group_writable_umask(tmp_path):
    """Under umask 002 the parents the cache creates (~/.cache/specdec, say) would come out
    group-writable and the cache be refused: the service would fall back to slower
    formats. Created owner-only instead."""
    import os

    from specdec.model.formats.kernels import build

    deep = tmp_path / "home" / ".cache" / "specdec" / "kernels"
    old = os.umask(0o002)
    try:
        assert build._private_dir(deep) == deep
    finally:
        os.umask(old)
    for d in (deep, deep.parent, deep.parent.parent, deep.parent.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700, (d, oct(d.stat().st_mode))


@pytest.mark.real_model
def test_the_detokenizer_decodes_a_bounded_window_per_step(qwen_target_path):
    """Incremental: the text equals decoding the whole output, streamed deltas add up to it
    (multi-byte characters included), and no step decodes more than a few tokens."""
    from specdec.engine.stop import Detokenizer
    from specdec.pack.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen_target_path)
    text = ("def f(x):\n    return x ** 2  # ok\n" * 20 + "日本語のテキスト 🙂 ünïcödé " * 10)
    ids = tok(text).input_ids
    longest = []

    class Counting:
        def decode(self, part, **kw):
            longest.append(len(part))
            return tok.decode(part, **kw)

    d = Detokenizer(Counting())
    streamed = ""
    for i in range(len(ids)):
        d.add([ids[i]])
        streamed += d.delta(final=i == len(ids) - 1)
    assert d.text == tok.decode(ids, skip_special_tokens=True) == streamed
    assert len(ids) > 300 and max(longest) <= 12, max(longest)


def test_a_set_but_empty_api_key_is_refused():
    from deployments.api_key import api_key_from

    assert api_key_from({}, None) is None
    assert api_key_from({}, "configured-key") == "configured-key"
    assert api_key_from({"SPECDEC_API_KEY": "sk-0123456789"}, None) == "sk-0123456789"
    for bad in ("", "   ", "short"):
        with pytest.raises(ConfigError, match="SPECDEC_API_KEY is set but"):
            api_key_from({"SPECDEC_API_KEY": bad}, "configured-key")
