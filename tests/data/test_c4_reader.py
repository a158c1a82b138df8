"""Bad input: every kind of broken record is skipped, counted, located; good records survive."""

from __future__ import annotations

import gzip
import json
import logging
import time
from pathlib import Path

import pytest
from conftest import write_c4_shard

from titan_kedro.config.schema import DataSection
from titan_kedro.data.bad_input import BadInputError, SkipReport
from titan_kedro.data.c4_reader import DEFAULT_MAX_LINE_BYTES, read_documents


def _texts(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def _read(path: Path, **kwargs: int) -> tuple[list[str], list[int], SkipReport]:
    report = SkipReport(path.name)
    docs = list(read_documents(path, report, **kwargs))
    return [d.text for d in docs], [d.line for d in docs], report


def test_each_bad_record_kind_is_skipped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lines = [
        json.dumps({"text": "good one", "url": "u1"}).encode(),  # 1
        b'{"text": "unterminated',  # 2 invalid_json
        json.dumps({"url": "no text"}).encode(),  # 3 missing_text
        json.dumps({"text": 42}).encode(),  # 4 missing_text
        json.dumps(["a", "list"]).encode(),  # 5 missing_text
        json.dumps({"text": "   \n "}).encode(),  # 6 empty_text
        b'{"text": "caf\xe9 latin-1"}',  # 7 invalid_utf8
        b'{"text": "lone \\ud800 surrogate"}',  # 8 invalid_utf8 (escape)
        b"",  # 9 blank line: not a record
        json.dumps({"text": "good two ✓"}, ensure_ascii=False).encode(),  # 10
    ]
    path = tmp_path / "mixed.json"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="titan_kedro.data.bad_input"):
        texts, line_numbers, report = _read(path)
    assert texts == ["good one", "good two ✓"]
    assert line_numbers == [1, 10]
    assert dict(report.by_reason) == {
        "invalid_json": 1,
        "missing_text": 3,
        "empty_text": 1,
        "invalid_utf8": 2,
    }
    assert report.examples["missing_text"] == [3, 4, 5]
    assert report.examples["invalid_utf8"] == [7, 8]
    assert report.kept == 2 and report.skipped == 7 and report.damage == []
    assert "mixed.json:2 skipped (invalid_json)" in caplog.text
    assert "mixed.json:8 skipped (invalid_utf8)" in caplog.text


def test_min_chars_counts_short_texts_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "short.jsonl"
    path.write_text('{"text": "ab"}\n{"text": "abcdef"}\n')
    texts, _, report = _read(path, min_chars=3)
    assert texts == ["abcdef"]
    assert report.by_reason == {"empty_text": 1}


def test_truncated_gzip_keeps_the_readable_prefix(tmp_path: Path) -> None:
    full = write_c4_shard(tmp_path / "full.json.gz", 300)
    originals = _texts(full)
    data = full.read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    texts, line_numbers, report = _read(cut)
    assert 100 < len(texts) < 300
    assert texts == originals[: len(texts)]
    assert line_numbers == list(range(1, len(texts) + 1))
    assert len(report.damage) == 1 and "truncated gzip stream" in report.damage[0]
    # At most the one cut-off line is lost, and it is named as such.
    assert set(report.by_reason) <= {"truncated"} and report.skipped <= 1


