"""Tokenizers: loaded once per process from a checkpoint directory or a GGUF file, the
check that a draft shares its target's, and chat templating (the one place a chat becomes
token ids)."""

from __future__ import annotations

import functools
from pathlib import Path


def load_tokenizer(path):
    """The tokenizer of a checkpoint directory, or of a GGUF file (built from its metadata
    by transformers, once per process: that takes seconds for a 150k vocabulary)."""
    return _tokenizer(str(path))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    from specdec.model.checkpoint.gguf_file import is_gguf

    p = Path(path)
    if is_gguf(p) or not (p / "tokenizer_config.json").exists() and list(p.glob("*.gguf")):
        from specdec.pack.hub import transformers_args

        where, kw = transformers_args(p)
        tok = AutoTokenizer.from_pretrained(where, **kw)
        if not tok.chat_template:
            # transformers' GGUF reader skips the file's template beside tokenizer files.
            from specdec.model.checkpoint.gguf_file import metadata

            tok.chat_template = metadata(Path(where) / kw["gguf_file"],
                                         "tokenizer.chat_template")
        return tok
    return AutoTokenizer.from_pretrained(path)


def chat_ids(tok, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of a chat, by the model's own template, ready for the reply; the
    functions the model may call, where there are any, rendered by that template too."""
    return list(tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=add_generation_prompt,
                                        return_dict=False))


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """One user message through the chat template, or the text as it is."""
    return chat_ids(tok, [{"role": "user", "content": text}]) if chat else tok(text).input_ids


class IncompatibleDraft(ValueError):
    pass


def check_same_tokenizer(target_path: str | Path, draft_path: str | Path) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its token ids would mean
    other strings, and every guess would be verified against the wrong token."""
    t, d = load_tokenizer(target_path), load_tokenizer(draft_path)
    tv, dv = t.get_vocab(), d.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        raise IncompatibleDraft(
            f"draft tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; "
            f"{only_t} target and {only_d} draft entries have no match): use a draft from "
            "the target's model family, or the ngram method"
        )
