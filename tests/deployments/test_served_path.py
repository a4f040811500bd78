"""The served path with a draft that really disagrees with its target (rejections, residual
draws and rollbacks cross Ray): greedy over HTTP with a TP=2 target equals plain; sampled
output through the Ray draft actor follows the target's distribution; the threads a shard
computes with are the ones configured; bad configs fail naming the field."""

from __future__ import annotations

import collections
import shutil

import httpx
import pytest
import ray
import torch
from engine_helpers import contingency_pvalue
from ray import serve
from serve_helpers import tiny_spec

from deployments.app import build_app
from deployments.launch import local_ray, ray_engine
from specdec.engine.assemble import LocalBackend, assemble, check_spec
from specdec.engine.request import Request
from specdec.errors import ConfigError
from specdec.model.step.sampling import SamplingParams
from specdec.ports import free_port

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def ray_local():
    with local_ray(num_cpus=6):
        yield


def test_shards_compute_with_the_configured_threads(ray_local, tiny_llama, tiny_llama_draft):
    spec = tiny_spec(tiny_llama, tiny_llama_draft,
                     target={"threads": 2, "resources": {"num_cpus": 2}},
                     draft={"threads": 2, "resources": {"num_cpus": 0}})
    with ray_engine(spec) as built:
        for group in (built.target.group, built.draft.group):
            # Read on the thread that runs the forwards, from OpenMP itself: Ray sets
            # OMP_NUM_THREADS=1 for fractional-CPU actors and its threads keep it.
            seen = ray.get(group.leader.threads.remote())
            assert seen == {"torch": 2, "openmp": 2, "env": "2"}, seen


def test_sampled_output_through_the_ray_draft_follows_the_target(ray_local, tiny_llama,
                                                                 tiny_llama_far_draft):
    n = 4000
    prompt = [5, 17, 33, 8]

    def counts(engine, method):
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        reqs = [Request.pinned(f"s{i}", prompt, params, method, 2) for i in range(n)]
        outs = engine.run(reqs)
        return collections.Counter(tuple(o.token_ids[:3]) for o in outs.values())

    spec = tiny_spec(tiny_llama, tiny_llama_far_draft, runtime={"max_slots": 64, "max_len": 16},
                     draft={"q_top_m": 4}, max_waiting=10**5)
    threads = torch.get_num_threads()
    with assemble(spec, LocalBackend()) as local:  # sets this process's threads: restore
        plain = counts(local.engine, "none")
    torch.set_num_threads(threads)
    with ray_engine(spec) as built:
        spec_counts = counts(built.engine, "draft")
        totals = built.engine.totals["draft"]
        assert 0.05 * totals.drafted < totals.accepted < totals.drafted  # rejections happen
        assert any(r.draft_bytes for r in built.engine.history)  # it crossed a process
    assert contingency_pvalue(plain, spec_counts) > 1e-3
    for j in range(3):
        pm, sm = collections.Counter(), collections.Counter()
        for c, src in ((pm, plain), (sm, spec_counts)):
            for toks, cnt in src.items():
                c[toks[j]] += cnt
        assert contingency_pvalue(pm, sm) > 1e-3, f"position {j}"


def test_greedy_over_http_with_tp2_and_a_disagreeing_draft_equals_plain(ray_local, tiny_llama,
                                                                         tiny_llama_far_draft):
    args = tiny_spec(tiny_llama, tiny_llama_far_draft, target={"tp": 2}).model_dump()
    args.update({"model_name": "tiny", "replica_cpus": 0.1, "ingress_cpus": 0.1})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name="tiny", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            for prompt in ("w5 w17 w33 w8", "w40 w41 w42 w43 w44 w45", "w90"):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True}
                off = c.post("/v1/completions", json={**body, "speculative": {"mode": "off"}})
                on = c.post("/v1/completions", json={
                    **body, "speculative": {"mode": "on", "method": "draft", "k": 3}})
                off, on = off.json(), on.json()
                assert on["choices"][0]["text"] == off["choices"][0]["text"], prompt
                sd = on["spec_decode"]
                assert 0 < sd["accepted"] < sd["drafted"], sd  # kept some, rejected some
            health = c.get("/health").json()["engine"]
            assert health["timeline"]["target_bytes"] > 0
    finally:
        serve.delete("tiny")


