"""Project wiring: metadata files agree, settings and ignores are as documented."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import yaml
from kedro.framework.startup import bootstrap_project

REPO = Path(__file__).resolve().parents[1]


def test_legacy_kedro_yml_mirrors_pyproject() -> None:
    tool_kedro = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["kedro"]
    legacy = yaml.safe_load((REPO / ".kedro.yml").read_text())
    for key in ("project_name", "package_name", "kedro_init_version", "source_dir"):
        assert legacy[key] == tool_kedro[key], key
    assert "ignores this file" in (REPO / ".kedro.yml").read_text()


def test_kedro_reads_the_metadata() -> None:
    metadata = bootstrap_project(REPO)
    assert metadata.package_name == "titan_kedro"
    assert metadata.project_name == "Titan Kedro"


def test_settings_layer_parameters_softly() -> None:
    from titan_kedro import settings

    assert settings.CONFIG_LOADER_ARGS["base_env"] == "base"
    assert settings.CONFIG_LOADER_ARGS["default_run_env"] == "local"
    assert settings.CONFIG_LOADER_ARGS["merge_strategy"] == {"parameters": "soft"}


def test_data_and_secrets_are_ignored_but_layer_folders_kept() -> None:
    def ignored(path: str) -> bool:
        return (
            subprocess.run(["git", "check-ignore", "-q", path], check=False, cwd=REPO).returncode
            == 0
        )

    for path in (
        "data/01_raw/c4/shard.json.gz",
        "conf/local/credentials.yml",
        "mlflow.db",
        "mlruns/0/meta.yaml",
        ".venv/bin/python",
        "build/x",
    ):
        assert ignored(path), path
    for path in ("data/01_raw/.gitkeep", "conf/local/.gitkeep"):
        assert not ignored(path), path


def test_constraints_pin_torch_and_mlflow_exactly() -> None:
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["torch"] == "2.13.0"
    assert pins["mlflow"].startswith("3.17.")


def test_metrics_file_follows_the_trainer_dump_folder(tmp_path: Path) -> None:
    """Reporting reads metrics.jsonl where the trainer writes it: --params and env globals."""
    import shutil

    from kedro.config import OmegaConfigLoader

    from titan_kedro.settings import CONFIG_LOADER_ARGS

    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf, ignore=shutil.ignore_patterns("local"))
    (conf / "moved").mkdir()
    (conf / "moved" / "globals.yml").write_text("job_dump_folder: elsewhere/job\n")

    def paths(env: str, runtime: dict | None = None) -> tuple[str, str]:
        loader = OmegaConfigLoader(str(conf), env=env, runtime_params=runtime, **CONFIG_LOADER_ARGS)
        return (
            loader["parameters"]["job"]["dump_folder"],
            loader["catalog"]["training_metrics_jsonl"]["filepath"],
        )

    assert paths("test") == ("data/07_model_output/job", "data/07_model_output/job/metrics.jsonl")
    assert paths("moved") == ("elsewhere/job", "elsewhere/job/metrics.jsonl")
    runtime = {"job": {"dump_folder": "cli/job"}}
    assert paths("moved", runtime) == ("cli/job", "cli/job/metrics.jsonl")


def test_raw_dir_is_where_the_catalog_reads_c4(tmp_path: Path) -> None:
    """data.raw_dir and the catalog's c4_raw come from one value: globals, or --params."""
    import shutil

    from kedro.config import OmegaConfigLoader

    from titan_kedro.settings import CONFIG_LOADER_ARGS

    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf, ignore=shutil.ignore_patterns("local"))
    (conf / "moved").mkdir()
    (conf / "moved" / "globals.yml").write_text("c4_raw_dir: elsewhere/c4\n")

    def paths(env: str, runtime: dict | None = None) -> tuple[str, str]:
        loader = OmegaConfigLoader(str(conf), env=env, runtime_params=runtime, **CONFIG_LOADER_ARGS)
        return loader["parameters"]["data"]["raw_dir"], loader["catalog"]["c4_raw"]["path"]

    assert paths("test") == ("data/01_raw/c4", "data/01_raw/c4")
    assert paths("moved") == ("elsewhere/c4", "elsewhere/c4")
    assert paths("moved", {"data": {"raw_dir": "cli/c4"}}) == ("cli/c4", "cli/c4")
