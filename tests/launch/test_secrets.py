"""Credentials leave the tracking URI and are masked in every form; worker paths a remote
node can use are made absolute and checked under ``launch.shared_dir``."""

from __future__ import annotations

import io
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from mlflow_store import mlflow_server
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
    env, moved = node_env({"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": RUN_ID})
    assert env == {"MLFLOW_TRACKING_URI": clean, "MLFLOW_RUN_ID": RUN_ID} and moved == credentials


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


@pytest.mark.parametrize(
    "key", ["client_secret", "x-api-key", "X-Amz-Signature", "private_token", "AccessKey", "sig"]
)
def test_every_credential_like_query_key_is_masked_and_moved(key: str) -> None:
    uri = f"https://mlflow.example/?{key}={quote(SECRET, safe='')}&experiment=3"
    assert "s3cr" not in redact(uri) and "experiment=3" in redact(uri)
    split = split_tracking_uri(uri, {})
    assert split.uri == "https://mlflow.example/?experiment=3"
    assert split.credentials == {"MLFLOW_TRACKING_TOKEN": SECRET}
    encoded = quote(uri, safe="")  # a URL inside a query, or a request file's encoding
    assert "s3cr" not in redact(encoded), redact(encoded)


def test_a_password_holding_at_signs_is_masked_whole_and_decoded_for_the_login() -> None:
    for uri in ("http://alice:p@ss@vm:5000/", "http://alice:p%40ss@vm:5000/"):
        masked = redact(f"API request to {uri}api/2.0/mlflow/runs/log-batch failed")
        assert masked.startswith("API request to http://alice:***@vm:5000/api"), masked
        split = split_tracking_uri(uri, {})
        assert split.uri == "http://vm:5000/"
        assert split.credentials["MLFLOW_TRACKING_PASSWORD"] == "p@ss"  # what MLflow sends
    # A known secret is masked as written and percent-encoded.
    assert redact("p@ss and p%40ss", ["p@ss"]) == "*** and ***"
    assert redact("p@ss and p%40ss", ["p%40ss"]) == "*** and ***"


def test_kubernetes_env_entries_with_secret_names_are_masked() -> None:
    yaml_text = "env:\n- name: WANDB_API_KEY\n  value: k3yvalue\n- name: MAX_STEPS\n  value: '4'"
    masked = redact(yaml_text)
    assert "k3yvalue" not in masked and "value: '4'" in masked
    assert "k3yvalue" not in redact(str({"name": "HF_TOKEN", "value": "k3yvalue"}))


def test_the_log_filter_masks_what_the_process_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from titan_kedro.tracking.credentials import SecretFilter, adopt_tracking_credentials

    environ = {"MLFLOW_TRACKING_URI": "http://alice:p%40ss@127.0.0.1:9/"}
    adopt_tracking_credentials(environ)
    assert environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:9/"
    assert environ["MLFLOW_TRACKING_PASSWORD"] == "p@ss"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "p@ss")
    try:
        raise ConnectionError("API request to http://127.0.0.1:9/ failed, auth p@ss")
    except ConnectionError as err:
        record = logging.LogRecord(
            "mlflow", logging.WARNING, __file__, 1, "failed: %s (%s)", (err, "p%40ss"),
            sys.exc_info(),
        )  # fmt: skip
    SecretFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "p@ss" not in text and "p%40ss" not in text and "***" in text


RUN_ID = "0123456789abcdef0123456789abcdef"
PROBE_MODEL = """
import json, os, sys
from pathlib import Path

if "RANK" in os.environ:  # a worker: what its environment holds
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    Path({probe!r}).write_text(json.dumps({{k: os.environ.get(k) for k in names}}))
sys.path.insert(0, {tiny_dir!r})
import tiny_model  # registers tiny_dense
"""


