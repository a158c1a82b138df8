"""Counting, logging and judging the records that are skipped as bad input."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

SKIP_REASONS = {
    "invalid_json": "the line is not valid JSON",
    "missing_text": "the record has no string 'text' field",
    "empty_text": "the text is empty or shorter than data.min_chars",
    "invalid_utf8": "the line is not valid UTF-8 (or the text holds a lone surrogate escape)",
    "truncated": "the last line was cut off by a truncated file",
    "line_too_long": "the line is longer than data.max_line_bytes (dropped unread)",
    "too_deep": "the line's JSON nests arrays/objects deeper than the reader allows",
}
_LOGGED_PER_SOURCE = 10
_EXAMPLES_PER_REASON = 5


class BadInputError(ValueError):
    """Too much of a source was unreadable; the message says how much, why and where."""


@dataclass
class SkipReport:
    """What happened to the records of one source: kept, skipped (by reason, with lines), damage."""

    source: str
    """Source name (a shard file name or the hub dataset)."""
    kept: int = 0
    """Records that became documents."""
    by_reason: Counter[str] = field(default_factory=Counter)
    """Skipped records per reason (keys from ``SKIP_REASONS``)."""
    examples: dict[str, list[int]] = field(default_factory=dict)
    """First few line numbers per reason."""
    damage: list[str] = field(default_factory=list)
    """File-level problems, e.g. a truncated or corrupt gzip stream."""
    fatal: bool = False
    """Some damage makes the whole source untrustworthy (``check`` then always fails)."""

    @property
    def skipped(self) -> int:
        return sum(self.by_reason.values())

    @property
    def records(self) -> int:
        return self.kept + self.skipped

    @property
    def bad_fraction(self) -> float:
        return self.skipped / self.records if self.records else 0.0

    def skip(self, reason: str, line: int, detail: str = "") -> None:
        """Count one skipped record and log it (the first few per source)."""
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; known: {', '.join(SKIP_REASONS)}")
        self.by_reason[reason] += 1
        lines = self.examples.setdefault(reason, [])
        if len(lines) < _EXAMPLES_PER_REASON:
            lines.append(line)
        if self.skipped <= _LOGGED_PER_SOURCE:
            logger.warning(
                "%s:%d skipped (%s)%s", self.source, line, reason, f": {detail}" if detail else ""
            )
            if self.skipped == _LOGGED_PER_SOURCE:
                logger.warning("%s: further skipped lines are counted, not logged", self.source)

    def add_damage(self, message: str, *, fatal: bool = False) -> None:
        """Record (and log) file-level damage; unless ``fatal``, the readable part is used."""
        self.damage.append(message)
        self.fatal = self.fatal or fatal
        logger.warning("%s: %s", self.source, message)

    def describe(self) -> str:
        """One line: how many were skipped, why, and on which lines."""
        parts = []
        for reason, count in self.by_reason.most_common():
            lines = ", ".join(str(n) for n in self.examples.get(reason, []))
            more = ", …" if count > len(self.examples.get(reason, [])) else ""
            parts.append(f"{reason} {count} (lines {lines}{more})")
        text = f"{self.skipped} of {self.records} records skipped"
        if parts:
            text += ": " + "; ".join(parts)
        if self.damage:
            text += "; damage: " + "; ".join(self.damage)
        return text

    def check(self, max_bad_fraction: float) -> None:
        """Raise ``BadInputError`` on fatal damage or a skipped share above ``max_bad_fraction``."""
        if self.fatal:
            raise BadInputError(
                f"{self.source}: {self.describe()}. Shards processed before this one are kept "
                "in the manifest."
            )
        if self.skipped and self.bad_fraction > max_bad_fraction:
            raise BadInputError(
                f"{self.source}: {self.describe()} — {self.bad_fraction:.1%} is above "
                f"data.max_bad_fraction={max_bad_fraction}. Fix or remove the shard, or raise "
                "data.max_bad_fraction if losing these records is acceptable. Shards processed "
                "before this one are kept in the manifest."
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready summary."""
        return {
            "documents": self.kept,
            "skipped": self.skipped,
            "skipped_by_reason": dict(sorted(self.by_reason.items())),
            "skipped_examples": {k: list(v) for k, v in sorted(self.examples.items())},
            "damage": list(self.damage),
        }
