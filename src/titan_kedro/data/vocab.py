"""Check that token files fit the model's embedding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_vocab_fits(token_metadata: Mapping[str, Any], model_vocab_size: int) -> None:
    """Fail when the token files hold ids the model cannot embed.

    Args:
        token_metadata: ``metadata.json`` of the token files (its ``vocab_size`` is the
            tokenizer's).
        model_vocab_size: The model's (padded) embedding size.

    Raises:
        ValueError: With the two sizes and how to fix the mismatch.
    """
    data_vocab = token_metadata.get("vocab_size")
    if data_vocab is not None and int(data_vocab) > model_vocab_size:
        raise ValueError(
            f"the token files were made with a tokenizer of vocab_size {data_vocab} but the "
            f"model's vocab_size is {model_vocab_size}; set model.overrides.vocab_size to at "
            f"least {data_vocab} or re-tokenize with a matching tokenizer"
        )