def test_corrupt_gzip_is_fatal_damage(tmp_path: Path) -> None:
    full = write_c4_shard(tmp_path / "full.json.gz", 300)
    data = bytearray(full.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(range(64))
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(bytes(data))
    _, _, report = _read(broken)
    assert report.fatal
    assert "corrupt gzip data" in report.damage[0]
    # Garbage may decode as plausible text before zlib notices, so nothing is trusted.
    with pytest.raises(BadInputError, match=r"broken\.json\.gz: .*re-download or remove"):
        report.check(1.0)


def test_concatenated_gzip_members_are_all_read(tmp_path: Path) -> None:
    a = write_c4_shard(tmp_path / "a.json.gz", 20, seed=1)
    b = write_c4_shard(tmp_path / "b.json.gz", 30, seed=2)
    both = tmp_path / "both.json.gz"
    both.write_bytes(a.read_bytes() + b.read_bytes())
    texts, _, report = _read(both)
    assert texts == _texts(a) + _texts(b)
    assert report.skipped == 0 and report.damage == []


def test_plain_json_without_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    path.write_text('{"text": "one"}\n{"text": "two"}')
    texts, _, report = _read(path)
    assert texts == ["one", "two"] and report.skipped == 0


def test_too_many_bad_records_fail_with_how_many_why_and_where() -> None:
    report = SkipReport("c4-train.00007.json.gz")
    report.kept = 95
    for line in (3, 9, 12):
        report.skip("invalid_json", line)
    for line in (20, 21):
        report.skip("empty_text", line)
    report.check(0.05)  # exactly 5 %: allowed
    with pytest.raises(BadInputError) as err:
        report.check(0.01)
    message = str(err.value)
    assert "c4-train.00007.json.gz" in message
    assert "5 of 100 records skipped" in message
    assert "invalid_json 3 (lines 3, 9, 12)" in message
    assert "empty_text 2 (lines 20, 21)" in message
    assert "data.max_bad_fraction=0.01" in message


def test_highly_compressible_lines_are_read_whole(tmp_path: Path) -> None:
    texts = ["ab" * 200_000, "x" * 1_000_003, "short one"]
    path = tmp_path / "runs.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")
    read, _, report = _read(path)
    assert read == texts
    assert report.damage == [] and report.skipped == 0


def _timed_read(path: Path, **kwargs: int) -> tuple[list[str], SkipReport, float]:
    start = time.perf_counter()
    texts, _, report = _read(path, **kwargs)
    return texts, report, time.perf_counter() - start


def test_a_64_mib_line_is_skipped_and_counted_in_linear_time(tmp_path: Path) -> None:
    assert DataSection().max_line_bytes == DEFAULT_MAX_LINE_BYTES
    path = tmp_path / "huge.json"
    with path.open("wb") as fh:
        fh.write(b'{"text": "before"}\n{"text": "')
        fh.write(b"a" * (64 << 20))
        fh.write(b'"}\n{"text": "after"}\n')
    texts, report, seconds = _timed_read(path)
    assert texts == ["before", "after"]
    assert report.by_reason == {"line_too_long": 1} and report.examples == {"line_too_long": [2]}
    assert seconds < 3.0, f"{seconds:.1f} s"
    # The limit is the setting's: a lower one skips an ordinary line too.
    texts, report, _ = _timed_read(path, max_line_bytes=12)
    assert texts == [] and report.by_reason == {"line_too_long": 3}


def test_a_gzip_bomb_line_without_newlines_is_skipped_quickly(tmp_path: Path) -> None:
    path = tmp_path / "zeros.json.gz"
    path.write_bytes(gzip.compress(b'{"text": "ok"}\n' + b"\0" * (64 << 20), compresslevel=9))
    assert path.stat().st_size < 100_000
    texts, report, seconds = _timed_read(path)
    assert texts == ["ok"] and report.by_reason == {"line_too_long": 1}
    assert seconds < 3.0, f"{seconds:.1f} s"


def test_a_100000_deep_json_line_is_skipped_and_counted(tmp_path: Path) -> None:
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    brackets_in_text = json.dumps({"text": "[" * 500 + "{" * 500}).encode()
    path = tmp_path / "deep.json"
    path.write_bytes(b"\n".join([deep, brackets_in_text, b'{"text": "fine"}']) + b"\n")
    texts, report, seconds = _timed_read(path)
    assert texts == ["[" * 500 + "{" * 500, "fine"]  # brackets inside a string do not nest
    assert report.by_reason == {"too_deep": 1} and report.examples == {"too_deep": [1]}
    assert seconds < 2.0, f"{seconds:.1f} s"