def test_bad_configs_fail_at_start_naming_the_field(tiny_llama, tiny_llama_draft, tmp_path,
                                                    ray_local):
    # Tensor parallelism larger than the heads allow (4 heads).
    spec = tiny_spec(tiny_llama, tiny_llama_draft, target={"tp": 3})
    with pytest.raises(ConfigError, match=r"^target\.tp: .*must divide"):
        check_spec(spec, tiny_llama, tiny_llama_draft)
    # A draft whose tokenizer is another's: one vocabulary entry differs.
    other = tmp_path / "other-draft"
    shutil.copytree(tiny_llama_draft, other)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"w95"', '"zz"'))
    with pytest.raises(ConfigError, match=r"^draft\.model: draft tokenizer differs"):
        check_spec(tiny_spec(tiny_llama, other), tiny_llama, other)
    # More threads than Ray gives the actor.
    with pytest.raises(ValueError, match=r"target\.threads \(2\) exceeds target\.resources"):
        tiny_spec(tiny_llama, tiny_llama_draft, target={"threads": 2})
    # More threads than the machine has cores: in this process, and inside a shard actor.
    huge = tiny_spec(tiny_llama, tiny_llama_draft, draft={"threads": 999,
                                                          "resources": {"num_cpus": 0}})
    with pytest.raises(ConfigError, match=r"^draft\.threads: 999 threads per rank"):
        assemble(huge, LocalBackend())
    with pytest.raises(Exception, match=r"draft\.threads: 999 threads per rank"):
        with ray_engine(huge):
            pass


def test_an_error_raised_in_a_shard_fails_its_step_not_the_group(ray_local, tiny_llama,
                                                                  tiny_llama_draft):
    """A token id beyond the vocabulary, let past the engine's own check (which refuses it
    at submission), raises inside the target shard: its step fails with the reason, the group
    is NOT torn down and rebuilt (only a lost shard is), and the next request is served."""
    with ray_engine(tiny_spec(tiny_llama, tiny_llama_draft)) as built:
        built.engine.vocab_size = 10 ** 6  # the submission check out of the way
        bad = built.engine.run([Request("bad", [5, 5000], SamplingParams(max_tokens=4))])["bad"]
        assert bad.finish_reason == "error" and bad.error_kind == "internal", bad.error
        assert built.target.group.generation == 1 and built.target.failures == 0
        good = built.engine.run([Request("good", [5, 6], SamplingParams(max_tokens=4))])
        assert good["good"].finish_reason == "length"


@pytest.mark.real_model
def test_gguf_files_as_target_and_draft_over_http(ray_local, smollm2_path):
    """A user's .gguf paths as target.model and draft.model, in the served formats: the
    tokenizer, config and weights all come from the files."""
    gguf = str(smollm2_path / "model.gguf")
    args = tiny_spec(gguf, gguf, target={"dtype": "int8"},
                     draft={"dtype": "int8-dynamic"}).model_dump()
    args.update({"model_name": "smol", "replica_cpus": 0.1, "ingress_cpus": 0.1})
    port = free_port()
    serve.shutdown()  # an earlier test's Serve would keep its own port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name="smol", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            body = {"model": "smol", "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": "Write a haiku about rivers."}]}
            off = c.post("/v1/chat/completions", json={**body, "speculative": {"mode": "off"}})
            on = c.post("/v1/chat/completions", json={
                **body, "speculative": {"mode": "on", "method": "draft", "k": 3}})
            assert off.status_code == 200 and on.status_code == 200, (off.text, on.text)
            off, on = off.json(), on.json()
            text = on["choices"][0]["message"]["content"]
            assert text == off["choices"][0]["message"]["content"] and len(text) > 10
            assert on["spec_decode"]["drafted"] > 0
    finally:
        serve.delete("smol")
