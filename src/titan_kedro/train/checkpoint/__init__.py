"""Distributed checkpoints that a crash can never leave half-written, loaded safely.

Rooms: ``layout`` (``step-<n>`` folders), ``metadata`` (``CheckpointMetadata``: what
``metadata.json`` holds, its one writer and reader), ``safe_load`` (the allow-list
unpickler and every load path), ``publish`` (fsync, atomic publish, recovery, prune),
``resume`` (finding checkpoints and the one resolution of ``checkpoint.resume``),
``rank_zero`` (rank 0's work and failures shared with every rank) and ``manager``
(``CheckpointManager``, the per-rank state codec). The public names are re-exported here.
"""

from titan_kedro.train.checkpoint.layout import METADATA, is_checkpoint, step_dir
from titan_kedro.train.checkpoint.manager import (
    CheckpointManager,
    ModelState,
    decode_state,
    encode_state,
    rng_state,
    set_rng_state,
)
from titan_kedro.train.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointMetadataError,
    read_checkpoint_metadata,
)
from titan_kedro.train.checkpoint.publish import (
    prune_checkpoints,
    publish_folder,
    recover_interrupted_publish,
    sweep_unfinished,
)
from titan_kedro.train.checkpoint.rank_zero import RankZeroError, on_rank_zero
from titan_kedro.train.checkpoint.resume import (
    CheckpointRunIdError,
    ResumePoint,
    checkpoint_run_id,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
)
from titan_kedro.train.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_model_weights,
    safe_dcp_load,
)

__all__ = [
    "METADATA",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointMetadataError",
    "CheckpointRunIdError",
    "ModelState",
    "RankZeroError",
    "ResumePoint",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "checkpoint_run_id",
    "decode_state",
    "encode_state",
    "find_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model_weights",
    "on_rank_zero",
    "prune_checkpoints",
    "publish_folder",
    "read_checkpoint_metadata",
    "recover_interrupted_publish",
    "resolve_resume",
    "rng_state",
    "safe_dcp_load",
    "set_rng_state",
    "step_dir",
    "sweep_unfinished",
]
