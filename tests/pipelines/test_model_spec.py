"""The model_spec pipeline: model cards for built-in and custom models, and early failures."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import project_parameters
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from titan_kedro.config import ConfigError, JobConfig
from titan_kedro.models import get_train_spec, list_train_specs
from titan_kedro.models import registry as registry_module
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.pipelines.model_spec import create_pipeline
from titan_kedro.pipelines.model_spec.nodes import build_model_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_model" / "tiny_gpt.py"


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Forget the example's registration after each test, so every test imports it afresh."""
    list_train_specs()
    before = dict(registry_module._REGISTRY)
    modules = set(sys.modules)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(before)
    for name in set(sys.modules) - modules:
        if name.startswith("titan_kedro_custom_"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def test_params() -> dict[str, Any]:
    """The project's parameters as ``kedro run --env test`` sees them."""
    return project_parameters("test")


def with_model(params: dict[str, Any], **model: Any) -> dict[str, Any]:
    """``params`` with ``model`` set over its model section; another model starts from its
    flavor's values, not from conf/test's overrides of the debugmodel."""
    params = copy.deepcopy(params)
    params["model"].update({"overrides": {}, **model})
    return params


# What the data pipeline writes for the DeepSeek-V2 tokenizer (only the field checked here).
TOKEN_METADATA = {"vocab_size": 100_002}


def add_params(catalog: DataCatalog, params: dict[str, Any]) -> None:
    """Each section as its ``params:<section>`` dataset, as a Kedro session provides them."""
    for name, value in params.items():
        catalog[f"params:{name}"] = MemoryDataset(value)


def run_pipeline(params: dict[str, Any], catalog_entry: dict[str, Any] | None = None) -> Any:
    catalog = DataCatalog.from_config({"model_spec": catalog_entry} if catalog_entry else {})
    if catalog_entry is None:
        catalog["model_spec"] = MemoryDataset()
    add_params(catalog, params)
    catalog["token_metadata"] = MemoryDataset(TOKEN_METADATA)
    SequentialRunner().run(create_pipeline(), catalog)
    return catalog["model_spec"].load()


def test_the_node_takes_every_job_config_section_and_no_parameters_input(
    test_params: dict[str, Any],
) -> None:
    (node,) = create_pipeline().nodes
    assert "parameters" not in node.inputs  # kedro-mlflow would log it as parameters.*
    assert set(node.inputs) == {"token_metadata", *JOB_PARAMS.values()}
    assert set(JOB_PARAMS) == set(JobConfig.model_fields)
    # Every section is a parameter of the project, or its params: input would be missing.
    assert set(JOB_PARAMS) <= set(test_params)


def test_llama3_card_through_the_pipeline(test_params: dict[str, Any]) -> None:
    params = with_model(test_params, name="llama3", flavor="debugmodel", overrides={"n_layers": 2})
    card = run_pipeline(params)
    spec = get_train_spec("llama3")
    args = spec.resolve_args("debugmodel", {"n_layers": 2})
    seq_len = test_params["training"]["seq_len"]
    assert (card["spec"], card["flavor"], card["overrides"]) == (
        "llama3",
        "debugmodel",
        {"n_layers": 2},
    )
    assert card["args"]["n_layers"] == 2 and card["args"]["vocab_size"] == 102400
    # 2 × 102400 × 256 embeddings/output + 2 blocks of 786,944 + final norm 256.
    assert card["parameters"]["total"] == 2 * 102400 * 256 + 2 * 786_944 + 256
    assert card["parameters"]["active"] == card["parameters"]["total"]
    assert card["parameters"]["embedding"] == 102400 * 256
    assert card["seq_len"] == seq_len
    assert card["flops_per_token"] == spec.flops_per_token(args, seq_len)
    plan = card["plan"]
    assert plan["world_size"] == test_params["launch"]["nproc_per_node"]
    assert plan["bytes_per_rank"]["params"] > 0 and plan["fits"]
    assert plan["cost"]["device_hours"] > 0
    assert json.loads(json.dumps(card)) == card


def test_catalog_entry_writes_data_06_models_model_spec_json(
    test_params: dict[str, Any], tmp_path: Path
) -> None:
    entry = yaml.safe_load((REPO / "conf" / "base" / "catalog_model_spec.yml").read_text())[
        "model_spec"
    ]
    assert entry["type"] == "json.JSONDataset"
    assert entry["filepath"] == "data/06_models/model_spec.json"
    assert entry["metadata"]["kedro-viz"]["layer"] == "models"
    entry["filepath"] = str(tmp_path / "model_spec.json")
    card = run_pipeline(with_model(test_params, name="llama3"), entry)
    assert json.loads((tmp_path / "model_spec.json").read_text()) == card
    assert card["spec"] == "llama3"


def test_custom_example_end_to_end(test_params: dict[str, Any]) -> None:
    params = with_model(
        test_params, name="tiny_gpt", flavor="small", custom_model_path=str(EXAMPLE)
    )
    smoothed = copy.deepcopy(params)
    smoothed["training"]["label_smoothing"] = 0.1
    card = run_pipeline(smoothed)
    assert card["spec"] == "tiny_gpt" and card["flavor"] == "small"
    assert card["custom_model"] == str(EXAMPLE)
    assert card["args"]["dim"] == 128 and card["args"]["n_layers"] == 4
    # The extension's field reaches the node inside params:training.
    assert card["extensions"] == {"training": {"label_smoothing": 0.1}}
    # Per block: two LayerNorms, qkv and proj (with biases), MLP 128→512→128 (with biases).
    block = (
        2 * 2 * 128 + (128 * 384 + 384) + (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128)
    )
    tokens_and_positions = 102400 * 128 + 512 * 128
    expected = tokens_and_positions + 4 * block + 2 * 128 + 128 * 102400
    assert card["parameters"]["total"] == expected == 27_073_280
    assert card["parameters"]["embedding"] == 102400 * 128

    # The example trains: a forward, its loss with the extension's label smoothing, a backward.
    resolved = resolve_job_config(smoothed)
    spec = resolved.spec
    torch.manual_seed(0)
    model = spec.build_model(spec.flavors["tiny"])
    tokens = torch.randint(0, 102400, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 102400) and logits.dtype == torch.float32
    loss = spec.build_loss_fn(resolved.config)(logits, tokens)
    plain = spec.build_loss_fn(resolve_job_config(params).config)(logits, tokens)
    assert loss.item() != pytest.approx(plain.item())
    loss.backward()
    assert model.layers["0"].attention["qkv"].weight.grad is not None


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"name": "llama4"}, r"unknown model 'llama4'; registered train specs: .*llama3"),
        (
            {"name": "llama3", "flavor": "70B"},
            r"model 'llama3' has no flavor '70B'; flavors: \['8B', 'debugmodel'\]",
        ),
        (
            {"name": "llama3", "overrides": {"n_layer": 2}},
            r"'n_layer' \(did you mean 'n_layers'\?\)",
        ),
        (
            {"name": "llama3", "overrides": {"n_heads": 7}},
            r"model.overrides for 'llama3' are invalid: dim=256 is not divisible by n_heads=7",
        ),
        (
            {"name": "tiny_gpt", "custom_model_path": "examples/custom_model/nope.py"},
            r"custom_model_path 'examples/custom_model/nope.py' does not exist",
        ),
    ],
    ids=[
        "unknown-spec",
        "unknown-flavor",
        "unknown-override",
        "invalid-override",
        "missing-custom",
    ],
)
def test_bad_model_config_fails_in_the_node_with_a_clear_message(
    test_params: dict[str, Any], model: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model_spec(**with_model(test_params, **model))


def test_bad_model_config_stops_the_pipeline_before_writing(test_params: dict[str, Any]) -> None:
    catalog = DataCatalog({"token_metadata": MemoryDataset(TOKEN_METADATA)})
    add_params(catalog, with_model(test_params, name="llama3", flavor="70B"))
    catalog["model_spec"] = MemoryDataset()
    with pytest.raises(ConfigError, match="no flavor '70B'"):
        SequentialRunner().run(create_pipeline(), catalog)
    with pytest.raises(Exception, match="has not been saved yet"):
        catalog["model_spec"].load()


def test_token_files_beyond_the_model_vocabulary_fail(test_params: dict[str, Any]) -> None:
    params = with_model(test_params, name="llama3", overrides={"vocab_size": 1000})
    with pytest.raises(ValueError, match="vocab_size 100002 but the model's vocab_size is 1000"):
        build_model_spec(TOKEN_METADATA, **params)


def test_seq_len_beyond_the_model_limit_fails(test_params: dict[str, Any]) -> None:
    params = with_model(test_params, name="llama3", overrides={"max_seq_len": 32})
    with pytest.raises(
        ConfigError, match=r"training\.seq_len=64 exceeds the model's max_seq_len=32"
    ):
        build_model_spec(**params)
