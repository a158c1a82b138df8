"""End to end: ``kedro run --env test`` on C4-format data, checked through its MLflow run.

The run happens once, in a temporary copy of the project (pyproject.toml, conf/, empty
data/ and src/; the package itself is the installed one), so it never touches the
repository's data/ or mlflow.db. Every test below reads that one run (kedro-viz builds
in that project too: its previews need the run's outputs), except the interrupted and
continued pair: two more runs of the training pipelines in that project, whose checkpoints
go to the S3 test server (``tests/storage_fixtures.py``), so continuing reads them there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import SHARED_SAMPLE, write_c4_shard
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from mlflow_store import migrated_store
from train.helpers import TINY_DEEPSEEK, node_job_config, rerun_here

from tests.config.field_reads import (
    branch_reads,
    config_fields,
    read_recorded,
    recording_env,
    unread_fields,
)
from tests.storage_fixtures import S3Bucket

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-e2e-7f3a9c"
CONFIG_READS = "config_reads"
DATA_LAYERS = (
    "01_raw/c4", "02_intermediate", "03_primary", "04_feature", "05_model_input",
    "06_models", "07_model_output", "08_reporting",
)  # fmt: skip


def copy_project(dest: Path, *, mlflow_store: bool = True) -> Path:
    """A runnable copy of the Kedro project in ``dest`` without data or local config.

    Args:
        dest: The copy's folder.
        mlflow_store: Start its ``mlflow.db`` migrated (``mlflow_store.migrated_store``).
    """
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(REPO / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    # Kedro insists that source_dir lies inside the project; the package is installed.
    (dest / "src").mkdir()
    for layer in DATA_LAYERS:
        (dest / "data" / layer).mkdir(parents=True)
    if mlflow_store:
        migrated_store(dest / "mlflow.db")
    return dest


def add_c4_sample(project: Path) -> None:
    """The 900-document C4 sample beside the repo, else a generated shard of the same format."""
    raw = project / "data" / "01_raw" / "c4"
    if SHARED_SAMPLE.exists():
        shutil.copyfile(SHARED_SAMPLE, raw / SHARED_SAMPLE.name)
    else:
        write_c4_shard(raw / "c4-train.00000-of-01024.json.gz", 900)


def add_mlflow_secret(project: Path) -> None:
    """A credential that kedro-mlflow exports to the environment; it must never be logged."""
    (project / "conf" / "local" / "credentials.yml").write_text(
        yaml.safe_dump({"e2e_mlflow": {"TITAN_E2E_DUMMY_TOKEN": SECRET}})
    )
    mlflow_yml = project / "conf" / "base" / "mlflow.yml"
    config = yaml.safe_load(mlflow_yml.read_text())
    config["server"]["credentials"] = "e2e_mlflow"
    mlflow_yml.write_text(yaml.safe_dump(config))


@dataclass
class E2ERun:
    project: Path
    client: MlflowClient
    run: Run
    wall_time_s: float

    def history(self, key: str) -> list[tuple[int, float]]:
        return [
            (m.step, m.value) for m in self.client.get_metric_history(self.run.info.run_id, key)
        ]

    def artifacts(self, path: str | None = None) -> list[str]:
        found = []
        for item in self.client.list_artifacts(self.run.info.run_id, path):
            found += self.artifacts(item.path) if item.is_dir else [item.path]
        return found

    def artifact_text(self, path: str) -> str:
        local = self.client.download_artifacts(self.run.info.run_id, path, str(self.project / "dl"))
        return Path(local).read_text(encoding="utf-8")


def kedro_run(
    project: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kedro run --env test …`` in the project copy, tracking into its own mlflow.db."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "KEDRO_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "kedro", "run", "--env", "test", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip


def checkpoint_of(project: Path, run: Run, step: int) -> Path:
    """The run's ``step-<n>`` folder: every run has its own under ``checkpoint.folder``."""
    return project / "data/06_models/checkpoints" / run.info.run_id / f"step-{step}"


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> E2ERun:
    project = copy_project(tmp_path_factory.mktemp("e2e") / "project")
    add_c4_sample(project)
    add_mlflow_secret(project)
    uri = f"sqlite:///{project / 'mlflow.db'}"
    start = time.perf_counter()
    # Every process of the run (kedro, torchrun, the workers) records the config fields
    # it reads into config_reads/ (test_every_config_field_is_read_by_the_run).
    proc = kedro_run(project, extra_env=recording_env(project / CONFIG_READS))
    wall = time.perf_counter() - start
    print(f"\nkedro run --env test: {wall:.1f}s wall")
    assert proc.returncode == 0, f"kedro run failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("titan_kedro")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one kedro run must be exactly one MLflow run"
    return E2ERun(project, client, runs[0], wall)


