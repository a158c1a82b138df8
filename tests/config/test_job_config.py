"""The typed job config: unknown keys, wrong types, layouts, extensions, file + CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict

from titan_kedro.config import (
    ConfigError,
    JobConfig,
    build_job_config,
    dump_job_config,
    flatten,
    load_raw_config,
    merge_extensions,
    parse_cli_overrides,
)


class RouterExt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    router_degree: int = 2
    router_kind: str = "greedy"


EXT = [{"parallelism": RouterExt}]


def test_defaults_validate_and_run_on_a_laptop() -> None:
    cfg = build_job_config({})
    assert cfg.training.device == "auto"
    assert cfg.launch.world_size == 1
    assert cfg.layout.grad_accum_steps == 1


def test_unknown_key_names_full_path_and_closest_key() -> None:
    with pytest.raises(ConfigError) as err:
        build_job_config({"training": {"stepz": 3}})
    msg = str(err.value)
    assert "training.stepz" in msg
    assert "training.steps" in msg


def test_unknown_section_is_rejected_with_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"trainin.*did you mean 'training'"):
        build_job_config({"trainin": {"steps": 3}})


def test_wrong_type_names_path_value_and_expectation() -> None:
    with pytest.raises(ConfigError) as err:
        build_job_config({"optimizer": {"lr": "fast"}})
    msg = str(err.value)
    assert "optimizer.lr" in msg
    assert "'fast'" in msg
    assert "valid number" in msg


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (
            {"launch": {"nproc_per_node": 2}, "parallelism": {"data_parallel_shard_degree": 3}},
            "world size is 2",
        ),
        (
            {"launch": {"nproc_per_node": 4}, "parallelism": {"data_parallel_replicate_degree": 3}},
            "does not divide",
        ),
        ({"training": {"local_batch_size": 4, "global_batch_size": 6}}, "multiple of"),
        ({"model": {"custom_model_path": "a.py", "custom_import": "b"}}, "only one of"),
    ],
)
def test_impossible_layouts_fail_before_anything_runs(raw: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_job_config(raw)


def test_grad_accumulation_follows_global_batch() -> None:
    cfg = build_job_config(
        {
            "launch": {"nproc_per_node": 2},
            "training": {"local_batch_size": 2, "global_batch_size": 8},
        }
    )
    assert (cfg.layout.grad_accum_steps, cfg.layout.global_batch_size) == (2, 8)


# The four extension-merge cases.
def test_extension_keeps_its_own_default_when_unset() -> None:
    cfg = build_job_config({}, EXT)
    assert cfg.parallelism.router_degree == 2  # not 0, not missing
    assert cfg.parallelism.router_kind == "greedy"


def test_extension_value_from_params_wins() -> None:
    cfg = build_job_config({"parallelism": {"router_degree": 4}}, EXT)
    assert cfg.parallelism.router_degree == 4


def test_base_fields_keep_their_defaults_under_extension() -> None:
    cfg = build_job_config({"parallelism": {"router_degree": 4}}, EXT)
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.parallelism.data_parallel_replicate_degree == 1
    assert cfg.training.steps == JobConfig().training.steps


def test_unknown_keys_still_rejected_under_extension() -> None:
    with pytest.raises(ConfigError, match=r"parallelism\.router_degre.*router_degree"):
        build_job_config({"parallelism": {"router_degre": 4}}, EXT)


def test_extension_field_is_type_checked() -> None:
    with pytest.raises(ConfigError, match=r"parallelism\.router_degree"):
        build_job_config({"parallelism": {"router_degree": "two"}}, EXT)


def test_extension_may_not_redefine_or_target_unknown_sections() -> None:
    class Clash(BaseModel):
        data_parallel_shard_degree: int = 5

    with pytest.raises(ValueError, match="redefines"):
        merge_extensions({"parallelism": Clash})
    with pytest.raises(ValueError, match="unknown section"):
        merge_extensions({"nonsense": RouterExt})


def test_without_extension_the_extension_key_is_unknown() -> None:
    with pytest.raises(ConfigError, match="router_degree"):
        build_job_config({"parallelism": {"router_degree": 2}})


# File + command line.
def test_cli_overrides_parse_types_and_both_spellings() -> None:
    raw = parse_cli_overrides(
        [
            "--training.steps",
            "20",
            "--optimizer.betas=[0.8, 0.9]",
            "--training.compile",
            "--job.name",
            "x",
        ]
    )
    assert raw == {
        "training": {"steps": 20, "compile": True},
        "optimizer": {"betas": [0.8, 0.9]},
        "job": {"name": "x"},
    }
    # kedro run --params training.steps=5 (Kedro parses it with OmegaConf.from_dotlist) and
    # the worker's --training.steps 5 both deliver ints, which the strict int fields take.
    kedro = OmegaConf.to_container(
        OmegaConf.from_dotlist(["training.steps=5", "lr_scheduler.warmup_steps=2"])
    )
    worker = parse_cli_overrides(["--training.steps", "5", "--lr_scheduler.warmup_steps=2"])
    assert kedro == worker == {"training": {"steps": 5}, "lr_scheduler": {"warmup_steps": 2}}
    assert build_job_config(kedro).training.steps == build_job_config(worker).training.steps == 5
    # The edges of the checks below still validate: warm-up = steps, min_lr = lr, beta 0.
    cfg = build_job_config(
        {
            "training": {"steps": 10},
            "lr_scheduler": {"warmup_steps": 10, "min_lr": 8e-4},
            "optimizer": {"lr": 8e-4, "betas": [0.0, 0.999]},
            "fault_tolerance": {"lighthouse_address": "http://10.0.0.5:29510"},
        }
    )
    assert cfg.optimizer.betas == (0.0, 0.999)


def test_cli_rejects_positional_garbage() -> None:
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli_overrides(["training.steps", "3"])


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_precedence_cli_over_file_over_defaults(tmp_path: Path, suffix: str) -> None:
    content = {"training": {"steps": 7, "seq_len": 32}, "optimizer": {"lr": 0.01}}
    path = tmp_path / f"job{suffix}"
    if suffix == ".toml":
        path.write_text(tomli_w.dumps(content))
    elif suffix == ".yaml":
        path.write_text(yaml.safe_dump(content))
    else:
        path.write_text(json.dumps(content))
    raw = load_raw_config(path, ["--training.steps", "20"])
    cfg = build_job_config(raw, source=str(path))
    assert cfg.training.steps == 20  # command line
    assert cfg.training.seq_len == 32  # file
    assert cfg.optimizer.lr == 0.01  # file
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_bad_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_raw_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\nsteps = ")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        load_raw_config(broken)


def test_dump_round_trips_through_the_loader(tmp_path: Path) -> None:
    cfg = build_job_config(
        {
            "training": {"steps": 5},
            "lr_scheduler": {"warmup_steps": 2},
            "parallelism": {"router_degree": 1},
        },
        EXT,
    )
    path = dump_job_config(cfg, tmp_path / "job.yaml")
    again = build_job_config(load_raw_config(path), EXT)
    assert again == cfg


def test_flatten_gives_dotted_keys() -> None:
    flat = flatten(build_job_config({}).model_dump())
    assert flat["training.steps"] == JobConfig().training.steps
    assert "optimizer.lr" in flat


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"optimizer": {"lr": float("inf")}}, r"'optimizer\.lr' = inf is invalid: .*finite"),
        ({"optimizer": {"weight_decay": float("inf")}}, r"'optimizer\.weight_decay' = inf"),
        ({"optimizer": {"eps": float("inf")}}, r"'optimizer\.eps' = inf"),
        ({"optimizer": {"betas": [1.0, 0.95]}}, r"'optimizer\.betas\.0' = 1\.0 .*less than 1"),
        ({"optimizer": {"betas": [0.9, -0.1]}}, r"'optimizer\.betas\.1' = -0\.1"),
        (
            {"optimizer": {"lr": 1e-3}, "lr_scheduler": {"min_lr": 1e-2}},
            r"lr_scheduler\.min_lr=0\.01 is above optimizer\.lr=0\.001",
        ),
        (
            {"training": {"steps": 10}, "lr_scheduler": {"warmup_steps": 11}},
            r"lr_scheduler\.warmup_steps=11 is longer than the run \(training\.steps=10\)",
        ),
        ({"training": {"steps": True}}, r"'training\.steps' = True is invalid"),
        ({"training": {"steps": "5"}}, r"'training\.steps' = '5' is invalid"),
        ({"training": {"steps": 5.0}}, r"'training\.steps' = 5\.0 is invalid"),
        ({"checkpoint": {"interval": "10"}}, r"'checkpoint\.interval' = '10'"),
        ({"launch": {"nproc_per_node": True}}, r"'launch\.nproc_per_node' = True"),
        ({"data": {"max_line_bytes": True}}, r"'data\.max_line_bytes' = True"),
        *(
            ({"fault_tolerance": {"lighthouse_address": address}}, rf"lighthouse_address.*{why}")
            for address, why in [
                ("localhost:29510", "scheme 'localhost' is not http"),
                ("10.0.0.5:29510", "scheme 'missing' is not http"),
                ("http://10.0.0.5", "port is missing"),
                ("http://:29510", "host is missing"),
                ("http://host:99999", "port is not a number"),
                ("http://host:29510/quorum", "only http://host:port"),
            ]
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_key(raw: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_job_config(raw)
