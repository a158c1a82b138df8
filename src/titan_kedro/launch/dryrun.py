"""A dry run: write what would be submitted, and submit nothing."""

from __future__ import annotations

import dataclasses
import enum
import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchx.specs import AppDef

from titan_kedro.config.schema import LOCAL_SCHEDULER
from titan_kedro.launch.preflight import check_remote_launch
from titan_kedro.launch.runner import get_runner
from titan_kedro.launch.scheduler import dryrun_info, render_request, signals_restored
from titan_kedro.launch.secrets import redact, tracking_secrets, with_secret_ref
from titan_kedro.launch.torchrun import torchrun_command


def appdef_json(app: AppDef, env: Mapping[str, str]) -> str:
    """The AppDef as JSON (enums by name; credentials masked)."""

    def _plain(value: Any) -> Any:
        return value.name if isinstance(value, enum.Enum) else str(value)

    text = json.dumps(dataclasses.asdict(app), indent=2, default=_plain)
    return redact(text, tracking_secrets(env))


def write_dryrun(
    cfg: Any, app: AppDef | None, config_path: str | Path, env: Mapping[str, str]
) -> dict[str, Any]:
    """Write ``request_<scheduler>.txt`` (and ``appdef.json``) to ``launch.dryrun_dir``.

    Args:
        cfg: The job config (reads ``launch``).
        app: The TorchX AppDef (None for ``launch.scheduler: local``, whose request is the
            torchrun command line).
        config_path: The job config file the workers would load.
        env: The job's environment.

    Raises:
        LaunchCheckError: After writing, if the remote checks find problems (the message
            names the files and each setting to change).

    Returns:
        The dry-run training summary: ``dryrun``, ``scheduler``, ``request_file``,
        ``appdef_file`` (or None), ``final_step`` (None: nothing trained).
    """
    launch = cfg.launch
    folder = Path(launch.dryrun_dir)
    folder.mkdir(parents=True, exist_ok=True)
    request = folder / f"request_{launch.scheduler}.txt"
    appdef_file = None
    if app is None or launch.scheduler == LOCAL_SCHEDULER:
        request.write_text(
            shlex.join(torchrun_command(launch, config_path, loopback=True)) + "\n",
            encoding="utf-8",
        )
    else:
        with signals_restored(), get_runner() as runner:
            info = with_secret_ref(dryrun_info(runner, app, launch), launch.scheduler_args)
        request.write_text(render_request(info, env) + "\n", encoding="utf-8")
        appdef_file = folder / "appdef.json"
        appdef_file.write_text(appdef_json(app, env) + "\n", encoding="utf-8")
    check_remote_launch(
        cfg, env, intro=f"dry run written to {folder}, but {launch.scheduler} would refuse it"
    )
    return {
        "dryrun": True,
        "scheduler": launch.scheduler,
        "request_file": str(request),
        "appdef_file": str(appdef_file) if appdef_file else None,
        "final_step": None,
    }
