"""Benchmarks that read files of the checkout (llama.cpp's build, held-out sources, the
config) find them from the repository root, wherever the module sits."""

from __future__ import annotations

from pathlib import Path

from specdec_bench import busy_start, chat, context_decode, formats, llama_peer

REPO = Path(__file__).resolve().parents[2]


def test_benchmarks_resolve_the_repository_root():
    assert (REPO / "pyproject.toml").is_file()
    for module in (llama_peer, formats, busy_start):
        assert module.ROOT == REPO, module.__name__
    for rel in formats.SOURCES:  # the held-out prompts of bench formats
        assert (formats.ROOT / rel).is_file(), rel
    # The files bench chat's conversation and long prompt paste, expanded as it does.
    for turn in chat.TURNS:
        assert "{file:" not in chat._expand(turn)
    assert (chat.FILES / chat.LONG_FILE).is_file()
    assert (context_decode.ROOT / context_decode.SOURCE).is_file()
