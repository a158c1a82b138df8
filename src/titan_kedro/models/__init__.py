"""Train specs (``spec.py``), their registry and the model families it serves."""

from titan_kedro.models.registry import (
    get_train_spec,
    import_custom_model,
    list_train_specs,
    register_train_spec,
    unregister_train_spec,
)
from titan_kedro.models.spec import StateDictAdapter, TrainSpec

__all__ = [
    "StateDictAdapter",
    "TrainSpec",
    "get_train_spec",
    "import_custom_model",
    "list_train_specs",
    "register_train_spec",
    "unregister_train_spec",
]
