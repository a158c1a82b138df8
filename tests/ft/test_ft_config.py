"""The ``fault_tolerance`` section: refused layouts, the batch it implies, the data shard."""

from __future__ import annotations

import socket

import pytest
import torch
from torchx.specs import macros

from titan_kedro.config import build_job_config
from titan_kedro.ft.identity import replica_data_shard
from titan_kedro.ft.transport import encode_header
from titan_kedro.launch import build_appdef


def _config(**sections: dict) -> object:
    return build_job_config(sections, source="test")


def test_one_group_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="no live peer to keep training or to heal from"):
        _config(fault_tolerance={"enable": True, "replica_groups": 1})


def test_replica_groups_and_hsdp_replicas_are_not_both_above_one() -> None:
    with pytest.raises(ValueError, match="set data_parallel_replicate_degree: 1"):
        _config(
            fault_tolerance={"enable": True, "replica_groups": 2},
            parallelism={"data_parallel_replicate_degree": 2},
            launch={"nproc_per_node": 2},
        )


def test_min_replicas_above_the_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="no step could ever commit"):
        _config(fault_tolerance={"enable": True, "replica_groups": 2, "min_replicas": 3})


@pytest.mark.parametrize(("scheduler", "nnodes"), [("kubernetes", 1), ("local", 2)])
def test_groups_beyond_this_machine_and_slurm_are_refused_with_the_reason(
    scheduler: str, nnodes: int
) -> None:
    with pytest.raises(ValueError, match=r"restart whole jobs, not one replica") as err:
        _config(
            fault_tolerance={"enable": True, "replica_groups": 2},
            launch={"scheduler": scheduler, "nnodes": nnodes, "rdzv_endpoint": "h:1"},
        )
    assert "use launch.scheduler: slurm, or local / local_cwd" in str(err.value)


def test_on_slurm_each_group_is_a_job_of_its_own_nodes() -> None:
    cfg = _config(
        fault_tolerance={"enable": True, "replica_groups": 2},
        launch={"scheduler": "slurm", "nnodes": 2, "nproc_per_node": 2, "log_dir": "/logs"},
        job={"name": "run"},
    )
    app = build_appdef(cfg, "/job.yaml", {"TORCHFT_LIGHTHOUSE": "http://10.0.0.5:1"}, group=1)
    (role,) = app.roles
    assert (app.name, role.num_replicas) == ("run-group1", 2)
    assert role.env["TITAN_KEDRO_REPLICA_ID"] == "1"
    assert role.env["TORCHFT_LIGHTHOUSE"] == "http://10.0.0.5:1"
    line = role.args[1]
    assert "--nnodes=2 --nproc-per-node=2 --max-restarts=0" in line  # the launcher resubmits
    assert "--log-dir=/logs/replica-1" in line and "--rdzv-id '${app_id}'" in line
    assert cfg.launch.continues == 3  # auto_continue is on for a remote scheduler
    assert _config().launch.continues == 0


@pytest.mark.parametrize("bind", ["", "10.0.0.5:29510", "http://10.0.0.5", "a b"])
def test_the_lighthouse_binds_one_address(bind: str) -> None:
    with pytest.raises(ValueError, match=r"lighthouse_bind.*is not an address"):
        _config(fault_tolerance={"lighthouse_bind": bind})
    assert _config(fault_tolerance={"lighthouse_bind": "::1"}).fault_tolerance.lighthouse_bind


def test_the_preflight_refuses_a_lighthouse_the_nodes_cannot_reach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from titan_kedro.launch.lighthouse_check import lighthouse_problems

    def problems(bind: str, nodes: list[str]) -> list[str]:
        cfg = _config(
            fault_tolerance={"enable": True, "replica_groups": 2, "lighthouse_bind": bind},
            launch={"scheduler": "slurm"},
        )
        return lighthouse_problems(cfg, local={"127.0.0.1", "10.0.0.5"}, node_addresses=nodes)

    assert problems("10.0.0.5", ["10.0.0.7"]) == []
    assert problems("127.0.0.1", ["127.0.0.1", "127.0.0.1"]) == []  # the one-host cluster
    (problem,) = problems("127.0.0.1", ["10.0.0.7"])
    assert "nodes 10.0.0.7 are other machines" in problem and "cluster network" in problem
    (problem,) = problems("10.0.0.9", [])
    assert "no address of this machine" in problem and "10.0.0.5" in problem
    with caplog.at_level("WARNING"):
        assert problems("0.0.0.0", ["10.0.0.7"]) == []
    assert "listen on every interface" in caplog.text


def test_the_lighthouses_listen_on_the_bind_address_only() -> None:
    from titan_kedro.ft.lighthouse import Lighthouses

    ft = _config(
        fault_tolerance={"enable": True, "replica_groups": 2, "lighthouse_bind": "127.0.0.1"}
    ).fault_tolerance
    lighthouses = Lighthouses.start(ft)
    try:
        port = int(lighthouses.quorum_address.rsplit(":", 1)[1])
        assert lighthouses.quorum_address == f"http://127.0.0.1:{port}"
        with socket.socket(socket.AF_INET6) as sock:  # not on [::]
            assert sock.connect_ex(("::1", port)) != 0
    finally:
        lighthouses.stop()