def test_a_tracking_server_that_stops_mid_run_leaks_no_credential_to_any_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks log into a real MLflow server that is killed after their first step.

    The workers get the URI without credentials (MLflow's variables instead), so MLflow's
    failure messages, torchrun's log files, the worker output and the server's store hold
    neither the password nor the token, in any form."""
    import yaml
    from mlflow.tracking import MlflowClient
    from train.helpers import TINY_MODEL, tiny_job, write_token_dir

    from titan_kedro.launch import launch_job

    password, token = "p@ss:w0rd", "t0k3n-e2e-4b1d"
    with mlflow_server(tmp_path / "mlflow") as server:  # starts while the test sets up
        probe = tmp_path / "probe" / "probe.json"  # the test's own record of a worker's env
        probe.parent.mkdir()
        model_file = tmp_path / "probe_model.py"
        model_file.write_text(PROBE_MODEL.format(probe=str(probe), tiny_dir=str(TINY_MODEL.parent)))
        tokens = write_token_dir(tmp_path / "tokens", n_train=8000)
        steps = 20
        job = tiny_job(
            tmp_path, tokens, training={"steps": steps}, launch={"nproc_per_node": 2},
            model={"name": "tiny_dense", "flavor": "debugmodel", "custom_model_path": str(model_file)},
            metrics={"enable_mlflow": True, "system_metrics_interval_s": 0},
            checkpoint={"enable": False},
        )  # fmt: skip
        config = tmp_path / "job_config.yaml"
        config.write_text(yaml.safe_dump(job), encoding="utf-8")
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = MlflowClient(f"http://127.0.0.1:{port}")
        run_id = client.create_run("0").info.run_id
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast once it stops
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
        uri = f"http://alice:{quote(password, safe='')}@127.0.0.1:{port}/?token={token}"
        env = {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": uri}  # what the node passes
        logged: list[int] = []

        def stop_after_first_step() -> None:
            while not logged and server.poll() is None:
                logged.extend(m.step for m in client.get_metric_history(run_id, "loss"))
                time.sleep(0.05)
            server.kill()

        watcher = threading.Thread(target=stop_after_first_step, daemon=True)
        watcher.start()
        launch_job(build_job_config(job), config, env, console=io.StringIO())
        watcher.join(timeout=30)
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["final_step"] == steps
    assert logged and max(logged) < steps  # the server stopped while the run went on
    seen = json.loads(probe.read_text())
    assert seen == {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}/",
        "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": password,  # decoded: what MLflow logs in with
    }
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != probe.parent]
    texts = {p: p.read_bytes().decode(errors="replace") for p in files}
    assert any(f"MLflow logging into run {run_id} failed" in t for t in texts.values()), (
        texts.keys()
    )
    assert any(p.name == "mlflow.db" for p in texts) and any(p.suffix == ".log" for p in texts)
    for path, text in texts.items():
        for form in (password, quote(password, safe=""), "w0rd", token, "token="):
            assert form not in text, f"{form!r} in {path}"


@pytest.mark.parametrize("scheduler", ["slurm", "kubernetes"])
def test_a_dry_run_shows_no_credential_like_query_value(
    scheduler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_torchx_launch import CLUSTER, SCHEDULER_ARGS

    from titan_kedro.pipelines.training import nodes

    secrets = ["p@ss", "cs3cret", "ak3y", "s1gnature", "pr1vate"]
    uri = (
        "https://alice:p@ss@mlflow.example:5000/?client_secret=cs3cret&x-api-key=ak3y"
        "&X-Amz-Signature=s1gnature&private_token=pr1vate&experiment=3"
    )
    monkeypatch.setattr(nodes, "mlflow_env", lambda: {**RUN_ENV, "MLFLOW_TRACKING_URI": uri})
    job = shared_job(
        tmp_path, scheduler=scheduler, scheduler_args=SCHEDULER_ARGS[scheduler], dryrun=True,
        dryrun_dir=str(tmp_path / "launch"), **CLUSTER,
    )  # fmt: skip
    summary = nodes.train_model({"vocab_size": 102400}, {}, **job)
    for name in ("request_file", "appdef_file"):
        text = Path(summary[name]).read_text()
        assert "experiment=3" in text and "mlflow.example:5000" in text
        for secret in secrets:
            assert secret not in text and quote(secret, safe="") not in text, (name, secret)
