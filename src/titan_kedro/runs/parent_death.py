"""A process that ends when its parent does (Linux ``prctl(PR_SET_PDEATHSIG)``).

``kedro run`` starts torchrun in a session of its own (so Ctrl-C is handled, not sent
blindly to every worker), and torchrun starts each worker in a session of its own: a
signal to ``kedro run``'s process group reaches neither. If ``kedro run`` dies without
running its handlers (SIGKILL, the OOM killer), the kernel's parent-death signal is what
still ends torchrun; torchrun's death ends the workers the same way.

The signal is sent when the *thread* that started the process exits, so the process must
be started by a thread that lives as long as it (the launcher's thread that waits for it).

The launchers start torchrun through this module's wrapper (no ``preexec_fn``, which is
unsafe in a process with threads; TorchX's ``local_cwd`` offers none)::

    python -m titan_kedro.runs.parent_death --parent-pid 1234 -- torchrun …

sets the signal on itself, checks that its parent is still process 1234, and ``exec``s the
command (the signal survives ``exec``), with ``TITAN_KEDRO_AGENT_PID`` set to its pid (and
``TITAN_KEDRO_AGENT_START`` to its start time): the workers torchrun starts compare their
parent with it when they set their own signal. A worker whose parent is not that agent
kills itself only if the agent is really gone and it was re-parented (its parent is no
torchrun and started before the agent); a variable left over from another run (the agent
alive elsewhere, or the parent a torchrun started later: a worker started by hand) is
ignored with a warning.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence

import psutil

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent thread exits."""
ORPHANED_EXIT_CODE = 128 + signal.SIGKILL
"""Exit code of a wrapper that found its parent already gone (as if its signal ended it)."""
WRAPPER_SIGNAL = signal.SIGKILL
"""What the wrapped command (torchrun) gets when the launcher dies: SIGKILL, not SIGTERM,
since torchrun's graceful shutdown of a multi-agent rendezvous takes over ten seconds and
there is nobody left to report to; its workers end by their own parent-death signal."""
WORKER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every worker it starts."""
AGENT_PID_ENV = "TITAN_KEDRO_AGENT_PID"
"""Set by the wrapper to its own pid, which torchrun keeps when it is exec'd: the workers'
expected parent, so a worker whose agent died before it set its signal notices."""
AGENT_START_ENV = "TITAN_KEDRO_AGENT_START"
"""The agent's process start time (seconds since the epoch), set with ``AGENT_PID_ENV``."""
TORCHRUN_MARKERS = ("torch.distributed.run", "torchrun", "titan_kedro.runs.loopback_agent")


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Returns:
        False where the platform has no such call (not Linux); True once set.

    Raises:
        OSError: ``prctl`` refused.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG, {int(sig)}): {os.strerror(errno)}")
    return True


def die_with_parent(sig: int, expected_parent: int | None = None) -> bool:
    """End this process with ``sig`` when its parent exits (and now, if it already has).

    Args:
        sig: The signal to receive (``SIGTERM`` lets the process clean up, ``SIGKILL``
            does not wait for it).
        expected_parent: The parent's pid, if known; else the parent at the time of the
            call. A parent that died before the signal was set is caught by comparing it
            with the parent afterwards.

    Returns:
        Whether the signal is set (False off Linux).
    """
    parent = os.getppid() if expected_parent is None else expected_parent
    armed = set_parent_death_signal(sig)
    if armed and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return armed


def end_with_agent() -> bool:
    """In a worker torchrun started: SIGKILL when its agent dies (at once if it already has).

    Call it first thing in the worker, before slow imports: the agent's pid from the
    wrapper (``TITAN_KEDRO_AGENT_PID``) tells whether the parent is still the agent.

    Returns:
        Whether the signal is set (False outside torchrun or off Linux).
    """
    if WORKER_ENV not in os.environ:
        return False
    return die_with_parent(signal.SIGKILL, expected_agent())


def _started(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def _is_torchrun(pid: int) -> bool:
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in TORCHRUN_MARKERS)


def expected_agent(environ: dict[str, str] | None = None) -> int | None:
    """The agent this worker must die with: ``TITAN_KEDRO_AGENT_PID`` when it is (or was)
    really this worker's agent, else None (its parent now) with a warning.

    The parent differs from the named agent legitimately when the agent died before the
    worker set its signal: then the agent is gone, and the worker's new parent (init, a
    subreaper) is no torchrun and older than the agent. Anything else means the variable
    is not about this worker (inherited from another run; a worker started by hand).
    """
    env = os.environ if environ is None else environ
    value = env.get(AGENT_PID_ENV)
    if not value:
        return None
    parent = os.getppid()
    try:
        agent = int(value)
        recorded = float(env[AGENT_START_ENV]) if env.get(AGENT_START_ENV) else None
    except ValueError:
        logger.warning("ignoring %s=%r: not a pid", AGENT_PID_ENV, value)
        return None
    if agent == parent:
        return agent
    started = _started(agent)
    agent_alive = started is not None and (recorded is None or abs(started - recorded) < 1.0)
    parent_started = _started(parent)
    parent_is_newer = (
        recorded is not None and parent_started is not None and parent_started > recorded + 1.0
    )
    if agent_alive or parent_is_newer or _is_torchrun(parent):
        logger.warning(
            "ignoring %s=%s: that process is not this worker's torchrun agent (its parent is "
            "pid %d); the variable was inherited from another run",
            AGENT_PID_ENV, agent, parent,
        )  # fmt: skip
        return None
    return agent  # gone: this worker was re-parented, and dies at once


def guarded_command(command: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """``command`` run through this module's wrapper, ending when this process does.

    The wrapper's parent must be this process: start it from here (``subprocess``, TorchX's
    ``local_cwd``), and a shell around it must ``exec`` it.
    """
    return [
        python, "-m", "titan_kedro.runs.parent_death",
        "--parent-pid", str(os.getpid()), "--", *command,
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``--parent-pid PID -- command …``: die with ``PID``, then become ``command``."""
    parser = argparse.ArgumentParser(
        prog="python -m titan_kedro.runs.parent_death",
        description="Run a command that is killed when its parent process exits.",
    )
    parser.add_argument("--parent-pid", type=int, required=True, help="the expected parent")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    if os.getppid() != args.parent_pid:
        print(
            f"parent_death: the launcher (pid {args.parent_pid}) is gone or is not this "
            f"process's parent (pid {os.getppid()}); not starting {command[0]}",
            file=sys.stderr,
        )
        return ORPHANED_EXIT_CODE
    die_with_parent(WRAPPER_SIGNAL, args.parent_pid)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ[AGENT_START_ENV] = repr(psutil.Process().create_time())
    os.execvp(command[0], command)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