def test_a_torchx_job_runs_one_replica_per_group_restarting_itself() -> None:
    cfg = _config(
        fault_tolerance={"enable": True, "replica_groups": 3, "max_group_restarts": 4},
        launch={"scheduler": "local_cwd", "nproc_per_node": 2, "log_dir": "/logs"},
    )
    app = build_appdef(cfg, "/job.yaml", {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"})
    (role,) = app.roles
    assert role.num_replicas == 3
    assert role.env["TITAN_KEDRO_REPLICA_ID"] == "${replica_id}"
    assert role.env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:1"
    assert role.env["GLOO_SOCKET_IFNAME"] == "lo"  # the groups share this machine's loopback
    line = role.args[1]
    assert "--nnodes=1 --nproc-per-node=2 --max-restarts=4" in line
    assert "'--log-dir=/logs/replica-${replica_id}'" in line
    # TorchX fills the replica id in per replica: every group gets its own id and log folder.
    replica_2 = macros.Values(img_root="", app_id="a", replica_id="2", rank0_env="X").apply(role)
    assert replica_2.env["TITAN_KEDRO_REPLICA_ID"] == "2"
    assert "'--log-dir=/logs/replica-2'" in replica_2.args[1]


def test_groups_multiply_the_global_batch_like_hsdp_replicas() -> None:
    ft = _config(
        fault_tolerance={"enable": True, "replica_groups": 3},
        launch={"nproc_per_node": 2},
        training={"local_batch_size": 2, "global_batch_size": 24},
    )
    hsdp = _config(
        parallelism={"data_parallel_replicate_degree": 3},
        launch={"nproc_per_node": 6},
        training={"local_batch_size": 2, "global_batch_size": 24},
    )
    ft_layout, hsdp_layout = ft.layout, hsdp.layout
    assert (ft_layout.data_ranks, ft_layout.grad_accum_steps) == (6, 2)
    assert (hsdp_layout.data_ranks, hsdp_layout.grad_accum_steps) == (6, 2)
    # One group's data-parallel ranks: 2 per replica group, 6 in the HSDP group.
    assert (ft_layout.dp_degree, hsdp_layout.dp_degree) == (2, 6)
    off = _config(fault_tolerance={"enable": False, "replica_groups": 3})
    assert off.layout.data_ranks == 1  # the section is ignored while disabled


def test_groups_read_disjoint_shares_of_the_global_order() -> None:
    shards = [replica_data_shard(g, 3, r, 2) for g in range(3) for r in range(2)]
    assert shards == [(i, 6) for i in range(6)]


def test_the_healing_header_carries_no_pickle_and_refuses_objects() -> None:
    header, tensors = encode_header({"w": torch.ones(2, 3), "step": 4, "name": "x"}, step=4)
    assert b"pickle" not in header and header.startswith(b"{")
    assert [t.shape for t in tensors] == [torch.Size([2, 3])]
    with pytest.raises(TypeError, match="only tensors and JSON scalars"):
        encode_header({"bad": object()}, step=1)


def test_the_throughput_figure_gains_participants_over_time() -> None:
    from titan_kedro.tracking import plots

    rows = [{"step": s, "tps": 10.0, "mfu_pct": 1.0, "ft/participants": p}
            for s, p in ((1, 2.0), (2, 1.0), (3, 1.0), (4, 2.0))]  # fmt: skip
    axes = plots.plot_throughput(rows).axes
    assert len(axes) == 3 and axes[2].get_ylabel() == "replica groups"
    assert list(axes[2].lines[0].get_ydata()) == [2.0, 1.0, 1.0, 2.0]
    plain = [{k: v for k, v in row.items() if k != "ft/participants"} for row in rows]
    assert len(plots.plot_throughput(plain).axes) == 2


def test_the_manager_server_binds_loopback_and_the_swap_is_undone() -> None:
    from datetime import timedelta

    import torchft.manager as manager_module
    from torchft.coordination import LighthouseServer

    from titan_kedro.ft.identity import node_address
    from titan_kedro.ft.replica import _manager_server_on

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = lighthouse.address().rsplit(":", 1)[-1]
    original = manager_module.ManagerServer
    try:
        host = node_address(f"http://127.0.0.1:{port}")  # the node's route to the lighthouse
        assert host == "127.0.0.1"
        with pytest.raises(RuntimeError, match="boom"), _manager_server_on(host):
            server = manager_module.ManagerServer(
                replica_id="probe", lighthouse_addr=f"http://127.0.0.1:{port}",
                hostname="127.0.0.1", bind="[::]:0", store_addr="127.0.0.1:1", world_size=1,
                heartbeat_interval=timedelta(seconds=1), connect_timeout=timedelta(seconds=5),
                quorum_retries=0,
            )  # fmt: skip
            try:
                served = int(server.address().rsplit(":", 1)[-1])
                with socket.socket() as sock:  # listening on 127.0.0.1 …
                    assert sock.connect_ex(("127.0.0.1", served)) == 0
                with socket.socket(socket.AF_INET6) as sock:  # … and not on [::]
                    assert sock.connect_ex(("::1", served)) != 0
            finally:
                server.shutdown()
            raise RuntimeError("boom")
    finally:
        lighthouse.shutdown()
    assert manager_module.ManagerServer is original


def test_each_replica_group_has_its_own_system_metrics_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from titan_kedro.tracking.system_metrics import NodeSystemMetrics

    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.delenv("TITAN_KEDRO_REPLICA_ID", raising=False)
    assert NodeSystemMetrics(1.0).node_id == "node-0"
    monkeypatch.setenv("TITAN_KEDRO_REPLICA_ID", "1")
    assert NodeSystemMetrics(1.0).node_id == "replica-1-node-0"


def test_a_groups_store_is_advertised_at_its_nodes_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from titan_kedro.ft.replica import _store_address

    monkeypatch.setenv("MASTER_ADDR", "localhost")  # a one-node group: the store is here
    assert _store_address("10.0.0.7") == "10.0.0.7"  # not "localhost", which peers misread
    monkeypatch.setenv("MASTER_ADDR", "node-3")  # the group's rank-0 node: torchrun's own
    assert _store_address("10.0.0.7") is None
