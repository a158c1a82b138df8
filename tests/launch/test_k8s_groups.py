"""The one-job-per-group plan rendered for Kubernetes, with the lighthouses behind a Service."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_torchx_launch import SCHEDULER_ARGS, shared_job

from titan_kedro.config import build_job_config, dump_job_config
from titan_kedro.launch import launch_job, prepare_job


def test_a_kubernetes_dry_run_renders_a_job_per_group_and_the_lighthouse_service(
    tmp_path: Path,
) -> None:
    job = shared_job(tmp_path, scheduler="kubernetes", nnodes=2, dryrun=True,
                     dryrun_dir=str(tmp_path / "dryrun"))  # fmt: skip
    job["launch"]["scheduler_args"] = SCHEDULER_ARGS["kubernetes"]
    job["job"] = {**job.get("job", {}), "name": "run"}
    job["fault_tolerance"] = {"enable": True, "replica_groups": 2, "min_replicas": 1}
    job["metrics"] = {**job["metrics"], "enable_mlflow": False}
    cfg = prepare_job(build_job_config(job), {})
    summary = launch_job(cfg, dump_job_config(cfg, tmp_path / "job.yaml"), {})
    deployment, service = yaml.safe_load_all(Path(summary["lighthouse_file"]).read_text())
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    assert service["metadata"] == {"name": "run-lighthouse", "namespace": "ml",
                                   "labels": {"app": "run-lighthouse"}}  # fmt: skip
    assert [p["port"] for p in service["spec"]["ports"]] == [29510, 29511]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/titan-kedro:1"
    assert "min_replicas=2" in container["command"][2]  # the startup barrier needs both
    address = "http://run-lighthouse.ml.svc.cluster.local"
    for g in (0, 1):
        app = json.loads((tmp_path / "dryrun" / f"appdef_group{g}.json").read_text())
        (role,) = app["roles"]
        assert app["name"] == f"run-group{g}" and role["num_replicas"] == 2
        assert role["env"]["TITAN_KEDRO_REPLICA_ID"] == str(g)
        assert role["env"]["TORCHFT_LIGHTHOUSE"] == f"{address}:29510"
        assert role["env"]["TITAN_KEDRO_FT_STARTUP"] == f"{address}:29511"
        request = (tmp_path / "dryrun" / f"request_kubernetes_group{g}.txt").read_text()
        assert f"run-group{g}" in request and "mlflow-credentials" in request
    job["launch"]["dryrun"] = False  # applying it is not built: refused
    with pytest.raises(ValueError, match=r"launch\.dryrun renders the plan"):
        build_job_config(job)
