"""Tokenizing across machines (``data.tokenize.executor: torchx``): real TorchX jobs, the real
DeepSeek tokenizer, and the token files compared with the one-machine run's.

A few generated C4-format shards keep it cheap. The kill test runs two ``local_cwd`` tasks,
one of them SIGKILLed after its first shard (a ``sitecustomize`` on the tasks' path); the
Slurm test runs the tasks on the test cluster's two nodes (``tests/cluster/slurm_up.sh``).
"""

from __future__ import annotations

import io
import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import write_c4_shard
from pydantic import ValidationError
from test_slurm import _require_cluster

from titan_kedro.config.schema import DataSection
from titan_kedro.data.shard_store import ShardStore
from titan_kedro.data.sources import ShardFile
from titan_kedro.data.task_plan import load_plan, shard_ranges
from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.datasets.token_files_dataset import TokenFilesDataset
from titan_kedro.launch.tokenize_job import TokenizeFailedError, tokenize_request
from titan_kedro.pipelines.data_processing import nodes

TOKENIZER = {"name_or_path": "deepseek-ai/DeepSeek-V2-Lite"}
SHARDS = [f"c4-train.0000{i}-of-00004.json.gz" for i in range(4)]
PASSWORD = "tok-s3cret-Pw"
SABOTAGE = """
    import os, signal
    import time
    kill, hang = (os.environ.get(f"TOKENIZE_TEST_{what}_AT") for what in ("KILL", "HANG"))
    if kill or hang:
        from titan_kedro.data import shard_tokenizing
        original = shard_tokenizing._tokenize_one
        def _tokenize_one(source, *args, **kwargs):
            if source.name == kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if source.name == hang:
                time.sleep(120)
            return original(source, *args, **kwargs)
        shard_tokenizing._tokenize_one = _tokenize_one
"""


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("c4")
    for i, name in enumerate(SHARDS):
        write_c4_shard(raw / name, 40 + 10 * i, seed=i)
    return raw


def _data(root: Path, raw: Path, **tokenize: Any) -> dict[str, Any]:
    return {
        "raw_dir": str(raw),
        "token_dir": str(root / "tokens"),
        "intermediate_dir": str(root / "intermediate"),
        "num_workers": 1,
        "batch_size": 16,
        "tokenize": tokenize,
    }


def _process(data: dict[str, Any]) -> dict[str, Any]:
    """data_processing's nodes on ``data``; the metadata.json the token folder gets."""
    raw = Path(data["raw_dir"])
    c4_raw = {p.name: (lambda p=p: ShardFile.from_path(p)) for p in sorted(raw.iterdir())}
    sources = nodes.clean_documents(c4_raw, data)
    shards = nodes.tokenize_documents(sources, data, TOKENIZER)
    split = nodes.split_documents(shards, data)
    TokenFilesDataset(path=data["token_dir"]).save(nodes.pack_documents(shards, split))
    return json.loads((Path(data["token_dir"]) / "metadata.json").read_text())


def _sabotage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **at: str) -> None:
    """Tasks started from now on ``KILL`` themselves (SIGKILL) or ``HANG`` at the named shard."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SABOTAGE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    for what, shard in at.items():
        monkeypatch.setenv(f"TOKENIZE_TEST_{what}_AT", shard)


@pytest.fixture(scope="module")
def one_machine(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The metadata of the local executor's run (today's process pool)."""
    return _process(_data(tmp_path_factory.mktemp("local"), corpus))


