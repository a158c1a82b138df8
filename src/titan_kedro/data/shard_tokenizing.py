"""Tokenize document sources shard by shard into the intermediate ``ShardStore``.

Memory stays flat as the corpus grows: documents stream from disk in batches, at most a
few batches are in flight, and each shard's tokens go straight to its files. Shards the
manifest already holds (same name, size, mtime and tokenizer) are not redone; a shard
whose skipped share is above ``max_bad_fraction`` fails the run without being recorded,
while the shards before it stay recorded. A shard with no records at all is recorded with
that as its (non-fatal) damage.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from titan_kedro.data.bad_input import SkipReport
from titan_kedro.data.batch_encoding import BatchEncoder
from titan_kedro.data.shard_store import ShardStore, shard_key
from titan_kedro.data.sources import DocumentSource
from titan_kedro.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def tokenize_sources(
    sources: Sequence[DocumentSource],
    tokenizer: Tokenizer,
    store: ShardStore,
    *,
    batch_size: int = 512,
    num_workers: int = 0,
    min_chars: int = 1,
    max_bad_fraction: float = 0.01,
    max_documents: int | None = None,
    parallel: str = "processes",
) -> list[dict[str, Any]]:
    """Make sure every source is tokenized in ``store``; return their manifest entries in order.

    Args:
        sources: Shards (or a hub stream) in processing order.
        tokenizer: Encodes the documents; its fingerprint is part of each shard's key.
        store: The intermediate folder with its manifest.
        batch_size: Documents per encoder batch.
        num_workers: Single-threaded encoder lanes: this process plus ``num_workers - 1``
            helper processes (0: one lane per core).
        min_chars: Shorter texts are skipped as ``empty_text``.
        max_bad_fraction: Fail when a shard skips a larger share of its records.
        max_documents: Stop after this many documents in total (None: everything).
        parallel: ``processes`` or ``threads`` (see ``BatchEncoder``).

    Raises:
        BadInputError: A shard had too many bad records (earlier shards stay recorded).
    """
    entries: list[dict[str, Any]] = []
    remaining = max_documents
    encoder: BatchEncoder | None = None
    try:
        for source in sources:
            if remaining is not None and remaining <= 0:
                logger.info(
                    "data.max_documents=%d reached; not reading %s", max_documents, source.name
                )
                continue
            identity = source.cache_identity()
            if remaining is not None:
                identity = {**identity, "max_documents": remaining}
            key = shard_key(identity, tokenizer.fingerprint)
            entry = store.lookup(key)
            if entry is not None:
                logger.info(
                    "%s: already tokenized (%d documents, %d tokens), reusing %s",
                    source.name,
                    entry["documents"],
                    entry["tokens"],
                    entry["folder"],
                )
            else:
                if encoder is None:
                    encoder = BatchEncoder(tokenizer, num_workers, parallel=parallel)
                entry = _tokenize_one(
                    source,
                    key,
                    identity=identity,
                    tokenizer=tokenizer,
                    store=store,
                    encoder=encoder,
                    batch_size=batch_size,
                    min_chars=min_chars,
                    max_bad_fraction=max_bad_fraction,
                    limit=remaining,
                )
            entries.append(entry)
            if remaining is not None:
                remaining -= entry["documents"]
    finally:
        if encoder is not None:
            encoder.close()
    return entries


def _tokenize_one(
    source: DocumentSource,
    key: str,
    *,
    identity: dict[str, Any],
    tokenizer: Tokenizer,
    store: ShardStore,
    encoder: BatchEncoder,
    batch_size: int,
    min_chars: int,
    max_bad_fraction: float,
    limit: int | None,
) -> dict[str, Any]:
    report = SkipReport(source.name)
    writer = store.writer(key, source.name)
    start = time.perf_counter()
    try:
        with tqdm(
            total=source.size_hint,
            desc=f"tokenize {source.name}",
            unit=source.progress_unit,
            unit_scale=True,
            disable=None,
            leave=False,
        ) as bar:
            docs: Iterable[Any] = source.documents(report, min_chars=min_chars, on_bytes=bar.update)
            if limit is not None:
                docs = itertools.islice(docs, limit)
            texts = (doc.text for doc in docs)
            for batch in encoder.map(_batched(texts, batch_size)):
                writer.append(batch.ids, batch.lengths, batch.hashes)
        if not report.records and not report.damage:
            # Not an error: one empty file (say, an interrupted download) must not end a
            # corpus run, but it is recorded (metadata sources[].damage) and logged. A corpus
            # with no documents at all still fails when it is split (plan_split).
            report.add_damage("the shard holds no records (an empty file); nothing was read")
        report.check(max_bad_fraction)
    except BaseException:
        writer.abort()
        raise
    if report.skipped or report.damage:
        logger.warning("%s: %s", source.name, report.describe())
    entry = store.commit(
        writer,
        {
            "key": key,
            "name": source.name,
            "identity": identity,
            "source": source.describe(),
            "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
            **report.to_dict(),
        },
    )
    seconds = time.perf_counter() - start
    logger.info(
        "%s: %d documents, %d tokens in %.1f s (%.0f tokens/s, %d worker(s))",
        source.name,
        entry["documents"],
        entry["tokens"],
        seconds,
        entry["tokens"] / max(seconds, 1e-9),
        encoder.workers,
    )
    return entry


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
