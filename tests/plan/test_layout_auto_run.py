"""``kedro run --params parallelism.layout=auto``: the search picks a layout of the launch's
2 ranks, the workers train with it and the model card holds the ranked table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from small_project import small_vocab_project

ENV = "layoutauto"


def test_layout_auto_picks_a_fitting_layout_trains_with_it_and_the_card_shows_the_table(
    tmp_path: Path,
) -> None:
    project = small_vocab_project(
        tmp_path,
        ENV,
        training={"steps": 2},
        lr_scheduler={"warmup_steps": 1},
        launch={"nproc_per_node": 2},
        checkpoint={"enable": False},
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEDRO_DISABLE_TELEMETRY": "true"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{project / 'mlflow.db'}"
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, "-m", "kedro", "run", "--env", ENV, "--pipelines"]
    cmd += ["model_spec,training", "--params", "parallelism.layout=auto"]
    proc = subprocess.run(
        cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]

    card = json.loads((project / "data" / "06_models" / "model_spec.json").read_text())
    search = card["layout_search"]
    assert search["world_size"] == 2 and search["measured"] >= 2
    chosen = [row for row in search["rows"] if row.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["rank"] == 1 and chosen[0]["fits"]
    degrees = chosen[0]["degrees"]
    assert degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] == 2
    # The card's plan is the chosen layout's, and so is what the workers were given.
    assert card["plan"]["layout"]["ep"] == degrees["ep"]
    assert card["plan"]["layout"]["dp_shard"] == degrees["dp_shard"]
    config = next((project / "data").rglob("job_config.yaml"))
    parallelism = yaml.safe_load(config.read_text())["parallelism"]
    assert parallelism["expert_parallel_degree"] == degrees["ep"]
    assert parallelism["data_parallel_shard_degree"] == degrees["dp_shard"]
    assert parallelism["layout"] == "auto"
    summary = json.loads(next((project / "data").rglob("summary.json")).read_text())
    assert summary["final_step"] == 2
