"""Read C4 JSON-lines shards (plain or gzip) robustly, one document at a time.

Every bad record is skipped and counted in a ``SkipReport`` with its line number. A
truncated gzip stream keeps its readable prefix and is reported as damage; corrupt gzip
data (a deflate or CRC error) is fatal damage, since wrong text may already have decoded.

One line can neither crash nor stall the reader: the file is read in bounded chunks and a
line is assembled only up to ``max_line_bytes`` (a longer one is dropped as it streams
past and counted as ``line_too_long``), so reading costs time linear in the file and
memory bounded by the limit; a line nested deeper than ``MAX_JSON_DEPTH`` is counted as
``too_deep`` before ``json`` would recurse into it.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from titan_kedro.data.bad_input import SkipReport
from titan_kedro.storage import as_path

# Small buffers keep the reader's memory constant; they cost nothing next to tokenizing.
_CHUNK = 1 << 16
_MAX_OUT = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"

DEFAULT_MAX_LINE_BYTES = 8 << 20
"""Default of ``data.max_line_bytes``, 8 MiB: C4 documents are at most a few hundred KB of
text, and even JSON-escaped as ``\\uXXXX`` (6 bytes a character) stay far below it."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects a line may have (a C4 record has depth 1); deeper
lines are skipped before ``json`` parses them (it would raise ``RecursionError``)."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class Document(NamedTuple):
    """A kept document and where it came from."""

    text: str
    line: int


def read_documents(
    path: str | Path,
    report: SkipReport,
    *,
    min_chars: int = 1,
    on_bytes: Callable[[int], None] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Document]:
    """Yield the documents of one shard, counting every skipped line in ``report``.

    Args:
        path: A ``.json``/``.jsonl`` file, gzip-compressed or not (detected from the bytes).
        report: Receives the counts of kept and skipped records and any file damage.
        min_chars: Texts shorter than this after stripping are skipped as ``empty_text``.
        on_bytes: Called with the number of (compressed) file bytes read, for progress bars.
        max_line_bytes: Longer lines (decompressed bytes, without the newline) are skipped
            as ``line_too_long`` without being assembled.
    """
    for line_no, raw, complete in _lines(as_path(path), report, on_bytes, max_line_bytes):
        if raw is None:
            report.skip(
                "line_too_long", line_no, f"longer than data.max_line_bytes={max_line_bytes}"
            )
            continue
        if not raw.strip():
            continue
        text = _text_of_line(raw, line_no, report, min_chars, cut_off=not complete)
        if text is not None:
            report.kept += 1
            yield Document(text, line_no)


def text_of_record(record: Any, line: int, report: SkipReport, *, min_chars: int = 1) -> str | None:
    """The usable text of a decoded record, or None after counting why it is unusable."""
    text = record.get("text") if isinstance(record, Mapping) else None
    if not isinstance(text, str):
        report.skip("missing_text", line, f"got {type(record).__name__} without a string 'text'")
        return None
    if len(text) < min_chars or len(text.strip()) < min_chars:
        report.skip("empty_text", line)
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        report.skip("invalid_utf8", line, f"lone surrogate at character {err.start}")
        return None
    return text


def _text_of_line(
    raw: bytes, line: int, report: SkipReport, min_chars: int, *, cut_off: bool
) -> str | None:
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        report.skip(
            "truncated" if cut_off else "invalid_utf8", line, f"bad byte at offset {err.start}"
        )
        return None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        report.skip("too_deep", line, f"nested {depth} deep, more than {MAX_JSON_DEPTH}")
        return None
    try:
        record = json.loads(decoded)
    except RecursionError:  # unreachable below MAX_JSON_DEPTH; never let it end the stage
        report.skip("too_deep", line, "json recursion limit")
        return None
    except json.JSONDecodeError as err:
        report.skip("truncated" if cut_off else "invalid_json", line, str(err))
        return None
    return text_of_record(record, line, report, min_chars=min_chars)


