"""Typed job config: pydantic sections, train-spec extensions, file + CLI + Kedro loading.

Nothing here imports ``models/``: validating against a train spec (its extensions and
cross-field checks) is ``titan_kedro.models.resolve.resolve_job_config``.
"""

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
from titan_kedro.config.schema import JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "build_job_config",
    "deep_merge",
    "dump_job_config",
    "flatten",
    "load_raw_config",
    "merge_extensions",
    "parse_cli_overrides",
    "read_config_file",
]
