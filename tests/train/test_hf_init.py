"""Continued pretraining: a fresh run starts from an exported Hugging Face folder."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.train.helpers import (
    TINY_DEEPSEEK,
    step_losses,
    tiny_job,
    train_on_ranks,
    validation_loader,
    write_token_dir,
)
from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.token_store import open_split
from titan_kedro.models.hf_export import export_hf_folder
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan.fake_world import fake_process_group
from titan_kedro.train import hf_init
from titan_kedro.train.hf_init import HFInitError, check_hf_config, load_hf_weights
from titan_kedro.train.parallel_dims import ParallelDims
from titan_kedro.train.trainer import build_model

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, token_dir: Path, folder: Path | None, **overrides: Any) -> dict[str, Any]:
    return tiny_job(
        tmp_path,
        token_dir,
        model={
            "name": "deepseek_v2",
            "custom_model_path": None,
            "overrides": {**TINY_DEEPSEEK, **overrides},
        },
        training={"steps": 1, "global_batch_size": 4},
        parallelism={"expert_parallel_degree": 2},
        launch={"nproc_per_node": 2},
        checkpoint={"enable": False, "initial_load_hf": str(folder) if folder else None},
    )


def _export(tmp_path: Path, token_dir: Path) -> tuple[Any, torch.nn.Module, Path]:
    resolved = resolve_job_config(_job(tmp_path / "export", token_dir, None))
    # Another seed than the job's, so the run's own initialisation cannot pass for it.
    model = build_model(resolved.spec, resolved.model_args, 123, torch.device("cpu"))
    folder = tmp_path / "hf"
    export_hf_folder(model, resolved.spec, resolved.model_args, folder)
    return resolved, model, folder


@pytest.mark.slow
def test_ep2_run_starts_from_exported_folder_with_its_loss(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=4_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    raw = _job(tmp_path / "run", token_dir, folder)
    train_on_ranks(raw, 2)
    loss = step_losses(raw["job"]["dump_folder"])[1]
    # What each rank reads is checked in-process: test_each_rank_reads_only_its_shards.

    # Step 1's global batch is the first batch of both data-parallel ranks.
    loss_fn = resolved.spec.build_loss_fn(resolved.config)
    tokens = open_split(token_dir, "train")
    batches = [
        next(
            iter(
                TokenLoader(
                    tokens, seq_len=32, local_batch_size=2, data_rank=r, data_ranks=2, seed=7
                )
            )
        )
        for r in range(2)
    ]
    own_init = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    with torch.no_grad():
        expected, unloaded = (
            sum(float(loss_fn(m(inputs), labels)) for inputs, labels in batches) / 2
            for m in (model, own_init)
        )
    assert abs(loss - expected) <= 1e-4, (loss, expected)
    assert abs(loss - unloaded) > 1e-3  # the run's own initialisation would not match


class _Reads:
    """What ``safe_open`` handed out: bytes of every slice read, handles opened and closed."""

    def __init__(self) -> None:
        self.bytes = self.opened = self.closed = 0


@contextmanager
def _counting_reads() -> Iterator[_Reads]:
    """Count the bytes ``hf_init`` reads through safetensors' slices, and its open handles."""
    reads, original = _Reads(), hf_init.safe_open

    def counting_safe_open(*args: Any, **kwargs: Any) -> _CountingHandle:
        reads.opened += 1
        return _CountingHandle(original(*args, **kwargs), reads)

    with mock.patch.object(hf_init, "safe_open", counting_safe_open):
        yield reads


class _CountingHandle:
    def __init__(self, handle: Any, reads: _Reads) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self) -> _CountingHandle:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.reads.closed += 1
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.handle.get_slice(name), self.reads)


class _CountingSlice:
    def __init__(self, part: Any, reads: _Reads) -> None:
        self.part, self.reads = part, reads

    def get_shape(self) -> list[int]:
        return self.part.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        block = self.part[index]
        self.reads.bytes += block.numel() * block.element_size()
        return block


