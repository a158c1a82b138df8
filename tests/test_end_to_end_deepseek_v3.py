"""End to end for DeepSeek-V3: the whole default pipeline with MTP, on one process.

``kedro run --env test --params model.name=deepseek_v3,tokenizer.name_or_path=
deepseek-ai/DeepSeek-V3,model.mtp_depth=1`` (and a narrow model over the full V3
vocabulary, ``PARAMS``) in a temporary copy of the project (as ``test_end_to_end.py`` does
for the default model): tokenize with the V3 tokenizer, plan, train, evaluate, plot, export
(without MTP) and register.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_end_to_end import add_c4_sample, copy_project, kedro_run
from train.helpers import TINY_DEEPSEEK

# One process: the V3 layouts over 2 and 4 ranks (EP, FSDP, HSDP, MTP) are trained on a small
# vocabulary in tests/train/test_four_ranks.py; this run is about the tokenizer-to-export path,
# and 2 ranks would spend most of it all-gathering the 128,815-row tables.
# The tables keep the V3 tokenizer's 128,815 rows, 64 wide, and the blocks are TINY_DEEPSEEK's:
# the debugmodel's 256-wide tables made the run ~40 % longer (over the 90 s test budget on a
# loaded 2-core machine). At lr 0.02 such a model learns enough of the unigram table in 12
# steps for both losses to fall clearly (the checks below); at the default 3e-3 they barely move.
SMALL_V3 = ",".join(
    f"model.overrides.{key}={value}"
    for key, value in {**TINY_DEEPSEEK, "vocab_size": None}.items()
    if value is not None
)
PARAMS = (
    "model.name=deepseek_v3,tokenizer.name_or_path=deepseek-ai/DeepSeek-V3,model.mtp_depth=1,"
    f"launch.nproc_per_node=1,parallelism.expert_parallel_degree=1,optimizer.lr=0.02,{SMALL_V3}"
)


@pytest.mark.slow
def test_deepseek_v3_with_mtp_runs_the_default_pipeline(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    project = copy_project(tmp_path_factory.mktemp("e2e_v3") / "project")
    add_c4_sample(project)
    proc = kedro_run(project, "--params", PARAMS, extra_env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"kedro run failed:\n{(proc.stdout + proc.stderr)[-6000:]}"

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("titan_kedro").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "deepseek_v3"

    def history(key: str) -> list[float]:
        points = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(points, key=lambda m: m.step)]

    loss, mtp_loss = history("loss"), history("mtp_loss")
    assert len(loss) == len(mtp_loss) >= 10
    # Both fall: the mean of the last three steps is clearly below the first step's.
    assert sum(loss[-3:]) / 3 < loss[0] - 0.5, loss
    assert sum(mtp_loss[-3:]) / 3 < mtp_loss[0] - 0.5, mtp_loss
    assert history("eval_loss")

    data = project / "data"
    tokens = json.loads((data / "05_model_input/tokens/metadata.json").read_text())
    assert tokens["tokenizer"]["name"] == "deepseek-ai/DeepSeek-V3"
    assert tokens["vocab_size"] == 128_815
    card = json.loads((data / "06_models/model_spec.json").read_text())
    assert card["args"]["mtp_depth"] == 1
    manifest = json.loads((data / "08_reporting/hf_export.json").read_text())
    assert manifest["faithful"] is True, manifest  # the trained correction bias exports
    assert "multi-token-prediction" in manifest["not_exported"]
    assert manifest["registered_model"]["version"]
    hf_config = json.loads((data / "06_models/hf/config.json").read_text())
    assert hf_config["model_type"] == "deepseek_v3"
    assert not any("eh_proj" in key for key in _hf_keys(data / "06_models/hf"))


def _hf_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            keys += list(handle.keys())
    return keys