def json_depth(raw: bytes) -> int:
    """Deepest ``[``/``{`` nesting of a JSON line, brackets inside strings not counted.

    Linear and cheap: a line with few brackets is answered by counting them; otherwise
    strings are removed with one regular expression and the depth is a cumulative sum.
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than the limit (the exact depth is not needed)
    bare = _STRING.sub(b"", raw)
    steps = _OPEN[np.frombuffer(bare, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _lines(
    path: Path,
    report: SkipReport,
    on_bytes: Callable[[int], None] | None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[tuple[int, bytes | None, bool]]:
    """``(line number, bytes, complete)``; ``complete`` is False only for a cut-off last line.

    The bytes are None for a line longer than ``max_line_bytes``: its bytes are dropped as
    they arrive, so neither time nor memory grows with such a line beyond one chunk.
    """
    damaged: list[bool] = [False]
    pending = bytearray()
    too_long = False
    line_no = 0
    for chunk in _chunks(path, report, on_bytes, damaged):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line_no += 1
            if not too_long and len(pending) + end - start > max_line_bytes:
                too_long = True
            if too_long:
                yield line_no, None, True
            elif pending:
                pending += chunk[start:end]
                yield line_no, bytes(pending), True
            else:
                yield line_no, chunk[start:end], True
            pending.clear()
            too_long = False
            start = end + 1
        if not too_long:
            if len(pending) + len(chunk) - start > max_line_bytes:
                too_long = True
                pending = bytearray()
            else:
                pending += chunk[start:]
    if too_long:
        yield line_no + 1, None, not damaged[0]
    elif pending:
        yield line_no + 1, bytes(pending), not damaged[0]


def _chunks(
    path: Path,
    report: SkipReport,
    on_bytes: Callable[[int], None] | None,
    damaged: list[bool],
) -> Iterator[bytes]:
    with path.open("rb") as fh:
        head = fh.read(2)
        fh.seek(0)
        if head != _GZIP_MAGIC:
            while chunk := fh.read(_CHUNK):
                if on_bytes:
                    on_bytes(len(chunk))
                yield chunk
            return
        yield from _gunzip(fh, report, on_bytes, damaged)


def _gunzip(
    fh: Any,
    report: SkipReport,
    on_bytes: Callable[[int], None] | None,
    damaged: list[bool],
) -> Iterator[bytes]:
    """Decompress every gzip member; stop at damage, keeping what was decoded before it."""
    decomp = zlib.decompressobj(wbits=31)
    in_member = False
    produced = 0
    while compressed := fh.read(_CHUNK):
        if on_bytes:
            on_bytes(len(compressed))
        data = compressed
        while True:
            if not in_member:
                data = data.lstrip(b"\x00")  # padding between/after members
                if not data:
                    break
                in_member = True
            try:
                out = decomp.decompress(data, _MAX_OUT)
            except zlib.error as err:
                # Unlike a cut-off file, corrupt data (bad deflate codes or CRC) may already
                # have decoded into wrong text somewhere before the error: nothing is trusted.
                damaged[0] = True
                report.add_damage(
                    f"corrupt gzip data after {produced} decompressed bytes ({err}); the "
                    "decoded text cannot be trusted — re-download or remove this shard",
                    fatal=True,
                )
                return
            produced += len(out)
            if out:
                yield out
            if decomp.eof:
                data = decomp.unused_data
                decomp = zlib.decompressobj(wbits=31)
                in_member = False
                continue
            data = decomp.unconsumed_tail
            # A full output buffer may leave output pending inside zlib: ask again.
            if not data and len(out) < _MAX_OUT:
                break
    if in_member:
        try:
            tail = decomp.flush()
        except zlib.error:
            tail = b""
        if tail:
            yield tail
        if decomp.eof:
            return
        damaged[0] = True
        report.add_damage(
            f"truncated gzip stream: it ends after {produced + len(tail)} decompressed bytes "
            "without an end-of-stream marker; kept the readable lines"
        )
