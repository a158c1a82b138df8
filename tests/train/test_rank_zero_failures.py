"""A failure on rank 0 between collectives (resume resolution, publish, prune) ends every
rank at once with rank 0's message, instead of leaving the others waiting in a collective."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from train.helpers import run_ranks

INJECTED = "injected by the test"
COLLECTIVE_TIMEOUT_S = 60.0
"""Longer than the 30 s the ranks are given: a rank left waiting fails the check below."""


def _permission_denied(*_args: Any, **_kwargs: Any) -> None:
    raise PermissionError(13, f"Permission denied ({INJECTED})", "checkpoint folder")


def _fail_on_rank_zero(rank: int, world: int, folder: str, out: str) -> None:
    import torch

    from titan_kedro.train.checkpoint import manager, publish
    from titan_kedro.train.checkpoint.manager import CheckpointManager, ModelState
    from titan_kedro.train.checkpoint.rank_zero import RankZeroError

    checkpoints = CheckpointManager(
        folder,
        {"model": ModelState([torch.nn.Linear(2, 2)])},
        per_rank_state=lambda: {"rank": rank},
        restore_per_rank=lambda entry, same_world: None,
        keep_latest_k=1,
    )
    checkpoints.save(1)
    scenarios = [
        # Anything rank 0 raises while resolving, not just FileNotFoundError.
        ("resolve", mock.patch.object(manager, "find_checkpoint", _permission_denied),
         lambda: checkpoints.resolve_resume("latest")),
        # The real prune: step-1 is renamed aside, then its deletion is refused.
        ("prune", mock.patch.object(publish.shutil, "rmtree", _permission_denied),
         lambda: checkpoints.save(2)),
        ("publish", mock.patch.object(manager, "publish_folder", _permission_denied),
         lambda: checkpoints.save(3)),
    ]  # fmt: skip
    results: dict[str, Any] = {}
    for name, injection, action in scenarios:
        start = time.monotonic()
        try:
            with injection if rank == 0 else contextlib.nullcontext():
                action()
        except RankZeroError as err:
            results[name] = {"error": str(err), "seconds": time.monotonic() - start}
        else:
            results[name] = {"error": None, "seconds": time.monotonic() - start}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")


def test_rank_zero_failures_end_every_rank_with_its_message(ranks: Path) -> None:
    out = ranks / "failures"
    expected = {
        "resolve": "rank 0 failed while resolving checkpoint.resume='latest'",
        "prune": "rank 0 failed while pruning old checkpoints",
        "publish": "rank 0 failed while publishing",
    }
    for rank in (0, 1):
        results = json.loads((out / f"rank{rank}.json").read_text())
        for name, prefix in expected.items():
            error = results[name]["error"]
            assert error is not None, f"rank {rank} saw no error in {name}"
            assert error.startswith(prefix) and "PermissionError" in error and INJECTED in error
            assert results[name]["seconds"] < 30, (rank, name, results[name])
    # The half-pruned step-1 was unpublished first, so it is no checkpoint any more.
    assert not (ranks / "ckpt" / "step-1").exists()


def _interrupt_on_rank_zero(rank: int, world: int, out: str) -> None:
    from titan_kedro.train.checkpoint.rank_zero import RankZeroError, on_rank_zero

    def interrupted() -> None:
        raise KeyboardInterrupt

    start = time.monotonic()
    try:
        on_rank_zero("publishing step-9", interrupted)
    except KeyboardInterrupt:
        seen = "KeyboardInterrupt"
    except RankZeroError as err:
        seen = str(err)
    else:
        seen = "nothing"
    result = {"seen": seen, "seconds": time.monotonic() - start}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def _scenarios(rank: int, world: int, root: str) -> None:
    _fail_on_rank_zero(rank, world, str(Path(root, "ckpt")), str(Path(root, "failures")))
    _interrupt_on_rank_zero(rank, world, str(Path(root, "interrupt")))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of two gloo ranks runs every scenario in turn (each leaves the group
    usable: its error is raised on every rank and caught); the tests read what each saw."""
    root = tmp_path_factory.mktemp("rank_zero")
    for name in ("failures", "interrupt"):
        (root / name).mkdir()
    run_ranks(
        _scenarios, str(root), store=root / "store", collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    return root


def test_a_rank_zero_interrupt_reaches_every_rank(ranks: Path) -> None:
    """Ctrl-C on rank 0 used to skip the broadcast: rank 1 waited for the collective timeout."""
    out = ranks / "interrupt"
    zero, one = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["seen"] == "KeyboardInterrupt"  # rank 0's own interrupt is kept
    assert one["seen"] == "rank 0 failed while publishing step-9: KeyboardInterrupt"
    assert one["seconds"] < 30, one
