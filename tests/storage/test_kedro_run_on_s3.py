"""``kedro run`` with every data path on the S3 test server: stopped at step 4, continued.

One project copy reads C4 shards from ``s3://<bucket>/c4/``, writes its tokens to
``s3://<bucket>/tokens/``, checkpoints to ``s3://<bucket>/checkpoints/`` and exports to
``s3://<bucket>/hf/``; the key comes from the environment, as the README says. The first run
stops at step 4, the second continues with ``checkpoint.resume=latest``; the losses equal
those of the same job trained uninterrupted on local disk (``rerun_here``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from test_end_to_end import copy_project, kedro_run
from train.helpers import TINY_DEEPSEEK, node_job_config, rerun_here

from tests.conftest import write_c4_shard
from tests.storage_fixtures import S3Bucket
from titan_kedro.models.export_folder import MARKER
from titan_kedro.storage.folders import CACHE_ENV

pytestmark = pytest.mark.slow

# The real tokenizer's 102,400-row tables stay, only 16 wide; the rest is TINY_DEEPSEEK's.
MODEL = {**{k: v for k, v in TINY_DEEPSEEK.items() if k != "vocab_size"}, "dim": 16}
PARAMS = {
    "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": MODEL},
    "training": {"steps": 6, "seq_len": 32, "local_batch_size": 2, "num_threads": 1},
    "parallelism": {"expert_parallel_degree": 1},
    "launch": {"nproc_per_node": 1},
    "checkpoint": {"interval": 3},
    "validation": {"freq": 0},
    "evaluation": {"batches": 1, "num_prompts": 1, "prompt_tokens": 4, "max_new_tokens": 2},
    "metrics": {"system_metrics_interval_s": 0},
}  # fmt: skip


def _s3_project(root: Path, uri: str) -> Path:
    """A project copy whose conf env ``test`` puts tokens, checkpoints and export on ``uri``."""
    project = copy_project(root)
    conf = project / "conf" / "test"
    params = yaml.safe_load((conf / "parameters.yml").read_text(encoding="utf-8"))
    for name, values in PARAMS.items():
        params[name] = {**params.get(name, {}), **values}
    params["data"]["token_dir"] = f"{uri}/tokens"
    params["checkpoint"]["folder"] = f"{uri}/checkpoints"
    params["export"] = {"folder": f"{uri}/hf"}
    (conf / "parameters.yml").write_text(yaml.safe_dump(params), encoding="utf-8")
    catalog = {  # the catalog's token folder is data.token_dir (README)
        "token_files": {
            "type": "titan_kedro.datasets.token_files_dataset.TokenFilesDataset",
            "path": f"{uri}/tokens",
        },
        "token_metadata": {"type": "json.JSONDataset", "filepath": f"{uri}/tokens/metadata.json"},
    }
    (conf / "catalog_s3.yml").write_text(yaml.safe_dump(catalog), encoding="utf-8")
    return project


def test_a_kedro_run_on_s3_stopped_at_step_4_continues_and_exports_like_local_disk(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fs, bucket, uri = s3_bucket.fs(), s3_bucket.name, s3_bucket.uri
    for i in range(2):
        shard = write_c4_shard(tmp_path / "c4" / f"c4-train.0000{i}-of-01024.json.gz", 40, seed=i)
        fs.put_file(str(shard), f"{bucket}/c4/{shard.name}")
    project = _s3_project(tmp_path / "project", uri)
    crash = {"TITAN_KEDRO_TEST_HOOKS": "1", "TITAN_KEDRO_CRASH_AT_STEP": "4"}
    # The catalog's c4_raw reads data.raw_dir from the command line (README).
    stopped = kedro_run(project, "--params", f"data.raw_dir={uri}/c4", extra_env=crash)
    first_output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0 and "exits at step 4" in first_output, first_output[-6000:]
    continued = kedro_run(
        project,
        "--pipelines", "training,evaluation,reporting,export_hf",
        "--params", f"data.raw_dir={uri}/c4,checkpoint.resume=latest",
    )  # fmt: skip
    output = continued.stdout + continued.stderr
    assert continued.returncode == 0, output[-6000:]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("titan_kedro").experiment_id])
    assert run.info.status == "FINISHED"  # continuing reopened the stopped run
    assert f"resumed from {uri}/checkpoints/{run.info.run_id}/step-3 at step 3" in output
    fs.invalidate_cache()
    assert fs.isfile(f"{bucket}/tokens/train.bin") and fs.isfile(f"{bucket}/tokens/metadata.json")
    assert fs.isfile(f"{bucket}/checkpoints/{run.info.run_id}/step-6/metadata.json")

    # Steps 1-3 logged before the stop, 4-6 after; the same job uninterrupted on local disk.
    fs.get(f"{bucket}/tokens/", str(tmp_path / "tokens"), recursive=True)
    job_config = node_job_config(project / "data/07_model_output/job", run.info.run_id)
    reference = rerun_here(
        job_config,
        tmp_path / "local",
        nproc=1,
        data={"token_dir": str(tmp_path / "tokens")},
        checkpoint={"interval": 100},
    )
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert len({round(v, 4) for v in reference.values()}) == 6  # the losses really change
    for step, value in losses.items():
        assert value == pytest.approx(reference[step], abs=1e-6), step

    marker = json.loads(fs.cat_file(f"{bucket}/hf/{MARKER}"))
    assert marker["complete"] and {"config.json", "model.safetensors"} <= set(marker["files"])
    assert set(fs.ls(f"{bucket}/hf", detail=False)) == {
        f"{bucket}/hf/{name}" for name in [*marker["files"], MARKER]
    }

    secret = s3_bucket.server.secret
    assert secret not in first_output + output
    written = [p for p in project.rglob("*") if p.is_file()]
    assert len(written) > 20 and not [p for p in written if secret.encode() in p.read_bytes()]
    fields = [*run.data.params.values(), *run.data.tags.values(), *run.data.params]
    assert not [f for f in fields if secret in f]
    objects = [k for k in fs.find(bucket) if secret.encode() in fs.cat_file(k)]
    assert not objects, objects
