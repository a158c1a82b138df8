"""Which replica a failed TorchX job is reported by (``launch.scheduler.failing_replica``).

The tails are shaped like the two nodes' output of a real run on the test cluster, where
rank 1 exited at step 3 and rank 0's next all-gather lost its connection: both torchruns
saw a failed worker and reported a root cause before Slurm cancelled node 0's step.
"""

from __future__ import annotations

from collections import deque

from torchx.specs import AppState, AppStatus

from titan_kedro.launch.scheduler import failing_replica


def _torchrun_tail(rank: int, worker_line: str, failed_at: str, exitcode: int) -> list[str]:
    return [
        f"[default0]:{worker_line}\n",
        f"E1206 {failed_at} 2577{rank} torch/distributed/elastic/multiprocessing/api.py:1002] "
        f"failed (exitcode: {exitcode}) local_rank: 0 (pid: 2588{rank}) of binary: python\n",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
        "Root Cause (first observed failure):\n",
        "  time      : 2026-12-06_23:04:33\n",
        f"  rank      : {rank} (local_rank: 0)\n",
        f"  exitcode  : {exitcode} (pid: 2588{rank})\n",
    ]


CRASHED = _torchrun_tail(1, "[fault injection] rank 1 exits at step 3", "23:04:34.057000", 17)
RESET = "[rank0]: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:44441: Connection reset"
PEER = [
    *_torchrun_tail(0, RESET, "23:04:34.173000", 1),
    "slurmstepd-n1: error: *** STEP 1155.0 ON n1 CANCELLED AT 2026-12-06T23:04:34 ***\n",
]
FAILED = AppStatus(AppState.FAILED)


def test_of_two_root_causes_the_earlier_failure_is_named_whichever_node_it_is() -> None:
    assert failing_replica(FAILED, [deque(PEER), deque(CRASHED)]) == 1
    assert failing_replica(FAILED, [deque(CRASHED), deque(PEER)]) == 0


def test_a_torchrun_stopped_by_a_signal_is_not_the_cause_even_when_earlier() -> None:
    signalled = [
        *_torchrun_tail(0, "[rank0]: step 3", "23:04:33.900000", -15),
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 25777 got "
        "signal: 15\n",
    ]
    assert failing_replica(FAILED, [deque(signalled), deque(CRASHED)]) == 1


def test_root_causes_without_a_time_keep_the_replica_order() -> None:
    untimed = [line for line in PEER if "failed (exitcode" not in line]
    assert failing_replica(FAILED, [deque(untimed), deque(CRASHED)]) == 1  # the timed one first
    crashed_untimed = [line for line in CRASHED if "failed (exitcode" not in line]
    assert failing_replica(FAILED, [deque(untimed), deque(crashed_untimed)]) == 0
