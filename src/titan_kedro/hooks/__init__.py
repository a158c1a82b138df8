"""The project's Kedro hooks, one per module (registered in ``settings.HOOKS``).

- ``validate_job_config.ValidateJobConfigHook``: the parameters as a typed job config,
  before anything runs; refuses a dry run whose pipeline reads the training summary.
- ``continue_run.ContinueRunHook``: resolves ``checkpoint.resume`` once, reopens that
  MLflow run and hands nodes the concrete checkpoint.
- ``logged_params.KeepLoggedParamsHook``: kedro-mlflow logs only the params the run lacks
  (a continued run keeps its logged values).
- ``mlflow_run_tags.MlflowRunTagsHook``: tags, all params, provenance artifacts, lineage.
- ``storage_credentials.StorageCredentialsHook``: ``credentials.yml``'s ``object_storage``
  entry as the AWS variables s3fs reads (the environment wins).
"""

from titan_kedro.hooks.continue_run import ContinueRunHook
from titan_kedro.hooks.logged_params import KeepLoggedParamsHook
from titan_kedro.hooks.mlflow_run_tags import MlflowRunTagsHook
from titan_kedro.hooks.storage_credentials import StorageCredentialsHook
from titan_kedro.hooks.validate_job_config import ValidateJobConfigHook

__all__ = [
    "ContinueRunHook",
    "KeepLoggedParamsHook",
    "MlflowRunTagsHook",
    "StorageCredentialsHook",
    "ValidateJobConfigHook",
]
