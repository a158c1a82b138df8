"""The one-job-per-group plan rendered for Kubernetes (a dry run only; nothing is applied).

``launch.scheduler: kubernetes`` with ``fault_tolerance.enable`` and ``launch.dryrun``
writes, to ``launch.dryrun_dir``:

- ``lighthouse.yaml``: a Deployment running the two TorchFT lighthouses (quorum on port
  29510, startup barrier on 29511) in ``scheduler_args.image``, and a ClusterIP Service in
  front of it, so the groups reach them by a stable cluster-internal name. Inside the pod
  they listen on the pod's address (every interface of the pod); only the Service exposes
  them, within the cluster.
- ``request_kubernetes_group<g>.txt`` and ``appdef_group<g>.json``: TorchX's request for
  each group's job (``build_appdef(..., group=g)``) with ``TORCHFT_LIGHTHOUSE`` and the
  startup barrier pointing at the Service.

Rendered only: no test applies it to a cluster (README "Surviving failures").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from titan_kedro.ft.identity import LIGHTHOUSE_ENV, STARTUP_ENV
from titan_kedro.launch.appdef import build_appdef
from titan_kedro.launch.dryrun import appdef_json
from titan_kedro.launch.runner import get_runner
from titan_kedro.launch.scheduler import dryrun_info, render_request, signals_restored
from titan_kedro.launch.secrets import with_secret_ref

K8S_SCHEDULER = "kubernetes"
QUORUM_PORT = 29510
STARTUP_PORT = 29511
LIGHTHOUSES = """\
import time
from torchft.coordination import LighthouseServer
quorum = LighthouseServer(bind="[::]:{quorum}", min_replicas={min_replicas},
    join_timeout_ms={join_ms}, heartbeat_timeout_ms={heartbeat_ms})
startup = LighthouseServer(bind="[::]:{startup}", min_replicas={groups},
    join_timeout_ms={join_ms}, heartbeat_timeout_ms={join_ms})
while True:
    time.sleep(3600)
"""


def service_name(cfg: Any) -> str:
    """The lighthouse Service's name (``<job.name>-lighthouse``, lower case)."""
    return f"{cfg.job.name}-lighthouse".lower().replace("_", "-")


def lighthouse_manifests(cfg: Any) -> list[dict[str, Any]]:
    """The Deployment and the Service of the run's lighthouses."""
    ft, name = cfg.fault_tolerance, service_name(cfg)
    namespace = cfg.launch.scheduler_args.get("namespace", "default")
    script = LIGHTHOUSES.format(
        quorum=QUORUM_PORT, startup=STARTUP_PORT, min_replicas=ft.min_replicas,
        groups=ft.replica_groups, join_ms=int(ft.join_timeout_s * 1000),
        heartbeat_ms=int(ft.heartbeat_timeout_s * 1000),
    )  # fmt: skip
    labels = {"app": name}
    ports = [{"name": "quorum", "port": QUORUM_PORT}, {"name": "startup", "port": STARTUP_PORT}]
    container = {
        "name": "lighthouse",
        "image": cfg.launch.scheduler_args.get("image", "python"),
        "command": ["python", "-c", script],
        "ports": [{"name": p["name"], "containerPort": p["port"]} for p in ports],
    }
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "selector": labels,
                "ports": [{**p, "targetPort": p["port"]} for p in ports],
            },
        },
    ]


def lighthouse_env(cfg: Any) -> dict[str, str]:
    """The groups' lighthouse variables, pointing at the Service."""
    namespace = cfg.launch.scheduler_args.get("namespace", "default")
    host = f"{service_name(cfg)}.{namespace}.svc.cluster.local"
    return {
        LIGHTHOUSE_ENV: f"http://{host}:{QUORUM_PORT}",
        STARTUP_ENV: f"http://{host}:{STARTUP_PORT}",
    }


def write_group_dryruns(
    cfg: Any, config_path: str | Path, nodes_env: Mapping[str, str], env: Mapping[str, str]
) -> dict[str, Any]:
    """Write the lighthouse manifests and every group's request; the dry-run summary."""
    folder = Path(cfg.launch.dryrun_dir)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "lighthouse.yaml"
    manifest.write_text(yaml.safe_dump_all(lighthouse_manifests(cfg), sort_keys=False))
    requests = []
    with signals_restored(), get_runner() as runner:
        for g in range(cfg.replica_groups):
            app = build_appdef(cfg, config_path, {**nodes_env, **lighthouse_env(cfg)}, group=g)
            info = with_secret_ref(dryrun_info(runner, app, cfg.launch), cfg.launch.scheduler_args)
            request = folder / f"request_kubernetes_group{g}.txt"
            request.write_text(render_request(info, env) + "\n", encoding="utf-8")
            (folder / f"appdef_group{g}.json").write_text(appdef_json(app, env) + "\n")
            requests.append(str(request))
    return {
        "dryrun": True,
        "scheduler": cfg.launch.scheduler,
        "request_file": requests[0],
        "request_files": requests,
        "lighthouse_file": str(manifest),
        "appdef_file": str(folder / "appdef_group0.json"),
        "final_step": None,
    }
