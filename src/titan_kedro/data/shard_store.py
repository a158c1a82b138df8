"""Per-shard intermediate token files and the manifest that makes re-runs incremental.

Each processed source gets a folder ``shards/<name>-<key>/`` holding its documents'
tokens (``tokens.bin``, ``uint32``, no BOS/EOS), their lengths (``lengths.bin``, ``uint32``)
and text hashes (``hashes.bin``, ``uint64``, for the split). ``manifest.json`` maps a key
— a hash of the source's name, size and mtime and the tokenizer fingerprint — to the
shard's counts. An entry is written only once its files are complete, so an interrupted
run, or one that finds new shards, processes only what is not in the manifest yet.

A manifest entry's ``folder`` is read from a file, so it is never trusted: before a shard
is read or removed, its folder is resolved and must be a folder directly under
``<root>/shards`` (``ManifestPathError`` otherwise, naming the manifest and the entry).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from titan_kedro.data.token_store import (
    TOKEN_DTYPE,
    TokenFileWriter,
    open_tokens,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.bin"
LENGTHS_FILE = "lengths.bin"
HASHES_FILE = "hashes.bin"
LENGTH_DTYPE = np.dtype("<u4")
HASH_DTYPE = np.dtype("<u8")
_FORMAT = 1


def shard_key(identity: dict[str, Any], tokenizer_fingerprint: str) -> str:
    """Cache key of a source's tokens: changes with the source identity or the tokenizer."""
    payload = json.dumps(
        {"format": _FORMAT, "source": identity, "tokenizer": tokenizer_fingerprint}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class ManifestPathError(ValueError):
    """A manifest entry names a folder outside ``<root>/shards``; nothing was read or removed."""


class ShardTokens(NamedTuple):
    """A processed shard read back: tokens (memory-mapped), per-document lengths and hashes."""

    tokens: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """Start of each document in ``tokens`` plus the end (``len(lengths) + 1`` values)."""
        out = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out


class ShardWriter:
    """Streams one shard's tokens, lengths and hashes into a staging folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(self.staging, ignore_errors=True)
        self.tokens = TokenFileWriter(self.staging / TOKENS_FILE, TOKEN_DTYPE)
        self.lengths = TokenFileWriter(self.staging / LENGTHS_FILE, LENGTH_DTYPE)
        self.hashes = TokenFileWriter(self.staging / HASHES_FILE, HASH_DTYPE)

    def append(self, ids: np.ndarray, lengths: np.ndarray, hashes: np.ndarray) -> None:
        """Add a batch of documents."""
        self.tokens.append(ids)
        self.lengths.append(lengths)
        self.hashes.append(hashes)

    @property
    def documents(self) -> int:
        return self.lengths.count

    @property
    def token_count(self) -> int:
        return self.tokens.count

    @property
    def content_hash(self) -> str:
        """Hash of the token ids and document boundaries written so far."""
        return hashlib.sha256((self.tokens.sha256 + self.lengths.sha256).encode()).hexdigest()[:16]

    def commit(self) -> None:
        for writer in (self.tokens, self.lengths, self.hashes):
            writer.commit()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.staging.rename(self.folder)

    def abort(self) -> None:
        for writer in (self.tokens, self.lengths, self.hashes):
            writer.abort()
        shutil.rmtree(self.staging, ignore_errors=True)


class ShardStore:
    """The intermediate folder (``data.intermediate_dir``): shard token files + manifest."""

    def __init__(self, root: str | Path, manifest: str = MANIFEST_FILE) -> None:
        """Open the store.

        Args:
            root: The intermediate folder; shard folders live in ``root/shards``.
            manifest: The manifest's path inside ``root``: ``manifest.json``, or a task's own
                (``data.task_plan``), so tasks writing side by side never share one file.
        """
        self.root = Path(root)
        self.manifest_name = manifest

    @property
    def manifest_path(self) -> Path:
        return self.root / self.manifest_name

    def manifest(self) -> dict[str, dict[str, Any]]:
        """All recorded shards by key (empty when there is no manifest yet)."""
        if not self.manifest_path.is_file():
            return {}
        data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT:
            logger.warning("ignoring %s: unknown format %r", self.manifest_path, data.get("format"))
            return {}
        return dict(data.get("shards", {}))

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The manifest entry for ``key`` if its files are all there with the recorded sizes."""
        entry = self.manifest().get(key)
        if entry is None:
            return None
        folder = self.folder_of(entry, key=key)
        expected = {
            TOKENS_FILE: entry["tokens"] * TOKEN_DTYPE.itemsize,
            LENGTHS_FILE: entry["documents"] * LENGTH_DTYPE.itemsize,
            HASHES_FILE: entry["documents"] * HASH_DTYPE.itemsize,
        }
        for name, size in expected.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != size:
                logger.warning(
                    "manifest entry %s (%s) has a missing or wrong %s; redoing it",
                    key,
                    entry["name"],
                    name,
                )
                return None
        return entry

    def writer(self, key: str, name: str) -> ShardWriter:
        """A writer for a new shard; nothing is visible until ``commit``."""
        return ShardWriter(self.root / "shards" / f"{_safe(name)}-{key}")

    def commit(self, writer: ShardWriter, entry: dict[str, Any]) -> dict[str, Any]:
        """Move the shard's files into place, then record it (dropping superseded versions)."""
        writer.commit()
        entry = {
            **entry,
            "folder": str(writer.folder.relative_to(self.root)),
            "documents": writer.documents,
            "tokens": writer.token_count,
            "content_hash": writer.content_hash,
            "created_unix": int(time.time()),
        }
        self.record([entry])
        return entry

    def record(self, entries: list[dict[str, Any]]) -> None:
        """Add committed shards' entries (another manifest's, say) to this manifest.

        An older version of the same source (same name, another key) is dropped with its
        folder; each entry's own folder is checked to lie in ``root/shards`` first.
        """
        shards = self.manifest()
        for entry in entries:
            self.folder_of(entry, key=entry["key"])
            for old_key, old in list(shards.items()):
                if old["name"] == entry["name"] and old_key != entry["key"]:
                    shutil.rmtree(self.folder_of(old, key=old_key), ignore_errors=True)
                    del shards[old_key]
            shards[entry["key"]] = entry
        write_json_atomic(self.manifest_path, {"format": _FORMAT, "shards": shards})

    def folder_of(self, entry: dict[str, Any], *, key: str | None = None) -> Path:
        """The entry's shard folder, resolved and checked to lie directly under ``root/shards``.

        Raises:
            ManifestPathError: The recorded ``folder`` is absolute, climbs out (``..``), goes
                through a link leading elsewhere, or is not one shard folder down.
        """
        recorded = entry.get("folder")
        shards = (self.root / "shards").resolve()
        folder = (self.root / recorded).resolve() if isinstance(recorded, str) else None
        if folder is None or folder.parent != shards:
            name = key or entry.get("key") or entry.get("name") or "?"
            raise ManifestPathError(
                f"{self.manifest_path}: entry {name!r} names folder {recorded!r}, which is "
                f"not a shard folder inside {shards}; refusing to read or delete it. The "
                "manifest was edited or damaged: delete it (and the shards/ folder beside it) "
                "to re-tokenize every shard"
            )
        return folder

    def read(self, entry: dict[str, Any]) -> ShardTokens:
        """A shard's token files (tokens memory-mapped; lengths and hashes in memory)."""
        folder = self.folder_of(entry)
        return ShardTokens(
            tokens=open_tokens(folder / TOKENS_FILE),
            lengths=np.fromfile(folder / LENGTHS_FILE, dtype=LENGTH_DTYPE),
            hashes=np.fromfile(folder / HASHES_FILE, dtype=HASH_DTYPE),
        )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]
