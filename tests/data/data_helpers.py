"""Helpers shared by the data tests (a plain module: a second conftest.py would shadow the root one)."""

from __future__ import annotations

import functools
import os

import tokenizers

from titan_kedro.data.tokenizer import Tokenizer, build_tokenizer

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"


@functools.cache
def offline_tokenizer(name: str = "deepseek-ai/DeepSeek-V2-Lite") -> Tokenizer:
    """A tokenizer (the default one unless named), resolved without network (offline
    package or HF cache)."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return build_tokenizer(name)
    finally:
        if previous is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


@functools.cache
def raw_tokenizer() -> tokenizers.Tokenizer:
    """The plain ``tokenizers`` library on the same files, default settings."""
    return tokenizers.Tokenizer.from_file(str(offline_tokenizer().files.folder / "tokenizer.json"))
