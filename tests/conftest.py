"""Shared fixtures: tiny random checkpoints made on the fly, and real models from the pack.

Real models are loaded once per test session. The pack is fetched through the project's
own fetch code if it is missing (`make test` fetches it beforehand, with progress).
"""

from __future__ import annotations

import os
import sys
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

# The tiny checkpoints' makers (tests import them from here too). After the settings above.
from specdec.pack.tiny import (  # noqa: E402, F401
    make_perturbed_copy,
    make_tiny_checkpoint,
    save_tiny_tokenizer,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2",
                                tie_word_embeddings=True)


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
    from specdec.model.step.sampling import seed_unseeded

    seed_unseeded(0)
    yield
    seed_unseeded(None)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return pack_model("gemma3-270m")
