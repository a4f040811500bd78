"""Shared fixtures: tiny random checkpoints made on the fly, and real models from the pack.

Real models are loaded once per test session. The pack is fetched through the project's
own fetch code if it is missing (`make test` fetches it beforehand, with progress).
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Ray is only ever started explicitly (deployments.launch.local_ray, on its own ports and
# temp dir). Ray's auto-connect would otherwise start, or join, a Ray on any stray API call,
# such as a Serve background thread's after its module shut Ray down: that Ray then
# outlived its module and the next module's own Ray failed to start.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2",
                                tie_word_embeddings=True)


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


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory, tiny_llama) -> Path:
    return make_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("tiny-llama-draft"), 0.05, 1)


@pytest.fixture(scope="session")
def tiny_llama_far_draft(tmp_path_factory, tiny_llama) -> Path:
    """Agrees with the target less: rejections are common, so sampling tests have power."""
    return make_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("tiny-llama-far"), 0.2, 3)


@pytest.fixture(scope="session")
def tiny_qwen2_draft(tmp_path_factory, tiny_qwen2) -> Path:
    return make_perturbed_copy(tiny_qwen2, tmp_path_factory.mktemp("tiny-qwen2-draft"), 0.05, 2)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_checkpoint(request, tiny_llama, tiny_qwen2) -> Path:
    return tiny_llama if request.param == "llama" else tiny_qwen2


def pack_model(name: str) -> Path:
    from specdec.pack import hub

    return hub.resolve(name, fetch_missing=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return pack_model("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_draft_path() -> Path:
    return pack_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen_target_path() -> Path:
    return pack_model("qwen2.5-coder-1.5b")


@pytest.fixture(autouse=True, scope="module")
def _ray_left_running(request):
    """Every module that starts Ray shuts it down (tests of one run share a process): a
    Ray left running here would make the next module's own Ray fail to start."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.module.__name__} left Ray running in the test process")


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once the verdict is printed, a run that imported Ray leaves without the interpreter's
    native teardown: Ray's core driver has crashed there (a segfault from its log sink after
    every test passed and every Ray was shut down and its temp dir removed), which turned a
    green run's exit status into a failure. The status returned is pytest's own."""
    if "ray" in sys.modules and _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])


@pytest.fixture(autouse=True)
def _repeatable_unseeded_streams():
    """Unseeded requests draw from streams seeded by the OS; in this process's tests they
    are seeded from 0 instead, so the rejection rule's statistical tests repeat exactly."""
    from specdec.model.sampling import seed_unseeded

    seed_unseeded(0)
    yield
    seed_unseeded(None)