@pytest.mark.slow
def test_the_run_finished_and_wrote_inside_the_project_copy(e2e: E2ERun) -> None:
    assert e2e.run.info.status == "FINISHED"
    assert e2e.run.data.tags["project_path"] == str(e2e.project)
    data = e2e.project / "data"
    assert (checkpoint_of(e2e.project, e2e.run, 12) / "metadata.json").is_file()
    # The node's summary is also the run's own record, beside the config its workers got.
    summary = json.loads((data / "07_model_output/training_summary.json").read_text())
    assert summary["final_step"] == 12 and summary["tokens_seen"] == 12 * 4 * 64  # conf/test
    assert summary["checkpoint_dir"].endswith("step-12")
    folder = data / "07_model_output/job/runs" / e2e.run.info.run_id
    assert json.loads((folder / "summary.json").read_text()) == summary
    assert (folder / "job_config.yaml").is_file()
    for path in (
        "05_model_input/tokens/metadata.json",
        "06_models/model_spec.json",
        "06_models/hf/config.json",
        "07_model_output/job/metrics.jsonl",
        "07_model_output/generations.json",
        "08_reporting/loss.png",
        "08_reporting/expert_load.png",
    ):
        assert (data / path).is_file(), path


@pytest.mark.slow
def test_worker_step_metrics_and_evaluation_land_in_the_run(e2e: E2ERun) -> None:
    loss = e2e.history("loss")
    assert len({step for step, _ in loss}) >= 10
    values = [v for _, v in sorted(loss)]
    assert values[-1] < values[0] - 0.5, f"loss did not fall: {values}"
    for key in ("loss", "tps", "mfu_pct", "lr", "grad_norm", "memory_gib"):
        assert sorted(step for step, _ in e2e.history(key)) == list(range(1, 13)), key
    assert all(v > 0 for _, v in e2e.history("tps"))
    # conf/base's metrics.peak_tflops is null: measured on this CPU, logged once.
    (peak,) = e2e.history("peak_tflops")
    assert peak[1] > 0
    # The trainer validates every 6 steps (validation.freq in conf/test) under val_loss; the
    # evaluation node scores the final checkpoint under eval_loss. Each key has one writer.
    rows = [
        json.loads(line)
        for line in (e2e.project / "data/07_model_output/job/metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    trainer_val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(trainer_val) == [6, 12]
    assert sorted(e2e.history("val_loss")) == [
        (step, pytest.approx(value)) for step, value in sorted(trainer_val.items())
    ]
    assert trainer_val[12] < values[0]
    evaluation = json.loads((e2e.project / "data/07_model_output/evaluation.json").read_text())
    assert "val_loss" not in evaluation
    assert e2e.history("eval_loss") == [(12, pytest.approx(evaluation["eval_loss"]))]
    assert e2e.history("eval_perplexity") == [(12, pytest.approx(evaluation["eval_perplexity"]))]
    assert evaluation["eval_loss"] < values[0]


@pytest.mark.slow
def test_parameters_are_flattened_and_credentials_never_logged(e2e: E2ERun) -> None:
    params = e2e.run.data.params
    assert params["training.steps"] == "12"
    assert params["optimizer.lr"] == "0.003"
    assert params["parallelism.expert_parallel_degree"] == "2"  # conf/test: EP over 2 workers
    assert params["evaluation.max_new_tokens"] == "8"
    # Nodes take params:<section> inputs, never the whole `parameters` (logged twice).
    assert not [key for key in params if key.startswith("parameters.")]
    logged = [*params.values(), *e2e.run.data.tags.values()]
    logged += [e2e.artifact_text(p) for p in e2e.artifacts() if p.endswith((".json", ".yaml"))]
    assert not any(SECRET in text for text in logged)


@pytest.mark.slow
def test_tags_identify_code_environment_model_and_data(e2e: E2ERun) -> None:
    tags = e2e.run.data.tags
    metadata = json.loads((e2e.project / "data/05_model_input/tokens/metadata.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", tags["git_commit"])
    assert tags["kedro_env"] == "test"
    assert (tags["model.spec"], tags["model.flavor"]) == ("deepseek_v2", "debugmodel")
    assert tags["tokenizer_fingerprint"] == metadata["tokenizer"]["fingerprint"]
    assert tags["data_fingerprint"] == metadata["fingerprint"]
    assert e2e.run.info.run_name == "titan-kedro-demo"


@pytest.mark.slow
def test_artifacts_hold_config_model_card_data_plots_and_generations(e2e: E2ERun) -> None:
    artifacts = set(e2e.artifacts())
    expected = {
        "config/job_config.yaml",
        "model/model_spec.json",
        "data/metadata.json",
        "training/summary.json",
        "plots/loss.png",
        "plots/learning_rate.png",
        "plots/throughput.png",
        "plots/expert_load.png",
        "evaluation/evaluation.json",
        "evaluation/generations.json",
        "reporting/summary.json",
        "model/hf_export.json",
    }
    assert expected <= artifacts, expected - artifacts
    config = yaml.safe_load(e2e.artifact_text("config/job_config.yaml"))
    assert config["training"]["steps"] == 12 and config["model"]["name"] == "deepseek_v2"
    card = json.loads(e2e.artifact_text("model/model_spec.json"))
    assert card == json.loads((e2e.project / "data/06_models/model_spec.json").read_text())
    metadata = json.loads(e2e.artifact_text("data/metadata.json"))
    assert metadata["fingerprint"] == e2e.run.data.tags["data_fingerprint"]
    generations = json.loads(e2e.artifact_text("evaluation/generations.json"))
    assert len(generations["samples"]) == 2
    assert all(s["greedy"] and s["sampled"] and s["prompt"] for s in generations["samples"])


@pytest.mark.slow
def test_exported_model_loads_in_transformers_and_matches_our_logits(e2e: E2ERun) -> None:
    from titan_kedro.models.hf_export import compare_logits
    from titan_kedro.models.resolve import resolve_job_config
    from titan_kedro.train.evaluate import load_checkpoint_model

    folder = e2e.project / "data/06_models/hf"
    manifest = json.loads(e2e.artifact_text("model/hf_export.json"))
    assert manifest["faithful"] is True
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["vocab_size"] == 102400

    raw = yaml.safe_load(
        node_job_config(e2e.project / "data/07_model_output/job", e2e.run.info.run_id).read_text()
    )
    ours = load_checkpoint_model(
        resolve_job_config(raw), checkpoint_of(e2e.project, e2e.run, 12)
    ).model
    stream = np.fromfile(e2e.project / "data/05_model_input/tokens/validation.bin", dtype="<u4")
    tokens = torch.from_numpy(stream[100:164].astype(np.int64))[None]
    assert compare_logits(folder, ours, tokens) <= 1e-4  # AutoModelForCausalLM, fp32


@pytest.mark.slow
def test_a_failed_training_marks_the_mlflow_run_failed(
    e2e: E2ERun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    uri = f"sqlite:///{tmp_path / 'failed.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("KEDRO_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(e2e.project)
    bootstrap_project(e2e.project)
    # The training node refuses token ids the model cannot embed, before any worker starts.
    params = {"model": {"overrides": {"vocab_size": 1000}}}
    try:
        with KedroSession.create(
            project_path=e2e.project, env="test", runtime_params=params
        ) as session:
            with pytest.raises(
                ValueError, match="vocab_size 100002 but the model's vocab_size is 1000"
            ):
                session.run(pipeline_names=["training"])
    finally:
        bootstrap_project(REPO)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("titan_kedro").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert runs[0].data.tags["model.spec"] == "deepseek_v2"  # our hook ran before the failure


@pytest.mark.slow
def test_every_config_field_is_read_by_the_run(e2e: E2ERun, tmp_path: Path) -> None:
    """A field nothing reads in a real run of every pipeline and the workers is dead.

    Fields that only a Slurm dry run of a GPU job or a hub data source read come from
    ``branch_reads``, which runs those branches of the library for real.
    """
    recorded = e2e.project / CONFIG_READS
    processes = [json.loads(path.read_text()) for path in recorded.glob("reads-*.json")]
    # The step clips gradients: both workers ran it, and so did the kedro process, whose plan
    # measures the trainer's own step on fake tensors (torchrun's agent reads no field).
    fields = config_fields()
    readers = [[fields.get(tuple(read)) for read in reads] for reads in processes if reads]
    assert sum("training.max_norm" in paths for paths in readers) == len(readers) == 3, readers
    assert any("export.alias" in paths for paths in readers)  # the export node, in kedro run
    unread = unread_fields(read_recorded(recorded) | branch_reads(tmp_path))
    assert unread == [], "config fields nothing reads (remove them or make them take effect)"


# Runs before the `interrupted` fixture: later runs could register new versions and move the alias.
@pytest.mark.slow
def test_system_metrics_dataset_inputs_and_registered_model(e2e: E2ERun) -> None:
    import mlflow

    run_id = e2e.run.info.run_id
    system = [key for key in e2e.run.data.metrics if key.startswith("system/node-0/")]
    assert "system/node-0/cpu_utilization_percentage" in system
    assert "system/node-0/system_memory_usage_megabytes" in system

    inputs = {
        i.dataset.name: {t.key: t.value for t in i.tags}.get("mlflow.data.context")
        for i in e2e.run.inputs.dataset_inputs
    }
    assert inputs == {"c4-raw": "raw", "tokens-train": "train", "tokens-validation": "validation"}
    metadata = json.loads(
        (e2e.project / "data/05_model_input/tokens/metadata.json").read_text(encoding="utf-8")
    )
    train = next(i for i in e2e.run.inputs.dataset_inputs if i.dataset.name == "tokens-train")
    assert train.dataset.digest == metadata["splits"]["train"]["sha256"][:16]

    manifest = json.loads(e2e.artifact_text("model/hf_export.json"))
    registered = manifest["registered_model"]
    assert registered["alias"] == "candidate"
    assert registered["name"] == e2e.run.data.tags["job.name"]  # the default: job.name
    version = e2e.client.get_model_version_by_alias(registered["name"], "candidate")
    assert version.run_id == run_id and str(version.version) == str(registered["version"])

    mlflow.set_tracking_uri(f"sqlite:///{e2e.project / 'mlflow.db'}")
    try:
        loaded = mlflow.pyfunc.load_model(f"models:/{registered['name']}@candidate")
    finally:
        mlflow.set_tracking_uri(None)
    from titan_kedro.models.resolve import resolve_job_config
    from titan_kedro.train.evaluate import load_checkpoint_model

    raw = yaml.safe_load(
        node_job_config(e2e.project / "data/07_model_output/job", e2e.run.info.run_id).read_text()
    )
    ours = load_checkpoint_model(
        resolve_job_config(raw), checkpoint_of(e2e.project, e2e.run, 12)
    ).model.eval()
    stream = np.fromfile(e2e.project / "data/05_model_input/tokens/validation.bin", dtype="<u4")
    tokens = stream[100:132].astype(np.int64)[None]
    theirs = loaded.predict({"input_ids": tokens})
    with torch.no_grad():
        expected = ours(torch.from_numpy(tokens)).numpy()
    assert theirs.shape == expected.shape
    assert float(np.abs(theirs - expected).max()) <= 1e-4


TRAIN_ONLY = ("--pipelines", "model_spec,training")  # on the e2e run's token files
SMALL_MODEL = ",".join(
    f"model.overrides.{key}={value}"
    for key, value in {**TINY_DEEPSEEK, "vocab_size": None, "dim": 16}.items()
    if value is not None
)
"""The interrupted and continued runs test training mechanics (a new run, continuing on
another layout), not the vocabulary: the real tokenizer's 102,400-row tables stay, 16
wide, and the rest is ``TINY_DEEPSEEK``'s (a few seconds of training, not a minute)."""


@dataclass
class Interrupted:
    run: Run
    """The second run of the project: rank 1 exits at step 5, checkpoints every 3 steps."""
    output: str
    bucket: S3Bucket
    checkpoints: str
    """``checkpoint.folder`` of this run and its continuation: ``s3://<bucket>/checkpoints``."""
    uninterrupted: dict[int, float]
    """The same job uninterrupted (its 12 losses): 1 × 2 forked gloo ranks (``rerun_here``)
    from the run's own config. Trained here, so the continued test's 90 s hold its run alone."""

    def checkpoint(self, run: Run, step: int) -> str:
        """The run's ``step-<n>`` folder on the bucket, as the filesystem names it."""
        return f"{self.bucket.name}/checkpoints/{run.info.run_id}/step-{step}"


@pytest.fixture(scope="module")
def interrupted(e2e: E2ERun, s3_module_bucket: S3Bucket) -> Interrupted:
    """A second ``kedro run`` in the e2e project, checkpointing to S3, whose rank 1 exits
    at step 5."""
    crash = {
        "TITAN_KEDRO_TEST_HOOKS": "1",
        "TITAN_KEDRO_CRASH_AT_STEP": "5",
        "TITAN_KEDRO_CRASH_RANK": "1",
    }
    checkpoints = f"{s3_module_bucket.uri}/checkpoints"
    failed = kedro_run(
        e2e.project,
        *TRAIN_ONLY,
        "--params",
        f"checkpoint.interval=3,checkpoint.folder={checkpoints},{SMALL_MODEL}",
        extra_env=crash,
    )
    output = failed.stdout + failed.stderr
    # The console shows the first failure torchrun saw: rank 1's exit, or rank 0's broken
    # collective when rank 0 fails first (a race); rank 1's own log always says why.
    logs = e2e.project / "data/07_model_output/logs"
    said = [
        log
        for log in logs.glob("*/attempt_0/1/stderr.log")
        if "rank 1 exits at step 5" in log.read_text(errors="replace")
    ]
    assert failed.returncode != 0 and len(said) == 1, output[-6000:]
    experiment = e2e.client.get_experiment_by_name("titan_kedro")
    runs = e2e.client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])
    assert len(runs) == 2 and runs[0].info.run_id == e2e.run.info.run_id, (
        [(r.info.run_id, r.info.status, r.info.start_time) for r in runs],
        output[-3000:],
    )
    reference = rerun_here(
        node_job_config(e2e.project / "data/07_model_output/job", runs[1].info.run_id),
        e2e.project.parent / "uninterrupted",
        nproc=2,
        data={"token_dir": str(e2e.project / "data/05_model_input/tokens")},  # not cwd's
        checkpoint={"enable": False},  # only its losses are compared
    )
    return Interrupted(runs[1], output, s3_module_bucket, checkpoints, reference)


@pytest.mark.slow
def test_a_second_kedro_run_is_a_new_run_that_trains_from_step_1(
    e2e: E2ERun, interrupted: Interrupted
) -> None:
    first, second = e2e.run, interrupted.run
    assert second.info.run_id != first.info.run_id and second.info.status == "FAILED"
    steps = sorted(m.step for m in e2e.client.get_metric_history(second.info.run_id, "loss"))
    assert steps[:4] == [1, 2, 3, 4], steps  # from step 1, not from the first run's step 12
    assert "resumed from" not in interrupted.output, interrupted.output[-4000:]
    # Each run writes under its own run id; the first run's checkpoint is untouched.
    assert interrupted.bucket.fs().isfile(f"{interrupted.checkpoint(second, 3)}/metadata.json")
    assert (checkpoint_of(e2e.project, first, 12) / "metadata.json").is_file()


@pytest.mark.slow
def test_the_interrupted_run_continues_on_two_torchx_agents_into_its_mlflow_run(
    e2e: E2ERun, interrupted: Interrupted
) -> None:
    """Continued with ``launch.scheduler=local_cwd``: two torchrun agents (2 nodes × 1
    process, one CPU thread each like the 1 × 2 run) meet at a c10d rendezvous, reload the
    1 × 2 checkpoint of step 3 from S3 and log the uninterrupted run's losses into the same
    run."""
    experiment = e2e.client.get_experiment_by_name("titan_kedro")
    two_agents = "launch.scheduler=local_cwd,launch.nnodes=2,launch.nproc_per_node=1"
    params = (
        f"checkpoint.resume=latest,checkpoint.interval=3,checkpoint.folder="
        f"{interrupted.checkpoints},{two_agents},training.num_threads=1,{SMALL_MODEL}"
    )
    proc = kedro_run(e2e.project, *TRAIN_ONLY, "--params", params)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"continuing failed:\n{output[-6000:]}"
    replicas = sorted((e2e.project / "data/07_model_output/logs/torchx").glob("*/*/train/*"))
    assert [p.name for p in replicas] == ["0", "1"], replicas  # one torchrun agent per node
    assert "world 2 (cpu)" in output  # the agents formed one group
    run_id = interrupted.run.info.run_id
    assert f"resumed from {interrupted.checkpoints}/{run_id}/step-3 at step 3" in output
    runs = e2e.client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])
    assert len(runs) == 2, "continuing must reopen the interrupted MLflow run, not start one"
    continued = e2e.client.get_run(interrupted.run.info.run_id)
    assert continued.info.status == "FINISHED"
    assert "checkpoint.resume: never -> latest" in continued.data.tags["titan_kedro.changed_params"]
    history = e2e.client.get_metric_history(interrupted.run.info.run_id, "loss")
    reference = interrupted.uninterrupted
    assert {m.step for m in history} == set(reference) == set(range(1, 13))
    # Steps 1-4 were logged before the crash on 1 × 2, 4-12 after continuing on 2 × 1.
    worst = max(abs(m.value - reference[m.step]) for m in history)
    print(f"max |loss(continued on 2x1) - loss(1x2)| over 12 steps: {worst:.2e}")
    for m in history:
        assert m.value == pytest.approx(reference[m.step], abs=1e-6), m.step
    assert interrupted.bucket.fs().isfile(
        f"{interrupted.checkpoint(interrupted.run, 12)}/metadata.json"
    )
    # After 2 warmup steps the schedule falls at every step, across the resume too (the
    # logged lr once stayed at the checkpoint's while training used the scheduled one).
    lrs = {m.step: m.value for m in e2e.client.get_metric_history(continued.info.run_id, "lr")}
    assert all(lrs[step + 1] < lrs[step] for step in range(2, 12)), lrs


