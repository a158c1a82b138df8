"""Typed job config: pydantic sections, train-spec extensions, file + CLI + Kedro loading."""

from titan_kedro.config.extensions import merge_extensions
from titan_kedro.config.load import (
    ConfigError,
    build_job_config,
    deep_merge,
    dump_job_config,
    flatten,
    load_raw_config,
    parse_cli_overrides,
    read_config_file,
)
from titan_kedro.config.resolve import ResolvedJob, resolve_job_config
from titan_kedro.config.schema import JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "ResolvedJob",
    "build_job_config",
    "deep_merge",
    "dump_job_config",
    "flatten",
    "load_raw_config",
    "merge_extensions",
    "parse_cli_overrides",
    "read_config_file",
    "resolve_job_config",
]
