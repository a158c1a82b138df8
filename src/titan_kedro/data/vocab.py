"""Check that token files fit the model's embedding, and were made for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

UNUSED_ROWS_ALLOWED = 4096
"""Padding a model's embedding beyond its tokenizer's ids is normal (DeepSeek-V2 pads
100,015 ids to 102,400, V3 128,815 to 129,280); more unused rows than this, and more than
an eighth of the tokenizer's size, mean the token files come from another model's
tokenizer (e.g. DeepSeek-V2's 100k ids for a 129k DeepSeek-V3 model)."""


def check_vocab_fits(token_metadata: Mapping[str, Any], model_vocab_size: int) -> None:
    """Fail when the token files hold ids the model cannot embed, or are another model's.

    Args:
        token_metadata: ``metadata.json`` of the token files (its ``vocab_size`` is the
            tokenizer's, ``tokenizer.name`` names it).
        model_vocab_size: The model's (padded) embedding size.

    Raises:
        ValueError: With the two sizes and how to fix the mismatch.
    """
    data_vocab = token_metadata.get("vocab_size")
    if data_vocab is None:
        return
    data_vocab = int(data_vocab)
    name = (token_metadata.get("tokenizer") or {}).get("name", "the tokenizer")
    if data_vocab > model_vocab_size:
        raise ValueError(
            f"the token files were made with a tokenizer of vocab_size {data_vocab} but the "
            f"model's vocab_size is {model_vocab_size}; set model.overrides.vocab_size to at "
            f"least {data_vocab} or re-tokenize with a matching tokenizer"
        )
    unused = model_vocab_size - data_vocab
    if unused > max(UNUSED_ROWS_ALLOWED, data_vocab // 8):
        raise ValueError(
            f"the token files were made with {name} (vocab_size {data_vocab}), but the model's "
            f"vocab_size {model_vocab_size} leaves {unused} embedding rows that no token uses: "
            "the tokenizer is probably not the one this model is made for (a DeepSeek-V3 model "
            "wants tokenizer.name_or_path deepseek-ai/DeepSeek-V3). Re-tokenize with the "
            f"model's tokenizer, or set model.overrides.vocab_size near {data_vocab} to train "
            "this architecture with this tokenizer"
        )
