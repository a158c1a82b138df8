"""Read C4 JSON-lines shards (plain or gzip) robustly, one document at a time.

Every bad record is skipped and counted in a ``SkipReport`` with its line number. A
truncated gzip stream keeps its readable prefix and is reported as damage; corrupt gzip
data (a deflate or CRC error) is fatal damage, since wrong text may already have decoded.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from titan_kedro.data.bad_input import SkipReport

# Small buffers keep the reader's memory constant; they cost nothing next to tokenizing.
_CHUNK = 1 << 16
_MAX_OUT = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"


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
) -> Iterator[Document]:
    """Yield the documents of one shard, counting every skipped line in ``report``.

    Args:
        path: A ``.json``/``.jsonl`` file, gzip-compressed or not (detected from the bytes).
        report: Receives the counts of kept and skipped records and any file damage.
        min_chars: Texts shorter than this after stripping are skipped as ``empty_text``.
        on_bytes: Called with the number of (compressed) file bytes read, for progress bars.
    """
    for line_no, raw, complete in _lines(Path(path), report, on_bytes):
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
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as err:
        report.skip("truncated" if cut_off else "invalid_json", line, str(err))
        return None
    return text_of_record(record, line, report, min_chars=min_chars)


def _lines(
    path: Path, report: SkipReport, on_bytes: Callable[[int], None] | None
) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, bytes, complete)``; ``complete`` is False only for a cut-off last line."""
    damaged: list[bool] = [False]
    pending = b""
    line_no = 0
    for chunk in _chunks(path, report, on_bytes, damaged):
        parts = (pending + chunk).split(b"\n")
        pending = parts.pop()
        for part in parts:
            line_no += 1
            yield line_no, part, True
    if pending:
        yield line_no + 1, pending, not damaged[0]


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
