"""Project pipelines."""

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

from titan_kedro.runs.frozen_imports import frozen_imports

# The order a full run takes; each stage consumes the one before it.
DEFAULT_ORDER = (
    "data_processing",
    "model_spec",
    "training",
    "evaluation",
    "reporting",
    "export_hf",
)


def register_pipelines() -> dict[str, Pipeline]:
    """Register the project's pipelines.

    Returns:
        A mapping from pipeline names to ``Pipeline`` objects; ``__default__`` runs every
        stage that exists, in ``DEFAULT_ORDER`` (Kedro orders nodes by their datasets).
    """
    with frozen_imports():  # the nodes' modules import the models, the plan and transformers
        pipelines = find_pipelines(raise_errors=True)
    pipelines["__default__"] = sum(
        (pipelines[name] for name in DEFAULT_ORDER if name in pipelines), Pipeline([])
    )
    return pipelines