def test_copy_project_leaves_out_local_config(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "p")
    assert (project / "conf" / "base" / "mlflow.yml").is_file()
    assert list((project / "conf" / "local").iterdir()) == []
    assert all((project / "data" / layer).is_dir() for layer in DATA_LAYERS)


VIZ_PIPELINES = {
    "__default__",
    "data_processing",
    "model_spec",
    "training",
    "evaluation",
    "reporting",
    "export_hf",
}
VIZ_LAYER_ORDER = (
    "raw", "intermediate", "primary", "model_input", "models", "model_output", "reporting",
)  # fmt: skip


@pytest.fixture(scope="module")
def viz_build(e2e: E2ERun) -> Path:
    """``kedro viz build --include-previews`` (project hooks off, the default), once, in the
    e2e project: its previews need the run's outputs; its pipelines and layers are the
    project's."""
    experiment = e2e.client.get_experiment_by_name("titan_kedro")
    runs_before = {r.info.run_id for r in e2e.client.search_runs([experiment.experiment_id])}
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kedro", "viz", "build", "--include-previews"],
        cwd=e2e.project, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Success" in proc.stdout + proc.stderr
    # Without hooks, no MLflow run is opened.
    runs_after = {r.info.run_id for r in e2e.client.search_runs([experiment.experiment_id])}
    assert runs_after == runs_before
    return e2e.project / "build"


