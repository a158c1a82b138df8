"""``kedro run`` with every data path on the S3 test server.

One project copy reads C4 shards from ``s3://<bucket>/c4/``, writes its tokens to
``s3://<bucket>/tokens/``, checkpoints to ``s3://<bucket>/checkpoints/`` and exports to
``s3://<bucket>/hf/``; the key comes from the environment, as the README says. It runs
on 2 ranks with ``parallelism.layout=auto``: the plan's search picks the layout, the
workers train with it and the model card holds the ranked table. Its losses equal those
of the same job trained on local disk (``rerun_here``). A run stopped and
continued from checkpoints on S3 through ``kedro run`` is ``test_end_to_end.py``'s
interrupted and continued pair, whose checkpoints are on this server.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow.entities import Run
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
    "parallelism": {"layout": "auto"},
    "launch": {"nproc_per_node": 2},
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


@dataclass
class S3Run:
    """The project on the bucket and its run."""

    bucket: S3Bucket
    project: Path
    root: Path
    proc: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def s3_run(s3_module_bucket: S3Bucket, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Run]:
    """The full pipeline on the bucket (C4 to tokens, 6 steps, checkpoints, export) on 2
    ranks in the layout the plan's search picks."""
    root = tmp_path_factory.mktemp("s3_run")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CACHE_ENV, str(root / "cache"))
        fs, bucket, uri = s3_module_bucket.fs(), s3_module_bucket.name, s3_module_bucket.uri
        for i in range(2):
            shard = write_c4_shard(root / "c4" / f"c4-train.0000{i}-of-01024.json.gz", 40, seed=i)
            fs.put_file(str(shard), f"{bucket}/c4/{shard.name}")
        project = _s3_project(root / "project", uri)
        # The catalog's c4_raw reads data.raw_dir from the command line (README).
        proc = kedro_run(project, "--params", f"data.raw_dir={uri}/c4")
        yield S3Run(s3_module_bucket, project, root, proc)


def _the_run(s3: S3Run) -> Run:
    client = MlflowClient(f"sqlite:///{s3.project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("titan_kedro").experiment_id])
    return run


def test_the_run_reads_c4_from_s3_and_writes_tokens_and_checkpoints_there(s3_run: S3Run) -> None:
    output = s3_run.proc.stdout + s3_run.proc.stderr
    assert s3_run.proc.returncode == 0, output[-6000:]
    fs, bucket = s3_run.bucket.fs(), s3_run.bucket.name
    assert fs.isfile(f"{bucket}/tokens/train.bin") and fs.isfile(f"{bucket}/tokens/metadata.json")
    run = _the_run(s3_run)
    assert run.info.status == "FINISHED"
    saved = fs.ls(f"{bucket}/checkpoints/{run.info.run_id}", detail=False)
    assert sorted(path.rsplit("/", 1)[1] for path in saved) == ["step-3", "step-6"]
    assert fs.isfile(f"{bucket}/checkpoints/{run.info.run_id}/step-6/metadata.json")


def test_the_run_trains_like_the_same_job_on_local_disk(s3_run: S3Run) -> None:
    assert s3_run.proc.returncode == 0, (s3_run.proc.stdout + s3_run.proc.stderr)[-6000:]
    fs, bucket = s3_run.bucket.fs(), s3_run.bucket.name
    run = _the_run(s3_run)
    tokens = s3_run.root / "tokens"
    fs.get(f"{bucket}/tokens/", str(tokens), recursive=True)
    job_config = node_job_config(s3_run.project / "data/07_model_output/job", run.info.run_id)
    reference = rerun_here(
        job_config,
        s3_run.root / "local",
        nproc=2,  # in the layout the search picked (the node's job config holds it)
        data={"token_dir": str(tokens)},
        checkpoint={"interval": 100},
    )
    client = MlflowClient(f"sqlite:///{s3_run.project / 'mlflow.db'}")
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert len({round(v, 4) for v in reference.values()}) == 6  # the losses really change
    for step, value in losses.items():
        assert value == pytest.approx(reference[step], abs=1e-6), step


def test_layout_auto_picks_a_fitting_layout_trains_with_it_and_the_card_shows_the_table(
    s3_run: S3Run,
) -> None:
    assert s3_run.proc.returncode == 0, (s3_run.proc.stdout + s3_run.proc.stderr)[-6000:]
    data = s3_run.project / "data"
    card = json.loads((data / "06_models" / "model_spec.json").read_text())
    search = card["layout_search"]
    assert search["world_size"] == 2 and search["measured"] >= 2
    chosen = [row for row in search["rows"] if row.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["rank"] == 1 and chosen[0]["fits"]
    degrees = chosen[0]["degrees"]
    assert degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] == 2
    # The card's plan is the chosen layout's, and so is what the workers were given.
    assert card["plan"]["layout"]["ep"] == degrees["ep"]
    assert card["plan"]["layout"]["dp_shard"] == degrees["dp_shard"]
    run_id = _the_run(s3_run).info.run_id
    config = yaml.safe_load(node_job_config(data / "07_model_output/job", run_id).read_text())
    parallelism = config["parallelism"]
    assert parallelism["expert_parallel_degree"] == degrees["ep"]
    assert parallelism["data_parallel_shard_degree"] == degrees["dp_shard"]
    assert parallelism["layout"] == "auto"
    assert config["launch"]["nproc_per_node"] == 2


def test_the_export_lands_whole_on_s3_and_no_file_or_object_holds_the_key(s3_run: S3Run) -> None:
    assert s3_run.proc.returncode == 0, (s3_run.proc.stdout + s3_run.proc.stderr)[-6000:]
    fs, bucket = s3_run.bucket.fs(), s3_run.bucket.name
    marker = json.loads(fs.cat_file(f"{bucket}/hf/{MARKER}"))
    assert marker["complete"] and {"config.json", "model.safetensors"} <= set(marker["files"])
    assert set(fs.ls(f"{bucket}/hf", detail=False)) == {
        f"{bucket}/hf/{name}" for name in [*marker["files"], MARKER]
    }

    secret = s3_run.bucket.server.secret
    assert secret not in s3_run.proc.stdout + s3_run.proc.stderr
    written = [p for p in s3_run.project.rglob("*") if p.is_file()]
    assert len(written) > 20 and not [p for p in written if secret.encode() in p.read_bytes()]
    run = _the_run(s3_run)
    fields = [*run.data.params.values(), *run.data.tags.values(), *run.data.params]
    assert not [f for f in fields if secret in f]
    objects = [k for k in fs.find(bucket) if secret.encode() in fs.cat_file(k)]
    assert not objects, objects
