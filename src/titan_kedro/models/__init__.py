"""Model registry (train specs) and the model families it serves."""

from titan_kedro.models.registry import (
    StateDictAdapter,
    TrainSpec,
    get_train_spec,
    import_custom_model,
    list_train_specs,
    register_train_spec,
    unregister_train_spec,
)

__all__ = [
    "StateDictAdapter",
    "TrainSpec",
    "get_train_spec",
    "import_custom_model",
    "list_train_specs",
    "register_train_spec",
    "unregister_train_spec",
]
