"""Project settings. See https://docs.kedro.org/en/stable/kedro_project_setup/settings.html."""

from kedro.config import OmegaConfigLoader
from omegaconf.resolvers import oc

from titan_kedro.hooks import ValidateJobConfigHook
from titan_kedro.mlflow_hooks import MlflowRunTagsHook

# kedro-mlflow registers its own hooks through its entry point.
HOOKS = (ValidateJobConfigHook(), MlflowRunTagsHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # An environment overrides single keys without wiping the rest of a section.
    "merge_strategy": {"parameters": "soft"},
    # Lets mlflow.yml read MLFLOW_TRACKING_URI (Kedro only enables oc.env for credentials).
    "custom_resolvers": {"oc.env": oc.env},
}