def _viz_api(build: Path, name: str) -> dict:
    return json.loads((build / "api" / name).read_text(encoding="utf-8"))


@pytest.mark.slow
def test_kedro_viz_previews_the_plots_and_json_outputs(viz_build: Path) -> None:
    api = viz_build / "api"
    nodes = _viz_api(viz_build, "main")["nodes"]
    ids = {n["name"]: n["id"] for n in nodes if n["type"] == "data"}
    expected = {
        "loss_plot": "ImagePreview",
        "expert_load_plot": "ImagePreview",
        "model_spec": "JSONPreview",
        "evaluation_results": "JSONPreview",
        "reporting_summary": "JSONPreview",
        "hf_export_manifest": "JSONPreview",
    }
    for name, kind in expected.items():
        node = json.loads((api / "nodes" / ids[name]).read_text(encoding="utf-8"))
        assert node.get("preview_type") == kind and node.get("preview"), (name, node.keys())


@pytest.mark.slow
def test_kedro_viz_build_lists_every_pipeline(viz_build: Path) -> None:
    main = _viz_api(viz_build, "main")
    assert {p["id"] for p in main["pipelines"]} == VIZ_PIPELINES
    assert main["selected_pipeline"] == "__default__"
    assert {p.name for p in (viz_build / "api" / "pipelines").iterdir()} == VIZ_PIPELINES
    assert (viz_build / "index.html").is_file()


@pytest.mark.slow
def test_each_kedro_viz_pipeline_response_holds_its_nodes(viz_build: Path) -> None:
    expected = {
        "evaluation": {"load_final_model", "compute_validation_loss", "generate_samples"},
        "reporting": {
            "parse_training_metrics",
            "plot_loss_curves",
            "plot_expert_load",
            "summarize_report",
        },
        "export_hf": {"load_final_model", "export_final_model"},
        "training": {"train_model"},
    }
    for pipeline, names in expected.items():
        nodes = _viz_api(viz_build, f"pipelines/{pipeline}")["nodes"]
        assert names <= {n["name"] for n in nodes if n["type"] == "task"}, pipeline


@pytest.mark.slow
def test_every_dataset_has_a_kedro_viz_layer_and_layers_flow_forwards(viz_build: Path) -> None:
    main = _viz_api(viz_build, "main")
    missing = [n["name"] for n in main["nodes"] if n["type"] == "data" and not n.get("layer")]
    assert missing == [], f"catalog entries without a kedro-viz layer: {missing}"
    layers = main["layers"]  # empty when layers form a cycle
    assert layers == list(VIZ_LAYER_ORDER)
