"""Encode batches of documents into flat ``uint32`` arrays on ``num_workers`` lanes.

Every lane is single-threaded. Lane one is this process, which also reads the documents
and writes the results; the other ``num_workers - 1`` lanes are ``spawn``-ed helper
processes. This process hands batches to the helpers while they have work queued and
encodes the rest itself, so it is never idle, even while the helpers are still starting.
At most ``4 × num_workers`` batches are in flight, so memory does not grow with the
input. ``benchmarks/tokenize_throughput.py`` compares this with the multi-threaded Rust
batch encoder (see ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from types import TracebackType
from typing import NamedTuple

import numpy as np
import tokenizers

from titan_kedro.data.splitting import text_hash
from titan_kedro.data.token_store import TOKEN_DTYPE
from titan_kedro.data.tokenizer import Tokenizer

_PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_worker_backend: tokenizers.Tokenizer | None = None


class EncodedBatch(NamedTuple):
    """A batch of documents as flat token ids plus per-document lengths and text hashes."""

    ids: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray


def resolve_workers(num_workers: int) -> int:
    """``num_workers`` with 0 meaning one per CPU core available to this process."""
    if num_workers > 0:
        return num_workers
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def encode_texts(backend: tokenizers.Tokenizer, texts: list[str]) -> EncodedBatch:
    """Encode ``texts`` without special tokens (no BOS/EOS, literal control strings as text)."""
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    id_lists = [e.ids for e in encodings]
    lengths = np.fromiter(map(len, id_lists), dtype=np.uint32, count=len(id_lists))
    ids = np.fromiter(
        itertools.chain.from_iterable(id_lists), dtype=TOKEN_DTYPE, count=int(lengths.sum())
    )
    hashes = np.fromiter(map(text_hash, texts), dtype=np.uint64, count=len(texts))
    return EncodedBatch(ids, lengths, hashes)


@contextlib.contextmanager
def single_threaded_tokenizers() -> Iterator[None]:
    """Make ``encode_batch`` run on the calling thread only (restores the setting after)."""
    previous = os.environ.get(_PARALLELISM_ENV)
    os.environ[_PARALLELISM_ENV] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_PARALLELISM_ENV, None)
        else:
            os.environ[_PARALLELISM_ENV] = previous


class BatchEncoder:
    """Encodes an iterable of text batches, in order, on ``num_workers`` single-threaded lanes.

    Args:
        tokenizer: The tokenizer (pickled to the helpers as its file location).
        num_workers: Lanes, this process included; 0 = one per core.
        parallel: ``processes`` (default): this process plus ``num_workers - 1`` helper
            processes. ``threads``: this process only, with the Rust thread pool of
            ``tokenizers`` (sized by ``RAYON_NUM_THREADS``, default all cores); kept for the
            benchmark's comparison.

    Scripts that use more than one process lane need the usual
    ``if __name__ == "__main__":`` guard, since helpers are spawned.
    """

    def __init__(
        self, tokenizer: Tokenizer, num_workers: int, *, parallel: str = "processes"
    ) -> None:
        if parallel not in {"processes", "threads"}:
            raise ValueError(f"parallel must be 'processes' or 'threads', got {parallel!r}")
        self.tokenizer = tokenizer
        self.workers = resolve_workers(num_workers)
        self.parallel = parallel
        self._pool: ProcessPoolExecutor | None = None
        self._helpers = self.workers - 1 if parallel == "processes" else 0
        if self._helpers:
            self._pool = ProcessPoolExecutor(
                max_workers=self._helpers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer,),
            )

    def map(self, batches: Iterable[list[str]]) -> Iterator[EncodedBatch]:
        """Encode each batch; results come back in input order."""
        backend = self.tokenizer.backend
        if self._pool is None:
            threads = self.parallel == "threads" and self.workers > 1
            with contextlib.nullcontext() if threads else single_threaded_tokenizers():
                for texts in batches:
                    yield encode_texts(backend, texts)
            return
        pending: collections.deque[Future[EncodedBatch] | EncodedBatch] = collections.deque()
        queued_per_helper = 2
        with single_threaded_tokenizers():
            for texts in batches:
                busy = sum(1 for p in pending if isinstance(p, Future) and not p.done())
                if busy < queued_per_helper * self._helpers:
                    pending.append(self._pool.submit(_encode_in_worker, texts))
                else:
                    pending.append(encode_texts(backend, texts))
                while pending and (len(pending) > 4 * self.workers or _ready(pending[0])):
                    yield _result(pending.popleft())
            while pending:
                yield _result(pending.popleft())

    def close(self) -> None:
        """Stop the helper processes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> BatchEncoder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _ready(item: Future[EncodedBatch] | EncodedBatch) -> bool:
    return not isinstance(item, Future) or item.done()


def _result(item: Future[EncodedBatch] | EncodedBatch) -> EncodedBatch:
    return item.result() if isinstance(item, Future) else item


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_backend
    os.environ[_PARALLELISM_ENV] = "false"
    _worker_backend = tokenizer.backend


def _encode_in_worker(texts: list[str]) -> EncodedBatch:
    assert _worker_backend is not None, "worker not initialised"
    return encode_texts(_worker_backend, texts)
