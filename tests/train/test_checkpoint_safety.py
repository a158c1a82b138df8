"""Checkpoint safety: metadata unpickled through an allow-list, atomic publishing, run identity."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from titan_kedro.runs.checkpoint_layout import METADATA
from titan_kedro.runs.identity import (
    ResumeMismatchError,
    check_resume_compatible,
    new_run_id,
    plan_run,
)
from titan_kedro.runs.resume import (
    RUN_ID_SHAPE,
    CheckpointRunIdError,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
)
from titan_kedro.train.checkpoint.publish import (
    prune_checkpoints,
    publish_folder,
    recover_interrupted_publish,
    sweep_unfinished,
)
from titan_kedro.train.checkpoint.safe_load import UnsafeCheckpointError, load_model_weights

RUN_A = "a" * 32
RUN_B = "b" * 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))


def _save(folder: Path, model: nn.Module, **meta: object) -> Path:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / METADATA).write_text(json.dumps({"step": 1, **meta}), encoding="utf-8")
    return folder


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    source = _model()
    path = _save(tmp_path / "step-1", source)
    target = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    load_model_weights(path, target)
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "step-1", _model())
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        load_model_weights(path, _model())
    assert not marker.exists()
    # The same bytes through plain pickle would have run the command: the test can fail.
    pickle.loads((path / ".metadata").read_bytes())
    assert marker.exists()


def _point_storage_at(path: Path, target: str) -> None:
    """Rewrite every storage entry of ``path``'s .metadata to read ``target``."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own checkpoint
    for info in metadata.storage_data.values():
        info.relative_path = target
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_metadata_whose_storage_path_leaves_the_folder_is_refused(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = _save(tmp_path / "other", nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)))
    path = _save(tmp_path / "run" / "step-1", _model())
    outside = "../../other/__0_0.distcp" if kind == "relative" else str(other / "__0_0.distcp")
    _point_storage_at(path, outside)
    # Without the check, DCP's own reader follows the entry into the other checkpoint.
    plain = {"model": _model().state_dict()}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert not torch.equal(plain["model"]["0.weight"], _model().state_dict()["0.weight"])

    opened: list[Path] = []
    create_stream = FileSystem.create_stream

    def spy(self: FileSystem, stream_path: str | os.PathLike, mode: str) -> object:
        opened.append(Path(stream_path).resolve())
        return create_stream(self, stream_path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", spy)
    target = _model()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_model_weights(path, target)
    assert str(path) in str(refused.value)
    assert outside in str(refused.value)
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert opened and not [p for p in opened if p.is_relative_to(other.resolve())]


def test_publish_replaces_a_folder_without_a_gap(tmp_path: Path) -> None:
    final = tmp_path / "step-3"
    final.mkdir()
    (final / "old").write_text("old")
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    (tmp / "new").write_text("new")
    publish_folder(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def _fake_checkpoint(folder: Path, **meta: object) -> Path:
    folder.mkdir(parents=True)
    (folder / METADATA).write_text(json.dumps({"step": 1, **meta}), encoding="utf-8")
    return folder


def test_a_crash_between_the_publishing_renames_loses_no_checkpoint(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "step-3")
    # publish_folder renamed step-6 aside, then died before renaming the new copy in.
    _fake_checkpoint(tmp_path / "step-6.old.tmp", step=6)
    (tmp_path / "step-9.old.tmp").mkdir()  # never completed: not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert recover_interrupted_publish(tmp_path) == [tmp_path / "step-6"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-6"
    assert json.loads((tmp_path / "step-6" / METADATA).read_text())["step"] == 6
    assert (tmp_path / "step-9.old.tmp").is_dir()  # left for the *.tmp sweep


def test_resume_resolves_never_latest_run_id_and_path(tmp_path: Path) -> None:
    old = _fake_checkpoint(tmp_path / RUN_A / "step-2", run_id=RUN_A)
    newer = _fake_checkpoint(tmp_path / RUN_B / "step-6", run_id=RUN_B)
    os.utime(old / METADATA, (1, 1))
    assert find_checkpoint(tmp_path, "never") is None
    assert find_checkpoint(tmp_path, "latest") == newer
    assert find_checkpoint(tmp_path, RUN_A) == old
    assert find_checkpoint(tmp_path, str(old)) == old
    with pytest.raises(FileNotFoundError, match="run-c"):
        find_checkpoint(tmp_path, "run-c")
    with pytest.raises(FileNotFoundError, match="no run under"):
        find_checkpoint(tmp_path / "empty", "latest")
    point = resolve_resume(tmp_path, "latest")
    assert point is not None and (point.checkpoint, point.run_id) == (newer, RUN_B)
    assert resolve_resume(tmp_path, "never") is None

    new_plan = plan_run(tmp_path, "never", "c" * 32)
    assert (new_plan.run_id, new_plan.resume_from) == ("c" * 32, None)
    assert new_plan.checkpoint_dir == tmp_path / ("c" * 32)
    assert RUN_ID_SHAPE.match(plan_run(tmp_path, "never", None).run_id)  # generated
    continued = plan_run(tmp_path, RUN_A, "ignored")
    assert (continued.run_id, continued.resume_from) == (RUN_A, old)
    # A checkpoint that records no run (a worker started by hand) continues as a new run.
    bare = _fake_checkpoint(tmp_path / "by-hand" / "step-1")
    assert plan_run(tmp_path, str(bare), "d" * 32).run_id == "d" * 32


def test_generated_run_ids_have_the_accepted_shape() -> None:
    assert all(RUN_ID_SHAPE.match(new_run_id()) for _ in range(20))


@pytest.mark.parametrize("bad", ["../..", "/tmp/x", "..", "A" * 32, "a" * 31, 12])
def test_a_run_id_that_is_no_run_id_is_refused_before_any_path_use(
    tmp_path: Path, bad: object
) -> None:
    root = tmp_path / "ckpt"
    checkpoint = _fake_checkpoint(root / RUN_A / "step-4", run_id=bad)
    for resume in ("latest", RUN_A, str(checkpoint)):
        with pytest.raises(CheckpointRunIdError) as err:
            plan_run(root, resume, None)
        message = str(err.value)
        assert str(checkpoint / METADATA) in message and "checkpoint.folder" in message
        assert repr(bad) in message
    assert sorted(p.name for p in root.iterdir()) == [RUN_A]  # nothing created elsewhere


def test_a_run_id_whose_folder_links_outside_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    checkpoint = _fake_checkpoint(root / "r" / "step-1", run_id=RUN_B)
    (root / RUN_B).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(CheckpointRunIdError, match=r"outside checkpoint\.folder"):
        resolve_resume(root, str(checkpoint))


def test_prune_unpublishes_a_step_before_deleting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / f"step-{step}", step=step)
    from titan_kedro.train.checkpoint import publish

    real_rmtree = publish.shutil.rmtree

    def dies_halfway(path: Path, *args: object, **kwargs: object) -> None:
        (Path(path) / "shard.distcp").unlink(missing_ok=True)  # some files went, then:
        raise PermissionError(13, "injected: Permission denied", str(path))

    (tmp_path / "step-2" / "shard.distcp").write_bytes(b"x")
    monkeypatch.setattr(publish.shutil, "rmtree", dies_halfway)
    with pytest.raises(PermissionError, match="injected"):
        prune_checkpoints(tmp_path, keep_latest_k=2)
    # The half-deleted step no longer counts: resuming can never pick it.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    assert (tmp_path / "step-2.deleting" / METADATA).is_file()
    monkeypatch.setattr(publish.shutil, "rmtree", real_rmtree)
    assert sweep_unfinished(tmp_path) == [tmp_path / "step-2.deleting"]
    _fake_checkpoint(tmp_path / "step-8", step=8)
    assert prune_checkpoints(tmp_path, keep_latest_k=2) == [tmp_path / "step-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-8"]


def test_maths_changes_are_refused_listing_the_keys(tmp_path: Path) -> None:
    from titan_kedro.runs.identity import allowed_changes, checkpoint_metadata
    from train.conftest import make_config

    base = {
        "job": {"seed": 7, "run_id": RUN_A},
        "training": {"seq_len": 64, "local_batch_size": 2, "global_batch_size": 8},
        "launch": {"nproc_per_node": 2},
    }
    tokens = {"fingerprint": "abc", "tokenizer": {"fingerprint": "tok"}}
    saved = checkpoint_metadata(make_config(**base), tokens)
    path = _fake_checkpoint(tmp_path / RUN_A / "step-1", **saved.to_dict())
    # Legitimate continuations: the schedule, the layout (world size 2 -> 4, same global
    # batch), where things live and how a step runs.
    allowed = make_config(
        job={"seed": 7, "run_id": None, "name": "again", "dump_folder": str(tmp_path / "j")},
        data={"token_dir": str(tmp_path / "moved")},
        training={"seq_len": 64, "local_batch_size": 1, "global_batch_size": 8, "steps": 9,
                  "num_threads": 1, "compile": True, "activation_checkpoint": "full"},
        optimizer={"lr": 1e-3},
        lr_scheduler={"warmup_steps": 3},
        launch={"nproc_per_node": 4, "scheduler": "local_cwd"},
        checkpoint={"resume": "latest", "interval": 3},
    )  # fmt: skip
    check_resume_compatible(path, allowed, tokens)
    changes = allowed_changes(path, allowed)
    assert changes["training.steps"] == (200, 9) and changes["optimizer.lr"] == (8e-4, 1e-3)
    assert changes["launch.nproc_per_node"] == (2, 4)
    assert "checkpoint.resume" not in changes and "job.run_id" not in changes  # set by the run

    changed = make_config(
        **{**base, "job": {"seed": 8}, "training": {**base["training"], "seq_len": 128}},
        optimizer={"weight_decay": 0.0},
    )
    with pytest.raises(ResumeMismatchError) as err:
        check_resume_compatible(path, changed, {**tokens, "fingerprint": "xyz"})
    message = str(err.value)
    assert "job.seed: checkpoint 7, now 8" in message and "--params job.seed=7" in message
    assert "training.seq_len: checkpoint 64, now 128" in message
    assert "optimizer.weight_decay: checkpoint 0.1, now 0.0" in message
    assert "data_fingerprint: checkpoint 'abc', now 'xyz'" in message
    assert "checkpoint.resume=never" in message and "job.run_id" not in message

    # The global batch is compared as a number: left to the world size, it changes.
    by_world = make_config(
        job={"seed": 7},
        training={"seq_len": 64, "local_batch_size": 2},
        launch={"nproc_per_node": 2},
    )
    by_world_path = _fake_checkpoint(
        tmp_path / "w" / "step-1", **checkpoint_metadata(by_world, None).to_dict()
    )
    more_ranks = by_world.model_copy(update={"launch": allowed.launch})
    with pytest.raises(ResumeMismatchError, match="global_batch_size: checkpoint 4, now 8"):
        check_resume_compatible(by_world_path, more_ranks)


def test_a_checkpoint_saved_without_its_config_is_compared_on_its_recorded_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from train.conftest import make_config

    cfg = make_config(job={"seed": 3}, training={"seq_len": 64})
    old = {"training.seq_len": 64, "model.flavor": "debugmodel", "data_fingerprint": "abc"}
    path = _fake_checkpoint(tmp_path / "r" / "step-1", math=old)
    with caplog.at_level("WARNING"):
        check_resume_compatible(path, cfg, {"fingerprint": "abc"})  # the seed is not recorded
    assert "saved without its job config" in caplog.text and "job.seed" in caplog.text
    longer = make_config(training={"seq_len": 128})
    with pytest.raises(ResumeMismatchError) as err:
        check_resume_compatible(path, longer, {"fingerprint": "xyz"})
    assert "data_fingerprint" in str(err.value) and "training.seq_len" in str(err.value)
    assert "model.flavor" not in str(err.value)


def test_checkpoint_metadata_round_trips_and_refuses_what_the_trainer_never_writes(
    tmp_path: Path,
) -> None:
    from titan_kedro.runs.checkpoint_metadata import (
        CheckpointMetadata,
        CheckpointMetadataError,
    )

    meta = CheckpointMetadata(step=4, world_size=2, loss=1.5, run_id=RUN_A, config={"job": {}})
    folder = tmp_path / "step-4"
    folder.mkdir()
    meta.write(folder)
    assert CheckpointMetadata.read(folder) == meta
    for bad, named in (
        ({"world_size": 2}, "no 'step'"),
        ({"step": "4"}, "step '4'"),
        ({"step": 4, "world_size": "2"}, "world_size '2'"),
        ({"step": 4, "config": [1]}, "config [1]"),
        ({"step": 4, "loss": True}, "loss True"),
    ):
        (folder / METADATA).write_text(json.dumps(bad), encoding="utf-8")
        with pytest.raises(CheckpointMetadataError, match=re.escape(named)) as err:
            CheckpointMetadata.read(folder)
        assert str(folder / METADATA) in str(err.value)
    (folder / METADATA).write_text("{", encoding="utf-8")
    with pytest.raises(CheckpointMetadataError, match="not valid JSON"):
        CheckpointMetadata.read(folder)


def test_one_resolution_reads_the_checkpoint_metadata_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_kedro.runs.identity import checkpoint_metadata, prepare_run
    from train.conftest import make_config

    root = tmp_path / "ckpt"
    cfg = make_config(checkpoint={"folder": str(root), "resume": "latest"}, job={"run_id": RUN_A})
    _fake_checkpoint(root / RUN_A / "step-4", **checkpoint_metadata(cfg, None).to_dict())
    reads: list[Path] = []
    real_read_text = Path.read_text

    def counting_read_text(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == METADATA:
            reads.append(self)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    workers = prepare_run(cfg, None, RUN_A)  # finds latest, checks run id, maths, schedule
    assert workers.checkpoint.resume == str(root / RUN_A / "step-4")
    assert reads == [root / RUN_A / "step-4" / METADATA]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_stray_tmp_file_beside_checkpoints_is_left_alone_and_saves_work(tmp_path: Path) -> None:
    import torch.distributed as dist

    from titan_kedro.train.checkpoint.manager import CheckpointManager, ModelState

    folder = tmp_path / "run"
    folder.mkdir()
    # The run lock's temporary file after a kill, a user's file and folder: none are ours.
    strays = {"writer.lock.4242.tmp": "{}", "notes.tmp": "mine", "step-x.deleting": "mine"}
    for name, text in strays.items():
        (folder / name).write_text(text)
    (folder / "backup.tmp").mkdir()
    (folder / "backup.tmp" / "keep").write_text("mine")
    (folder / "step-5.tmp").mkdir()  # an interrupted save of ours: swept
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        manager = CheckpointManager(
            folder,
            {"model": ModelState([nn.Linear(2, 2)])},
            per_rank_state=dict,
            restore_per_rank=lambda entry, same_world: None,
            keep_latest_k=1,
        )
        assert manager.save(1) == folder / "step-1"
        assert manager.save(2) == folder / "step-2"
    finally:
        dist.destroy_process_group()
    assert (folder / "step-2" / METADATA).is_file() and not (folder / "step-1").exists()
    for name, text in strays.items():
        assert (folder / name).read_text() == text
    assert (folder / "backup.tmp" / "keep").read_text() == "mine"
    assert not (folder / "step-5.tmp").exists()
