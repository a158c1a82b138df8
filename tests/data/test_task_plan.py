"""The task plan of tokenizing across machines, in process: markers, replaced shards, and
plan files that are checked before a task reads what they name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_c4_shard
from data_helpers import offline_tokenizer

from titan_kedro.data.sources import ShardFile
from titan_kedro.data.task_plan import (
    SETTINGS,
    TaskPlanError,
    is_finished,
    load_plan,
    merge_tasks,
    run_task,
    write_plan,
)

NAMES = [f"c4-train.0000{i}-of-00003.json.gz" for i in range(3)]
SETTING_VALUES = dict(zip(SETTINGS, (16, 1, 1, 0.01, 8 << 20), strict=True))


@pytest.fixture
def plan_and_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Path]]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shards = [write_c4_shard(tmp_path / "c4" / name, 20, seed=i) for i, name in enumerate(NAMES)]
    sources = [ShardFile.from_path(p) for p in shards]
    plan = write_plan(tmp_path / "tok", sources, offline_tokenizer(), SETTING_VALUES, 2)
    return plan.path, shards


def test_a_replaced_shard_unfinishes_only_its_task(
    plan_and_shards: tuple[Path, list[Path]],
) -> None:
    plan_path, shards = plan_and_shards
    plan = load_plan(plan_path)
    assert [len(task) for task in plan.tasks] == [2, 1]
    assert not is_finished(plan, 0)
    with pytest.raises(TaskPlanError, match=r"tasks \[0, 1\] .* have not finished"):
        merge_tasks(plan)
    first = [run_task(plan, k) for k in (0, 1)]
    assert [is_finished(plan, k) for k in (0, 1)] == [True, True]
    merged = merge_tasks(plan)
    assert [e["name"] for e in merged] == NAMES
    assert merged == first[0] + first[1]
    manifest = json.loads((plan.root / "manifest.json").read_text())["shards"]
    assert sorted(manifest) == sorted(e["key"] for e in merged)

    # Another plan (one task) reuses what manifest.json holds: same entries, folders untouched.
    folders = [plan.root / e["folder"] for e in merged]
    inodes = [f.stat().st_ino for f in folders]
    sources = [ShardFile.from_path(p) for p in shards]
    one = write_plan(plan.root, sources, offline_tokenizer(), SETTING_VALUES, 1)
    assert one.path != plan.path and run_task(one, 0) == merged
    assert [f.stat().st_ino for f in folders] == inodes

    write_c4_shard(shards[2], 25, seed=9)  # task 1's shard is replaced
    assert [is_finished(plan, k) for k in (0, 1)] == [True, False]
    (redone,) = run_task(plan, 1)
    assert redone["documents"] == 25 and redone["key"] != merged[2]["key"]


def test_a_plan_naming_a_file_that_is_not_a_shard_is_refused(
    plan_and_shards: tuple[Path, list[Path]],
) -> None:
    plan_path, _ = plan_and_shards
    content = json.loads(plan_path.read_text())
    content["tasks"][1][0]["path"] = "/etc/passwd"
    plan_path.write_text(json.dumps(content))
    with pytest.raises(TaskPlanError, match=r"task 1 names shard .*/etc/passwd.* relaunch"):
        load_plan(plan_path)
    elsewhere = plan_path.parents[2] / "plan.json"
    elsewhere.write_text(json.dumps(content))
    with pytest.raises(TaskPlanError, match="is not a tokenizing plan"):
        load_plan(elsewhere)


def test_a_task_whose_tokenizer_differs_from_the_plan_fails_before_reading(
    plan_and_shards: tuple[Path, list[Path]],
) -> None:
    plan_path, _ = plan_and_shards
    content = json.loads(plan_path.read_text())
    content["tokenizer"]["fingerprint"] = "another"
    plan_path.write_text(json.dumps(content))
    plan = load_plan(plan_path)
    with pytest.raises(TaskPlanError, match="same tokenizer files"):
        run_task(plan, 0)
    assert not (plan.root / "shards").exists()