def _weights_bytes(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return sum(
            handle.get_tensor(key).numel() * handle.get_tensor(key).element_size()
            for key in handle.keys()
        )


def test_single_process_load_reproduces_weights(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    target = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    with _counting_reads() as reads:
        read = load_hf_weights([target], resolved.spec, resolved.model_args, folder)
    # One process holds every weight: each stored byte is read once, and the file is closed.
    assert reads.bytes == read == _weights_bytes(folder)
    assert reads.opened == reads.closed == 1
    theirs = target.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    loader = validation_loader(token_dir, seq_len=32, local_batch_size=2, seed=7)
    inputs, _ = next(iter(loader))
    with torch.no_grad():
        assert torch.equal(model(inputs), target(inputs))


def read_as_rank(raw_file: str, folder: str, rank: int) -> dict[str, Any]:
    """Load ``folder`` as ``rank`` of the 2-rank EP job in ``raw_file``; what it read and held.

    Run in a fresh process per rank: DTensor caches sharding results under meshes that
    compare equal whatever this process's rank, so a second fake rank would reuse the first's.
    """
    resolved = resolve_job_config(json.loads(Path(raw_file).read_text(encoding="utf-8")))
    with _counting_reads() as reads, fake_process_group(2, rank):  # no collectives
        dims = ParallelDims.from_config(resolved.config, 2, torch.device("cpu"))
        dims.build_mesh()
        target = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
        target = resolved.spec.parallelize_fn(target, dims, resolved.config)
        load_hf_weights([target], resolved.spec, resolved.model_args, folder)
        loaded = target.state_dict()
    torch.save(
        {k: v.to_local() if isinstance(v, DTensor) else v for k, v in loaded.items()},
        Path(folder).parent / f"rank{rank}.pt",
    )
    sharded = sorted(key for key, value in loaded.items() if isinstance(value, DTensor))
    return {
        "bytes": reads.bytes,
        "opened": reads.opened,
        "closed": reads.closed,
        "sharded": sharded,
    }


def test_each_rank_reads_only_its_shards(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    _, model, folder = _export(tmp_path, token_dir)
    raw_file = tmp_path / "job.json"
    raw_file.write_text(json.dumps(_job(tmp_path / "run", token_dir, folder)), encoding="utf-8")
    exported, stored = model.state_dict(), _weights_bytes(folder)
    ranks = [  # both ranks at once, each in its own process
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import json, sys; from tests.train.test_hf_init import read_as_rank; "
                f"print(json.dumps(read_as_rank({str(raw_file)!r}, {str(folder)!r}, {rank})))",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for rank, proc in enumerate(ranks):
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            result = json.loads(stdout.strip().splitlines()[-1])
            loaded = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
            # In this layout (2 ranks, EP 2, dp_shard 2) every sharded weight is split on dim 0
            # in two contiguous halves: FSDP's row chunks, and the routed experts' EP halves.
            for key in result["sharded"]:
                assert torch.equal(loaded[key], exported[key].chunk(2, dim=0)[rank]), (rank, key)
            # The rest is the routing bias, which Hugging Face has not: zeros, nothing read.
            assert set(loaded) - set(result["sharded"]) == {
                "layers.1.moe.expert_bias",
                "layers.2.moe.expert_bias",
            }
            own = sum(loaded[key].numel() * loaded[key].element_size() for key in result["sharded"])
            assert result["bytes"] == own, (
                rank,
                result["bytes"],
                own,
            )  # nothing outside its shards
            assert 0.45 * stored < own < 0.55 * stored, (own, stored)
            assert result["opened"] == result["closed"] == 1
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_indices_of_a_tensor_sharded_on_two_dims_need_no_whole_tensor() -> None:
    # 5000 × 4000 = 2e7 elements (above the former 2^24 probe limit, where the whole tensor
    # was read): each dim is probed alone, so only this rank's rows and columns are read.
    with fake_process_group(4, 3):
        mesh = init_device_mesh("cpu", (2, 2))
        local = torch.empty(2500, 2000, device="meta")
        tensor = DTensor.from_local(
            local, mesh, [Shard(0), Shard(1)], run_check=False, shape=(5000, 4000),
            stride=(4000, 1),
        )  # fmt: skip
        rows, columns = hf_init._local_indices(tensor)
    assert torch.equal(rows, torch.arange(2500, 5000))
    assert torch.equal(columns, torch.arange(2000, 4000))


def test_config_mismatch_lists_the_differing_fields(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    _, _, folder = _export(tmp_path, token_dir)
    other = resolve_job_config(_job(tmp_path / "o", token_dir, folder, n_routed_experts=4, dim=32))
    with pytest.raises(HFInitError) as err:
        check_hf_config(other.spec, other.model_args, folder)
    message = str(err.value)
    assert "n_routed_experts: folder 8, config 4" in message
    assert "dim: folder 64, config 32" in message
    assert "n_layers" not in message


def test_hub_per_expert_layout_loads_through_lazy_stacks(tmp_path: Path) -> None:
    # Hub checkpoints (DeepSeek-V2-Lite) hold one tensor per routed expert.
    from safetensors.torch import load_file, save_file

    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    fused = load_file(str(folder / "model.safetensors"))
    per_expert = {}
    for key, value in fused.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                per_expert[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                per_expert[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, down in enumerate(value):
                per_expert[f"{prefix}{e}.down_proj.weight"] = down.contiguous()
        else:
            per_expert[key] = value
    (folder / "model.safetensors").unlink()
    save_file(per_expert, str(folder / "model.safetensors"))
    target = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    load_hf_weights([target], resolved.spec, resolved.model_args, folder)
    theirs = target.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key


def test_published_v2_lite_config_matches_the_v2_lite_flavor(tmp_path: Path) -> None:
    import json

    from tests.models.test_deepseek_v2_hf import PUBLISHED
    from titan_kedro.models import get_train_spec

    spec = get_train_spec("deepseek_v2")
    folder = tmp_path / "lite"
    folder.mkdir()
    config = {**PUBLISHED["v2-lite"], "model_type": "deepseek_v2"}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    check_hf_config(spec, spec.resolve_args("v2-lite", {"max_seq_len": 4096}), folder)
    with pytest.raises(HFInitError, match="n_routed_experts: folder 64, config 160"):
        check_hf_config(spec, spec.resolve_args("v2", {}), folder)


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    with pytest.raises(HFInitError, match=r"names files \['\.\./elsewhere\.safetensors'\]"):
        hf_init._weight_files(folder)
