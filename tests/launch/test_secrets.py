"""Credentials leave the tracking URI and are masked in every form; worker paths a remote
node can use are made absolute and checked under ``launch.shared_dir``."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from urllib.parse import quote

import pytest
from test_torchx_launch import RUN_ENV, shared_job

from titan_kedro.config import build_job_config
from titan_kedro.launch import LaunchCheckError, prepare_job
from titan_kedro.launch.secrets import exported, node_env, redact, split_tracking_uri


@pytest.fixture(autouse=True)
def _no_credentials_here(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("uri", "clean", "credentials"),
    [
        (
            "http://alice:s3cret@vm:5000/",
            "http://vm:5000/",
            {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "s3cret"},
        ),
        (
            "https://tok3n@mlflow.example",
            "https://mlflow.example",
            {"MLFLOW_TRACKING_TOKEN": "tok3n"},
        ),
        (
            "https://mlflow.example/?token=t0k&x=1",
            "https://mlflow.example/?x=1",
            {"MLFLOW_TRACKING_TOKEN": "t0k"},
        ),
        ("http://vm:5000", "http://vm:5000", {}),
    ],
)
def test_the_uri_goes_to_the_nodes_without_credentials(
    uri: str, clean: str, credentials: dict[str, str]
) -> None:
    split = split_tracking_uri(uri)
    assert (split.uri, split.credentials) == (clean, credentials)
    env, moved = node_env({"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": "r1"})
    assert env == {"MLFLOW_TRACKING_URI": clean, "MLFLOW_RUN_ID": "r1"} and moved == credentials


SECRET = "s3cr+et!x"  # characters that percent-encoding changes


@pytest.mark.parametrize(
    "text",
    [
        f"MLFLOW_TRACKING_URI=https://alice:{SECRET}@host:5000",
        f"--export=ALL,MLFLOW_TRACKING_URI='https://alice:{SECRET}@host'",
        json.dumps({"uri": f"https://alice:{SECRET}@host"}),
        json.dumps({"uri": f"https://alice:{SECRET}@host"}).replace("/", "\\/"),
        quote(f"https://alice:{SECRET}@host", safe=""),
        shlex.quote(f"https://{SECRET}@host"),
        f"https://host/api?x=1&token={SECRET}",
        json.dumps({"MLFLOW_TRACKING_PASSWORD": SECRET}),
        f"export MLFLOW_TRACKING_TOKEN={SECRET}",
    ],
)
def test_redact_masks_every_form(text: str) -> None:
    out = redact(text, [SECRET])
    for form in (SECRET, "s3cr", json.dumps(SECRET)[1:-1], quote(SECRET, safe="")):
        assert form not in out, out
    assert "***" in out
    # Without being told the value, the patterns alone still mask it.
    assert "s3cr" not in redact(text), redact(text)


def test_redact_keeps_what_is_not_secret() -> None:
    text = "user alice on http://vm:5000/?experiment=3, MAX_STEPS=4"
    assert redact(text) == text
    assert redact("https://alice:pw@host") == "https://alice:***@host"


def test_exported_restores_the_environment() -> None:
    os.environ["MLFLOW_TRACKING_USERNAME"] = "before"
    with exported({"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pw"}):
        assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "before"
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_paths_a_node_reads_are_absolute_and_checked_under_the_shared_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    (shared / "hf").mkdir(parents=True)
    (shared / "tok").mkdir()
    step = shared / "ckpt" / "run1" / "step-2"
    step.mkdir(parents=True)
    monkeypatch.chdir(shared)
    job = shared_job(shared, scheduler="slurm")
    job["checkpoint"] = {
        **job["checkpoint"],
        "resume": "ckpt/run1/step-2",
        "initial_load_hf": "hf",
    }
    job["tokenizer"] = {"name_or_path": "tok"}
    cfg = prepare_job(build_job_config(job), RUN_ENV)
    assert cfg.checkpoint.resume == str(step)
    assert cfg.checkpoint.initial_load_hf == str(shared / "hf")
    assert cfg.tokenizer.name_or_path == str(shared / "tok")
    # A run id and a hub id are no paths: left as they are.
    job["checkpoint"]["resume"] = "0123456789abcdef"
    job["tokenizer"] = {"name_or_path": "deepseek-ai/DeepSeek-V2-Lite"}
    cfg = prepare_job(build_job_config(job), RUN_ENV)
    assert cfg.checkpoint.resume == "0123456789abcdef"
    assert cfg.tokenizer.name_or_path == "deepseek-ai/DeepSeek-V2-Lite"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for setting, value in (
        ("checkpoint.resume", str(outside)),
        ("checkpoint.initial_load_hf", "../elsewhere"),
        ("tokenizer.name_or_path", str(outside)),
    ):
        section, key = setting.split(".")
        bad = {**job, section: {**job.get(section, {}), key: value}}
        with pytest.raises(LaunchCheckError) as err:
            prepare_job(build_job_config(bad), RUN_ENV)
        assert f"{setting}={value!r}" in str(err.value) and "launch.shared_dir" in str(err.value)


@pytest.mark.parametrize(
    "uri", ["sqlite:////tmp/runs/mlflow.db", "sqlite:///mlflow.db", "file:///tmp/mlruns"]
)
def test_a_uri_without_credentials_reaches_the_nodes_as_written(uri: str) -> None:
    # urlsplit + geturl drops a slash from sqlite:////abs (the workers then failed to log).
    assert split_tracking_uri(uri, {}).uri == uri
