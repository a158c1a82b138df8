"""Log an exported Hugging Face folder as an MLflow model and register it with an alias.

A pyfunc model from code (``tracking/hf_pyfunc_model.py``) wraps
``AutoModelForCausalLM``, rather than MLflow's ``transformers`` flavor: that flavor
builds a ``pipeline`` and infers a task and tokenizer on load, which adds nothing for a
pretraining checkpoint and ties loading to MLflow's list of supported transformers
versions; the pyfunc keeps the folder byte for byte (``artifacts/hf_folder``, which
``from_pretrained`` reads directly) and returns logits, which is what a check needs.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODEL_CODE = Path(__file__).with_name("hf_pyfunc_model.py")
ARTIFACT_NAME = "hf_model"


@dataclass(frozen=True)
class RegisteredModel:
    """Where the registered export lives."""

    name: str
    """Registered model name."""
    version: str
    """The new version."""
    alias: str
    """Alias now pointing at that version."""
    uri: str
    """``models:/<name>@<alias>``."""
    model_uri: str
    """The logged model inside the run."""

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for the export manifest."""
        return asdict(self)


def register_hf_folder(
    folder: str | Path, *, name: str, alias: str, run_id: str | None = None
) -> RegisteredModel:
    """Log ``folder`` as a pyfunc model in the run and register it under ``name@alias``.

    Args:
        folder: The Hugging Face folder (``config.json``, safetensors, tokenizer).
        name: Registered model name.
        alias: Alias moved to the new version.
        run_id: The MLflow run; default the active run (one is started if none is).

    Returns:
        The registered version.
    """
    import mlflow
    from mlflow import MlflowClient

    requirements = [f"{pkg}=={version(pkg)}" for pkg in ("torch", "transformers", "safetensors")]
    active = mlflow.active_run()
    started = None
    if run_id is not None and (active is None or active.info.run_id != run_id):
        started = mlflow.start_run(run_id=run_id)
    try:
        info = mlflow.pyfunc.log_model(
            name=ARTIFACT_NAME,
            python_model=str(MODEL_CODE),
            artifacts={"hf_folder": str(folder)},
            pip_requirements=requirements,
            registered_model_name=name,
        )
    finally:
        if started is not None:
            mlflow.end_run()
    model_version = str(info.registered_model_version)
    MlflowClient().set_registered_model_alias(name, alias, model_version)
    log.info("registered %s version %s as models:/%s@%s", folder, model_version, name, alias)
    return RegisteredModel(
        name=name,
        version=model_version,
        alias=alias,
        uri=f"models:/{name}@{alias}",
        model_uri=info.model_uri,
    )
