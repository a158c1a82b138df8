"""Tokenizer wrapper over the fast ``tokenizers`` library with explicit BOS/EOS control.

``encode`` never lets the tokenizer decide about control tokens: text is encoded without
special-token parsing (a literal ``<｜begin▁of▁sentence｜>`` in a document stays plain
text) and BOS/EOS ids are added here, so the result does not depend on a tokenizer's
``add_bos_token`` / ``add_eos_token`` settings or on the transformers version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from titan_kedro.data.tokenizer_files import (
    CONFIG_FILE,
    SPECIAL_TOKENS_FILE,
    TOKENIZER_FILE,
    TokenizerFiles,
    resolve_tokenizer_files,
)

DEFAULT_TOKENIZER = "deepseek-ai/DeepSeek-V2-Lite"


def build_tokenizer(name_or_path: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """Load the tokenizer named by a local folder or hub id (offline fallback for DeepSeek-V2).

    Args:
        name_or_path: A folder holding ``tokenizer.json``, or a Hugging Face hub id.

    Returns:
        The wrapped tokenizer; its ``source`` says where the files came from.

    Raises:
        FileNotFoundError: No source had the files; the message says how to fix it.
        TokenizerFileError: ``tokenizer.json`` (or a config file) is there but unreadable;
            the message names the file and how to fix it.
        ValueError: The tokenizer defines no BOS or EOS token.
    """
    return Tokenizer(resolve_tokenizer_files(name_or_path))


class Tokenizer:
    """A fast tokenizer whose BOS/EOS handling is decided by the caller, never by config.

    Attributes:
        name: The name or path it was built from.
        source: Where the files were found (``local directory``, ``hugging face cache``, …).
        bos_id, eos_id, pad_id: Control token ids (``pad_id`` falls back to ``eos_id``).
        vocab_size: Number of token ids, added tokens included.
        fingerprint: Hash of ``tokenizer.json`` and the control tokens; equal fingerprints
            encode identically.
    """

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        self.name = files.name
        self.source = files.source
        self._backend = _load_backend(files)
        # Literal special-token strings inside a document are encoded as ordinary text.
        self._backend.encode_special_tokens = True
        self._config = _read_json(files.folder / CONFIG_FILE, files)
        special = _read_json(files.folder / SPECIAL_TOKENS_FILE, files)
        special.update({k: v for k, v in self._config.items() if v is not None})
        self.bos_token = self._special_token(special, "bos_token")
        self.eos_token = self._special_token(special, "eos_token")
        self.bos_id = self._token_id(self.bos_token)
        self.eos_id = self._token_id(self.eos_token)
        pad = _token_content(special.get("pad_token"))
        known_pad = pad is not None and self._backend.token_to_id(pad) is not None
        self.pad_token = pad if known_pad else self.eos_token
        self.pad_id = self._token_id(self.pad_token)
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = _fingerprint(
            files.folder, (self.bos_token, self.eos_token, self.pad_token)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Worker processes rebuild from the files instead of pickling the Rust object.
        return (Tokenizer, (self.files,))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, fingerprint={self.fingerprint!r})"
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (special-token parsing switched off)."""
        return self._backend

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``text``, with exactly one BOS first iff ``bos`` and one EOS last iff ``eos``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, bos=bos, eos=eos)

    def encode_batch(self, texts: Sequence[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """``encode`` for many texts at once (multi-threaded unless ``TOKENIZERS_PARALLELISM=false``)."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, bos=bos, eos=eos) for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; control tokens appear as their strings unless skipped."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, folder: str | Path) -> list[Path]:
        """Write the Hugging Face tokenizer files so ``AutoTokenizer.from_pretrained(folder)`` works.

        Writes ``tokenizer.json`` (byte-identical to the source), ``tokenizer_config.json``
        (the source config with ``tokenizer_class: PreTrainedTokenizerFast``, which loads
        ``tokenizer.json`` as it is in transformers 4 and 5) and ``special_tokens_map.json``.

        Returns:
            The written files.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.files.folder / TOKENIZER_FILE, out / TOKENIZER_FILE)
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }
        config = {
            **self._config,
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        config.setdefault("add_bos_token", True)
        config.setdefault("add_eos_token", False)
        _write_json(out / CONFIG_FILE, config)
        _write_json(out / SPECIAL_TOKENS_FILE, special)
        return [out / TOKENIZER_FILE, out / CONFIG_FILE, out / SPECIAL_TOKENS_FILE]

    def _wrap(self, ids: list[int], *, bos: bool, eos: bool) -> list[int]:
        if bos:
            ids = [self.bos_id, *ids]
        if eos:
            ids.append(self.eos_id)
        return ids

    def _special_token(self, special: dict[str, Any], key: str) -> str:
        content = _token_content(special.get(key))
        if content is None:
            raise ValueError(
                f"tokenizer {self.name!r} ({self.files.folder}) defines no {key} in "
                f"{CONFIG_FILE} or {SPECIAL_TOKENS_FILE}; packing needs BOS and EOS tokens"
            )
        return content

    def _token_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer {self.name!r}: special token {token!r} is not in its vocabulary"
            )
        return token_id


def _token_content(value: Any) -> str | None:
    """A special token's string, whether the config stores a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class TokenizerFileError(ValueError):
    """A tokenizer file exists but cannot be read; the message names it and how to fix it."""


def _fix(files: TokenizerFiles) -> str:
    return (
        f"(tokenizer.name_or_path={files.name!r}, found in the {files.source}). The file is "
        "damaged or not a Hugging Face fast-tokenizer file: download it again (for a hub id, "
        "delete it from the Hugging Face cache so it is fetched anew), or point "
        "tokenizer.name_or_path at a folder with a valid one"
    )


def _load_backend(files: TokenizerFiles) -> tokenizers.Tokenizer:
    path = files.folder / TOKENIZER_FILE
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception
        raise TokenizerFileError(f"cannot load {path}: {err} {_fix(files)}") from err


def _read_json(path: Path, files: TokenizerFiles) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerFileError(f"cannot read {path}: {err} {_fix(files)}") from err
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path} holds no JSON object {_fix(files)}")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fingerprint(folder: Path, special_tokens: Sequence[str]) -> str:
    """Hash of what decides the token ids: ``tokenizer.json`` and the control tokens.

    Config details that do not change encoding (``tokenizer_class``, chat template, …) are
    left out, so a copy written by ``save`` has the same fingerprint as its source.
    """
    digest = hashlib.sha256((folder / TOKENIZER_FILE).read_bytes())
    digest.update(json.dumps(list(special_tokens)).encode())
    return digest.hexdigest()[:16]
