"""Where raw C4 documents come from: local JSON-lines shards, or a stream from the hub.

``select_sources`` picks them from the ``data`` config and fails at once, naming both
fixes, when there is nothing to read (never train on nothing).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from titan_kedro.data.bad_input import SkipReport
from titan_kedro.data.c4_reader import (
    DEFAULT_MAX_LINE_BYTES,
    Document,
    read_documents,
    text_of_record,
)
from titan_kedro.data.hub import hub_offline, hub_reachable
from titan_kedro.storage import StoragePath, as_path

logger = logging.getLogger(__name__)

SHARD_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 16) -> str:
    """Hex sha256 of a file, read into one small reused buffer.

    Tokenization's memory stays flat with the corpus; a fresh 1 MiB block per read was, on its
    own, more than the rest of processing a shard holds at once.
    """
    digest = hashlib.sha256()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with as_path(path).open("rb") as handle:  # a local file or an object (s3://…)
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


class NoDataSourceError(RuntimeError):
    """Neither local shards nor the hub are available."""


class DocumentSource(Protocol):
    """A named stream of documents that can describe itself for caching and metadata."""

    name: str

    def cache_identity(self) -> dict[str, Any]:
        """What identifies this source's content (changes when the content may change)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Plain description for metadata (name, size, …)."""
        ...

    def documents(
        self, report: SkipReport, *, min_chars: int, on_bytes: Callable[[int], None] | None = None
    ) -> Iterator[Document]:
        """Yield the usable documents, counting skipped records in ``report``."""
        ...

    @property
    def size_hint(self) -> int | None:
        """Total for a progress bar in the units ``on_bytes`` reports (None: unknown)."""
        ...

    @property
    def progress_unit(self) -> str:
        """Unit of ``size_hint`` and ``on_bytes``: ``B`` (file bytes) or ``docs``."""
        ...


@dataclass(frozen=True)
class ShardFile:
    """A shard file (local or an object, ``s3://…``) as seen when listed: its identity for
    the incremental manifest."""

    path: StoragePath
    name: str
    size: int
    mtime_ns: int
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    """Longer lines are skipped as ``line_too_long`` (``data.max_line_bytes``)."""

    @classmethod
    def from_path(cls, path: str | Path, name: str | None = None) -> ShardFile:
        """Stat ``path`` now."""
        p = as_path(path, "a C4 shard")
        stat = p.stat()
        return cls(path=p, name=name or p.name, size=stat.st_size, mtime_ns=stat.st_mtime_ns)

    def cache_identity(self) -> dict[str, Any]:
        identity = {"kind": "file", "name": self.name, "size": self.size, "mtime_ns": self.mtime_ns}
        if self.max_line_bytes != DEFAULT_MAX_LINE_BYTES:  # it decides which lines are kept
            identity["max_line_bytes"] = self.max_line_bytes
        return identity

    def describe(self) -> dict[str, Any]:
        """Recorded once, when the shard is processed (the manifest keeps it for reruns)."""
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size,
            "sha256": file_sha256(self.path),
        }

    @property
    def size_hint(self) -> int:
        return self.size

    @property
    def progress_unit(self) -> str:
        return "B"

    def documents(
        self, report: SkipReport, *, min_chars: int, on_bytes: Callable[[int], None] | None = None
    ) -> Iterator[Document]:
        return read_documents(
            self.path,
            report,
            min_chars=min_chars,
            on_bytes=on_bytes,
            max_line_bytes=self.max_line_bytes,
        )


@dataclass(frozen=True)
class HubSource:
    """Documents streamed with ``datasets.load_dataset(..., streaming=True)``.

    ``dataset`` is a hub id (``allenai/c4``) or any ``datasets`` builder; with
    ``dataset="json"`` and ``data_files`` it reads local files through the same code.
    """

    dataset: str
    config: str | None
    split: str
    max_documents: int
    data_files: str | list[str] | None = None

    @property
    def name(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"{self.dataset}{config}:{self.split}[:{self.max_documents}]"

    @property
    def size_hint(self) -> int:
        return self.max_documents

    @property
    def progress_unit(self) -> str:
        return "docs"

    def cache_identity(self) -> dict[str, Any]:
        return {
            "kind": "hub",
            "dataset": self.dataset,
            "config": self.config,
            "split": self.split,
            "max_documents": self.max_documents,
            "data_files": self.data_files,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "config": self.config,
            "split": self.split,
            "size_bytes": None,
        }

    def documents(
        self, report: SkipReport, *, min_chars: int, on_bytes: Callable[[int], None] | None = None
    ) -> Iterator[Document]:
        for line, record in enumerate(self.records(), start=1):
            if on_bytes:
                on_bytes(1)
            text = text_of_record(record, line, report, min_chars=min_chars)
            if text is not None:
                report.kept += 1
                yield Document(text, line)

    def records(self) -> Iterator[dict[str, Any]]:
        """The first ``max_documents`` raw records of the stream."""
        from datasets import load_dataset

        kwargs: dict[str, Any] = {"split": self.split, "streaming": True}
        if self.data_files is not None:
            kwargs["data_files"] = self.data_files
        stream = load_dataset(self.dataset, self.config, **kwargs)
        for index, record in enumerate(stream):
            if index >= self.max_documents:
                break
            yield record


def is_shard_name(name: str) -> bool:
    """Whether a file name looks like a C4 JSON-lines shard."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return base.endswith(SHARD_SUFFIXES) and not base.startswith(".")


def select_sources(data: Any, shards: Iterable[ShardFile]) -> list[DocumentSource]:
    """The sources the ``data`` config asks for, checked to be available.

    Args:
        data: The ``data`` config section (``DataSection``).
        shards: Local shard files found under ``data.raw_dir`` (ignored for ``source: hub``).

    Raises:
        NoDataSourceError: Nothing to read; the message names both ways to fix it.
    """
    fixes = (
        f"Fix it either way: (1) put allenai/c4 JSON-lines shards (*.json or *.json.gz with a "
        f"'text' field) into {data.raw_dir}/ — `make run` copies the repository's sample there — "
        "and set data.source: local; or (2) set data.source: hub (streams "
        f"{data.hub_dataset}/{data.hub_config}, needs network and HF_HUB_OFFLINE unset)."
    )
    if data.source == "local":
        found = sorted((s for s in shards if is_shard_name(s.name)), key=lambda s: s.name)
        if not found:
            raise NoDataSourceError(
                f"no C4 shards found in {data.raw_dir} (data.source: local). {fixes}"
            )
        logger.info("C4 source: %d local shard(s) in %s", len(found), data.raw_dir)
        return list(found)
    if hub_offline():
        raise NoDataSourceError(
            f"data.source: hub, but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set. {fixes}"
        )
    if not hub_reachable():
        raise NoDataSourceError(
            f"data.source: hub, but the Hugging Face hub is unreachable. {fixes}"
        )
    source = HubSource(data.hub_dataset, data.hub_config, data.hub_split, data.hub_max_documents)
    logger.info("C4 source: streaming %s from the hub", source.name)
    return [source]
