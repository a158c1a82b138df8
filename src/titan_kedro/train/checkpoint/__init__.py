"""Distributed checkpoints that a crash can never leave half-written, loaded safely.

Rooms: ``safe_load`` (the allow-list unpickler and every load path), ``publish`` (fsync,
atomic publish, recovery, prune), ``rank_zero`` (rank 0's work and failures shared with
every rank) and ``manager`` (``CheckpointManager``, the per-rank state codec). The public
names are re-exported here. What is about runs rather than tensors lives in
``titan_kedro.runs``: the ``step-<n>`` folders (``checkpoint_layout``), ``metadata.json``
(``checkpoint_metadata.CheckpointMetadata``) and finding checkpoints and the one
resolution of ``checkpoint.resume`` (``resume``).
"""

from titan_kedro.train.checkpoint.manager import (
    CheckpointManager,
    ModelState,
    decode_state,
    encode_state,
    rng_state,
    set_rng_state,
)
from titan_kedro.train.checkpoint.publish import (
    prune_checkpoints,
    publish_folder,
    recover_interrupted_publish,
    sweep_unfinished,
)
from titan_kedro.train.checkpoint.rank_zero import RankZeroError, on_rank_zero
from titan_kedro.train.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_model_weights,
    safe_dcp_load,
)

__all__ = [
    "CheckpointManager",
    "ModelState",
    "RankZeroError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "decode_state",
    "encode_state",
    "load_model_weights",
    "on_rank_zero",
    "prune_checkpoints",
    "publish_folder",
    "recover_interrupted_publish",
    "rng_state",
    "safe_dcp_load",
    "set_rng_state",
    "sweep_unfinished",
]
