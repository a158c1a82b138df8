"""The training pipeline: wiring, the node end to end through torchrun, and failures."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from train.helpers import REPO, tiny_job, write_token_dir

from titan_kedro.data.vocab import check_vocab_fits
from titan_kedro.launch.torchrun import TrainingFailedError, torchrun_command
from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.pipelines.training import create_pipeline
from titan_kedro.pipelines.training.nodes import train_model


def test_pipeline_runs_after_data_and_model_spec() -> None:
    (node,) = create_pipeline().nodes
    assert set(node.inputs) == {"token_metadata", "model_spec", *JOB_PARAMS.values()}
    assert node.outputs == ["training_summary"]


def test_torchrun_command_single_and_multi_node() -> None:
    from titan_kedro.config import build_job_config

    single = build_job_config({"launch": {"nproc_per_node": 2, "max_restarts": 1}}).launch
    cmd = torchrun_command(single, "job.yaml", python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert {"--standalone", "--nproc-per-node=2", "--nnodes=1", "--max-restarts=1"} <= set(cmd)
    assert cmd[-4:] == ["-m", "titan_kedro.train", "--config", "job.yaml"]
    multi = build_job_config(
        {"launch": {"nproc_per_node": 8, "nnodes": 2, "rdzv_endpoint": "h:29500"}}
    ).launch
    cmd = torchrun_command(multi, "job.yaml")
    assert "--standalone" not in cmd and "--nnodes=2" in cmd
    assert " --rdzv-backend c10d --rdzv-endpoint h:29500 --rdzv-id " in " ".join(cmd)
    assert "titan-kedro" not in cmd  # a random id per launch, not a guessable one
    assert not any("node-rank" in arg for arg in cmd)  # ranks come from the rendezvous
    no_endpoint = build_job_config({"launch": {"nnodes": 2}}).launch
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command(no_endpoint, "job.yaml")


def test_vocab_mismatch_fails_before_launch() -> None:
    check_vocab_fits({"vocab_size": 100}, 512)
    with pytest.raises(ValueError, match=r"model\.overrides\.vocab_size"):
        check_vocab_fits({"vocab_size": 102400}, 512)


def test_another_models_tokenizer_is_caught() -> None:
    """DeepSeek-V2's tokenizer fits a DeepSeek-V3 model's ids, but is not its tokenizer."""
    from titan_kedro.models import get_train_spec

    v2_vocab = 100_002  # the offline DeepSeek-V2 tokenizer (tests/data/test_tokenizer.py)
    v3_vocab = 128_815
    v2_model = get_train_spec("deepseek_v2").flavors["debugmodel"].vocab_size
    v3_model = get_train_spec("deepseek_v3").flavors["debugmodel"].vocab_size
    check_vocab_fits({"vocab_size": v2_vocab}, v2_model)
    check_vocab_fits({"vocab_size": v3_vocab}, v3_model)
    v2_tokens = {"vocab_size": v2_vocab, "tokenizer": {"name": "deepseek-ai/DeepSeek-V2-Lite"}}
    with pytest.raises(ValueError, match=r"DeepSeek-V2-Lite.*deepseek-ai/DeepSeek-V3"):
        check_vocab_fits(v2_tokens, v3_model)


@pytest.mark.slow
def test_failed_training_raises_with_the_worker_error(tmp_path: Path) -> None:
    params = tiny_job(tmp_path, tmp_path / "no_tokens_here", training={"steps": 2})
    with pytest.raises(TrainingFailedError) as err:
        train_model({}, {}, **params)
    message = str(err.value)
    assert "exited with code" in message
    assert "stderr.log" in message and "no token file" in message


def test_launch_timeout_stops_a_silent_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_kedro.config import build_job_config
    from titan_kedro.launch import torchrun as launch

    cfg = build_job_config({"launch": {"timeout_s": 1, "log_dir": str(tmp_path / "logs")}})
    # Stand in for torchrun with a process that hangs without printing.
    monkeypatch.setattr(
        launch,
        "torchrun_command",
        lambda *_a, **_k: [sys.executable, "-c", "import time; time.sleep(60)"],
    )
    start = time.monotonic()
    with pytest.raises(TrainingFailedError, match="timeout_s=1"):
        launch.launch_training(cfg, tmp_path / "job.yaml")
    assert time.monotonic() - start < 30


def test_continuing_with_other_maths_fails_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_kedro.pipelines.training import nodes
    from titan_kedro.runs.identity import ResumeMismatchError

    tokens = write_token_dir(tmp_path / "tokens")
    checkpoint = tmp_path / "ckpt" / "run-1" / "step-3"
    checkpoint.mkdir(parents=True)
    saved = {"training.seq_len": 64, "model.name": "tiny_dense", "data_fingerprint": "old"}
    (checkpoint / "metadata.json").write_text(json.dumps({"step": 3, "math": saved}))
    params = tiny_job(tmp_path, tokens, checkpoint={"resume": "run-1"})
    monkeypatch.setattr(nodes, "launch_job", lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(ResumeMismatchError) as err:
        train_model({"vocab_size": 512, "fingerprint": "new"}, {}, **params)
    assert "training.seq_len: checkpoint 64, now 32" in str(err.value)
    assert "data_fingerprint: checkpoint 'old', now 'new'" in str(err.value)
    assert "model.name" not in str(err.value)


def test_node_refuses_a_job_whose_plan_does_not_fit(tmp_path: Path) -> None:
    from titan_kedro.plan import PlanDoesNotFitError

    tokens = write_token_dir(tmp_path / "tokens")
    raw = tiny_job(tmp_path, tokens, plan={"device_memory_gib": 0.001, "reserved_gib": 0.0})
    with pytest.raises(PlanDoesNotFitError) as err:
        train_model({"vocab_size": 512}, {}, **raw)
    message = str(err.value)
    assert "DOES NOT FIT" in message and "would help: more ranks" in message
    assert not (tmp_path / "job").exists()  # nothing was launched


def test_runs_sharing_a_dump_folder_keep_their_own_config_and_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run B starts and finishes while run A trains, in the same ``job.dump_folder``."""
    from titan_kedro.config import build_job_config, read_config_file
    from titan_kedro.pipelines.training import nodes
    from titan_kedro.runs.folders import run_folder
    from titan_kedro.train.run_state import write_summary

    tokens = write_token_dir(tmp_path / "tokens")
    configs: list[Path] = []

    def workers(cfg: object, config_path: Path, env: object) -> None:
        """Stand in for the workers: read the config, start run B inside run A, summarize."""
        configs.append(Path(config_path))
        if len(configs) == 1:
            assert train_model({"vocab_size": 512}, {}, **run_b)["final_step"] == 5
        job = build_job_config(read_config_file(config_path))  # what a restarted worker reads
        summary = {"final_step": job.training.steps, "final_loss": 1.0, "tokens_seen": 1}
        write_summary(run_folder(job.job.dump_folder, job.job.run_id), summary | {"wall_time_s": 0})

    monkeypatch.setattr(nodes, "launch_job", workers)
    run_a = tiny_job(tmp_path, tokens, training={"steps": 3})
    run_b = tiny_job(tmp_path, tokens, training={"steps": 5})
    assert train_model({"vocab_size": 512}, {}, **run_a)["final_step"] == 3

    first, second = configs
    assert (
        first != second and first.parent.parent == second.parent.parent == tmp_path / "job" / "runs"
    )
    for config, steps in ((first, 3), (second, 5)):
        assert read_config_file(config)["training"]["steps"] == steps
        summary = json.loads((config.parent / "summary.json").read_text())
        assert summary["final_step"] == steps
    assert not (tmp_path / "job" / "summary.json").exists()


def test_the_catalog_hands_each_run_its_own_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``kedro run`` s of one project: B saves its summary between A's save and A's
    evaluation loading it; A still gets its own. A stage run alone reads the file."""
    import yaml
    from kedro.io import DataCatalog

    conf = yaml.safe_load((REPO / "conf" / "base" / "catalog_training.yml").read_text())
    monkeypatch.chdir(tmp_path)
    run_a, run_b, later = (DataCatalog.from_config(conf) for _ in range(3))
    run_a.save("training_summary", {"final_step": 3})
    run_b.save("training_summary", {"final_step": 5})
    assert run_a.load("training_summary") == {"final_step": 3}
    assert run_b.load("training_summary") == {"final_step": 5}
    assert later.load("training_summary") == {"final_step": 5}  # the file: the last saved
