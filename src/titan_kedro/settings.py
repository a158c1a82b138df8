"""Project settings. See https://docs.kedro.org/en/stable/kedro_project_setup/settings.html."""

import os
import warnings

from kedro.config import OmegaConfigLoader
from omegaconf.resolvers import oc

from titan_kedro.runs.frozen_imports import freeze_at_exit, frozen_imports
from titan_kedro.tracking.credentials import adopt_tracking_credentials, install_secret_filter

# The hooks import torch and MLflow: their objects and Kedro's stay out of the plan's and
# the nodes' collections, and out of the interpreter's at exit (runs/frozen_imports.py).
freeze_at_exit()
with frozen_imports():
    from titan_kedro.hooks import (
        ContinueRunHook,
        KeepLoggedParamsHook,
        MlflowRunTagsHook,
        StorageCredentialsHook,
        ValidateJobConfigHook,
    )

# From the first moment: no credentials in this process's tracking URI (they move to
# MLflow's MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN, which the workers inherit), and
# every log record masked (tracking/credentials.py).
_CREDENTIALS = adopt_tracking_credentials()
install_secret_filter()

# Deprecation noise from Kedro's and kedro-mlflow's own resolver registration; nothing a
# user of this project can act on.
warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated")

# kedro-mlflow registers its own hooks through its entry point.
HOOKS = (
    StorageCredentialsHook(),  # first: later hooks may read checkpoints on object storage
    ValidateJobConfigHook(),
    ContinueRunHook(),
    KeepLoggedParamsHook(),
    MlflowRunTagsHook(),
)

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # An environment overrides single keys without wiping the rest of a section.
    "merge_strategy": {"parameters": "soft"},
    # Lets mlflow.yml read MLFLOW_TRACKING_URI (Kedro only enables oc.env for credentials).
    "custom_resolvers": {"oc.env": oc.env},
}

# MLflow prints the run's URL when a run ends: not for a server that needs credentials.
if _CREDENTIALS.values():
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
