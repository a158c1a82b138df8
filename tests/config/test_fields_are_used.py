"""Every job-config field has an effect: something in src/ reads it (besides its definition)."""

from __future__ import annotations

import re
from pathlib import Path

from titan_kedro.config.schema import JobConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "titan_kedro"
SCHEMA = SRC / "config" / "schema.py"


def _reads(field: str, sources: str) -> bool:
    # attribute access (cfg.section.field), a key (["field"] / .get("field")) or a kwarg.
    return re.search(rf"\.{field}\b|[\"']{field}[\"']", sources) is not None


def test_every_config_field_is_read_somewhere_in_src() -> None:
    sources = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py") if p != SCHEMA)
    unread = sorted(
        f"{section}.{field}"
        for section, info in JobConfig.model_fields.items()
        for field in info.annotation.model_fields
        if not _reads(field, sources)
    )
    assert unread == [], "config fields that nothing reads (remove them or make them take effect)"


def test_the_check_catches_an_unread_field() -> None:
    assert _reads("raw_dir", "cfg.data.raw_dir")
    assert _reads("batches", 'evaluation["batches"]')
    assert not _reads("raw_dir", "raw_directory = 1")