def test_shard_ranges_are_contiguous_and_balanced() -> None:
    assert shard_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert shard_ranges(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert shard_ranges(2, 5) == [range(0, 1), range(1, 2)]  # no task without a shard


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"tokenize": {"executor": "ray"}}, ["executor", "local", "torchx"]),
        ({"tokenize": {"scheduler": "local"}}, ["data.tokenize.scheduler", "executor: local"]),
        ({"tokenize": {"scheduler": "nope"}}, ["data.tokenize.scheduler", "slurm"]),
        ({"tokenize": {"tasks": 0}}, ["tasks"]),
        ({"tokenize": {"executor": "torchx"}, "source": "hub"}, ["data.source: local"]),
        ({"tokenize": {"executor": "torchx"}, "max_documents": 5}, ["max_documents: null"]),
    ],
)
def test_bad_tokenize_settings_are_refused_with_the_fix(
    data: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(ValidationError) as err:
        DataSection.model_validate(data)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_the_slurm_request_holds_the_plan_and_no_secret(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bob:{PASSWORD}@mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    data = DataSection.model_validate(
        _data(tmp_path, corpus, executor="torchx", scheduler="slurm", tasks=3, cpus=3)
    )
    sources = [ShardFile.from_path(corpus / name) for name in SHARDS]
    request = tokenize_request(data, sources, build_tokenizer(TOKENIZER["name_or_path"]))
    (plan_file,) = (tmp_path / "intermediate" / "tasks").glob("*/plan.json")
    assert load_plan(plan_file).tasks == [
        [{"name": n, "path": str(corpus / n)} for n in SHARDS[a:b]]
        for a, b in ((0, 2), (2, 3), (3, 4))
    ]
    assert f"--plan {plan_file}" in request and "--tasks 0,1,2" in request, request
    assert request.count("--cpus-per-task=3") == 3, request
    assert PASSWORD not in request


@pytest.mark.slow
def test_a_killed_task_is_redone_alone_and_the_tokens_equal_the_one_machine_run(
    corpus: Path,
    one_machine: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sabotage(tmp_path, monkeypatch, KILL=SHARDS[3])
    data = _data(tmp_path, corpus, executor="torchx", tasks=2, log_dir=str(tmp_path / "logs"))
    console = io.StringIO()
    monkeypatch.setattr("sys.stdout", console)
    with pytest.raises(TokenizeFailedError) as err:
        _process(data)
    message = str(err.value)
    assert "unfinished tasks: [1] of 2" in message, message
    assert f"{SHARDS[2]}: " in message and "tokens in" in message, message  # task 1's log tail
    tasks = tmp_path / "intermediate" / "tasks"
    (plan_dir,) = tasks.iterdir()
    done0 = plan_dir / "task-00000.done"
    assert done0.is_file() and not (plan_dir / "task-00001.done").exists()
    (kept,) = (
        ShardStore(tmp_path / "intermediate", f"tasks/{plan_dir.name}/task-00001.json")
        .manifest()
        .values()
    )
    assert kept["name"] == SHARDS[2]
    kept_folder = tmp_path / "intermediate" / kept["folder"]
    # Task 0's shards are in manifest.json already, for any later run (another task count).
    merged = ShardStore(tmp_path / "intermediate").manifest().values()
    assert sorted(e["name"] for e in merged) == SHARDS[:2]
    before = (done0.stat().st_mtime_ns, kept_folder.stat().st_ino)

    monkeypatch.delenv("TOKENIZE_TEST_KILL_AT")
    console.seek(0)
    console.truncate()
    assert _process(data) == one_machine
    out = console.getvalue()
    assert "finished before, running [1]" in out, out
    assert "[task 0]" not in out and f"{SHARDS[2]}: already tokenized" in out, out
    assert "tokenize: 2/2 tasks done" in out, out
    assert (done0.stat().st_mtime_ns, kept_folder.stat().st_ino) == before


@pytest.mark.slow
def test_a_job_past_its_timeout_is_cancelled_and_says_so(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sabotage(tmp_path, monkeypatch, HANG=SHARDS[0])
    monkeypatch.setattr("sys.stdout", io.StringIO())
    data = _data(tmp_path, corpus, executor="torchx", tasks=2, timeout_s=3)
    with pytest.raises(TokenizeFailedError, match=r"timeout_s=3s and was cancelled") as err:
        _process(data)
    # Task 1 may not have finished either on a loaded machine; task 0 never can.
    assert re.search(r"unfinished tasks: \[0(, 1)?\] of 2", str(err.value)), str(err.value)


@pytest.mark.slow
@pytest.mark.slurm_cluster
def test_two_slurm_nodes_give_the_one_machine_totals_and_fingerprints(
    corpus: Path,
    one_machine: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_cluster()
    console = io.StringIO()
    monkeypatch.setattr("sys.stdout", console)
    monkeypatch.chdir(tmp_path)  # sbatch writes the tasks' slurm-*.out here
    # Two cores per task: a node of the test cluster has two, so each task gets a node.
    data = _data(tmp_path, corpus, executor="torchx", scheduler="slurm", cpus=2, memory_mb=1024)
    meta = _process(data)
    out = console.getvalue()
    assert "tokenize: 2/2 tasks done" in out, out
    assert "task 0 done on n" in out and "task 1 done on n" in out, out
    nodes = {out.split(f"task {k} done on ")[1].split(":")[0] for k in (0, 1)}
    assert nodes == {"n1", "n2"}, out
    assert meta["fingerprint"] == one_machine["fingerprint"]
    assert meta["splits"] == one_machine["splits"]
    assert meta == one_machine
