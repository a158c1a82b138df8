"""Every job-config field has an effect: code reads it during a real run.

The check itself needs the one real ``kedro run --env test`` of every pipeline and of the
torchrun workers that the end-to-end tests make, so it lives beside them
(``tests/test_end_to_end.py::test_every_config_field_is_read_by_the_run``). These tests
show that the recording it relies on sees real reads, only real reads, in subprocesses
too, and that a dead field fails whatever its name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pydantic import Field

from tests.config.field_reads import (
    branch_reads,
    config_fields,
    read_recorded,
    recording,
    recording_env,
    unread_fields,
)
from titan_kedro.config.schema import JobConfig, Section
from titan_kedro.models.resolve import resolve_job_config

SRC = Path(__file__).resolve().parents[2] / "src" / "titan_kedro"


class ThrowawaySection(Section):
    name: str = "unused"
    """A field nothing reads, named like fields that other sections' code reads a lot."""


class JobConfigWithThrowaway(JobConfig):
    throwaway: ThrowawaySection = Field(default_factory=ThrowawaySection)
    """A section added only for this test."""


def test_a_dead_field_named_name_fails_the_check() -> None:
    with recording() as reads:
        cfg = resolve_job_config({"model": {"name": "llama3"}}).config
        assert (cfg.job.name, cfg.model.name) == ("titan-kedro", "llama3")
    assert "throwaway.name" in unread_fields(reads, JobConfigWithThrowaway)
    assert {"job.name", "model.name"}.isdisjoint(unread_fields(reads, JobConfigWithThrowaway))
    # Matching `.name` in the sources, as this check once did, would have passed it.
    sources = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))
    assert re.search(r"\.name\b", sources)


def test_reads_count_per_section_and_dumping_or_printing_is_no_read() -> None:
    cfg, other = JobConfig(), JobConfig()  # validators read fields: construct outside
    with recording() as reads:
        cfg.model_dump()
        cfg.model_copy(deep=True)
        assert repr(cfg) == repr(other) and cfg == other
    assert reads == set()
    with recording() as reads:
        getattr(cfg.parallelism, "no_such_degree", 1)  # not a field: no read
        steps = cfg.training.steps
    assert steps == 200
    assert [config_fields()[read] for read in reads] == ["training.steps"]


def test_a_subprocess_started_with_the_recording_env_writes_its_reads(tmp_path: Path) -> None:
    code = "from titan_kedro.config import JobConfig; print(JobConfig().launch.resources.gpus)"
    env = {**os.environ, **recording_env(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    with recording() as validators_read:
        JobConfig()
    recorded = read_recorded(tmp_path)
    assert validators_read <= recorded
    assert {config_fields()[read] for read in recorded - validators_read} == {
        "launch.resources",
        "launch.resources.gpus",
    }


def test_the_branches_a_local_run_skips_read_their_fields(tmp_path: Path) -> None:
    fields = config_fields()
    read = {fields[key] for key in branch_reads(tmp_path) if key in fields}
    assert {
        "launch.scheduler_args",
        "launch.resources.gpus",
        "launch.shared_dir",
        "launch.dryrun_dir",
        "plan.gpu",
        "training.mixed_precision_param",
        "data.hub_split",
        "data.hub_max_documents",
        "fault_tolerance.lighthouse_bind",
        "launch.auto_continue",
        "launch.save_before_limit_s",
    } <= read
