"""The training loop run by every torchrun worker.

Per optimizer step: ``grad_accum_steps`` micro-batches (forward, cross-entropy + MoE
auxiliary loss + weighted multi-token-prediction loss (``mtp.py``), backward of loss / accumulation), gradient clipping by the global norm,
a check that loss and norm are finite, the optimizer and LR-schedule steps, then the
MoE bias update from the expert load summed over data-parallel ranks. Metrics (rank 0),
validation and checkpoints follow at their configured intervals.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from titan_kedro.data.token_store import read_token_metadata
from titan_kedro.ft.identity import data_shard, restarted_group
from titan_kedro.models.parallel import autocast_dtype, training_dtypes
from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.tracking.mlflow_logger import MlflowMetricsSink
from titan_kedro.train.checkpoint.manager import (
    CheckpointManager,
    ModelState,
    rng_state,
    set_rng_state,
)
from titan_kedro.train.device import env_int, init_process_group, resolve_device, set_cpu_threads
from titan_kedro.train.documents import document_inputs, masking_bos_id
from titan_kedro.train.faults import maybe_crash
from titan_kedro.train.fused_loss import (
    FusedOutputLoss,
    defer_output_projection,
    uses_fused_loss,
)
from titan_kedro.train.grad_clip import clip_grad_norm_
from titan_kedro.train.hf_init import load_hf_weights
from titan_kedro.train.metrics import (
    MetricsLogger,
    expert_load_stats,
    memory_metrics,
    peak_tflops,
)
from titan_kedro.train.mtp import mtp_loss, mtp_loss_weight
from titan_kedro.train.parallel_dims import ParallelDims
from titan_kedro.train.run_identity import checkpoint_metadata
from titan_kedro.train.validation import capped_batches, mean_loss, perplexity

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; training stopped before the bad update."""


@dataclass
class TrainState(Stateful):
    """Counters that a checkpoint restores."""

    step: int = 0
    tokens_seen: int = 0
    last_loss: float = float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "last_loss": self.last_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.last_loss = float(state_dict["last_loss"])


def build_model(spec: Any, model_args: Any, seed: int, device: torch.device) -> nn.Module:
    """Build on the meta device, allocate on ``device`` and initialise under ``seed``.

    Every rank runs the same initialisation, so the weights are identical before sharding.
    """
    with torch.device("meta"):
        model = spec.build_model(model_args)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


class Trainer:
    """One worker's share of a training job (every rank builds one).

    Args:
        resolved: The validated config, train spec and model args.
    """

    def __init__(self, resolved: ResolvedJob):
        self.cfg = cfg = resolved.config
        self.spec = resolved.spec
        self.model_args = resolved.model_args
        self.device = resolve_device(cfg.training.device, env_int("LOCAL_RANK", 0))
        init_process_group(self.device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size != cfg.launch.world_size:
            raise ValueError(
                f"torchrun started {self.world_size} workers but launch.nproc_per_node × "
                f"launch.nnodes = {cfg.launch.world_size}; pass --launch.nproc_per_node and "
                "--launch.nnodes matching the torchrun command (they set the batch layout)"
            )
        if self.device.type == "cpu":
            threads = set_cpu_threads(
                cfg.training.num_threads, env_int("LOCAL_WORLD_SIZE", self.world_size)
            )
            logger.info("CPU threads per worker: %d", threads)
        torch.use_deterministic_algorithms(cfg.training.deterministic, warn_only=True)

        self.parallel_dims = ParallelDims.from_config(cfg, self.world_size, self.device)
        self.parallel_dims.build_mesh()
        self.dp_group = self.parallel_dims.dp_mesh.get_group()

        model = build_model(self.spec, self.model_args, cfg.job.seed, self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.loss_fn = self.spec.build_loss_fn(cfg)
        self.fused_loss = uses_fused_loss(cfg, self.spec, model)
        try:
            tokens_meta = read_token_metadata(cfg.data.token_dir)
        except FileNotFoundError:  # token files written by hand: no fingerprints, no BOS
            tokens_meta = {}
        self.document_bos = masking_bos_id(cfg, model, tokens_meta)
        # Recorded in every checkpoint's metadata.json; fixed for the whole run.
        self.run_metadata = checkpoint_metadata(cfg, tokens_meta)
        if self.fused_loss:
            self.loss_fn = FusedOutputLoss(
                defer_output_projection(model), compile=cfg.training.compile
            )
        self.model = self.spec.parallelize_fn(model, self.parallel_dims, cfg)
        self.model.train()
        # Mixed precision once: by FSDP's policy when sharded, else by autocast (one rank).
        self.autocast_dtype = autocast_dtype(self.model, cfg, self.device)
        self.model_parts = [self.model]
        self.optimizers = self.spec.build_optimizers_fn(self.model_parts, cfg)
        self.lr_schedulers = self.spec.build_lr_schedulers_fn(self.optimizers, cfg)
        # Different per rank so any sampling differs across ranks; restored on resume.
        torch.manual_seed(cfg.job.seed + 1 + self.rank)

        from titan_kedro.data.loader import TokenLoader
        from titan_kedro.data.token_store import open_split

        self._token_loader_cls = TokenLoader
        # With replica groups, each group reads its own share of the global order.
        data_rank, data_degree = data_shard(
            cfg, self.parallel_dims.dp_rank, self.parallel_dims.dp_degree
        )
        self.train_loader = TokenLoader(
            open_split(cfg.data.token_dir, "train"),
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            dp_rank=data_rank,
            dp_degree=data_degree,
            seed=cfg.job.seed,
            name="train",
        )
        self._train_iter = iter(self.train_loader)
        self.val_tokens = None
        if cfg.validation.freq:
            self.val_tokens = open_split(cfg.data.token_dir, "validation")
            # Too few held-out tokens fail now, not mid-run.
            self.val_batches = capped_batches(
                cfg.validation.steps,
                self._validation_loader().batches_per_epoch,
                "validation.steps",
            )

        self.state = TrainState()
        self.stateful: dict[str, Stateful] = {
            "model": ModelState(self.model_parts),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
            "train_state": self.state,
        }
        self.checkpointer = CheckpointManager(
            cfg.checkpoint.folder,
            self.stateful,
            per_rank_state=self._per_rank_state,
            restore_per_rank=self._restore_per_rank,
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            enable=cfg.checkpoint.enable,
        )
        self.resumed_from: Path | None = None
        resume = self.checkpointer.resolve_resume(
            cfg.checkpoint.resume, restarted=env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0
        )
        if resume is not None:
            self.checkpointer.load(resume)
            self.resumed_from = resume
            logger.info("resumed from %s at step %d", resume, self.state.step)
        elif cfg.checkpoint.initial_load_hf:  # a fresh run continues from published weights
            load_hf_weights(
                self.model_parts, self.spec, self.model_args, cfg.checkpoint.initial_load_hf
            )

        seq_len = cfg.training.seq_len
        flops = self.spec.flops_per_token
        self.flops_per_token = (
            float(flops(self.model_args, seq_len)) if flops else 6.0 * self.n_params
        )
        self.tokens_per_step_local = cfg.training.local_batch_size * seq_len * cfg.grad_accum_steps
        self.tokens_per_step_global = cfg.global_batch_size * seq_len
        self.metrics: MetricsLogger | None = None
        self.peak_tflops = 0.0
        if self.rank == 0:
            compute_dtype = training_dtypes(cfg, self.device)[0]
            self.peak_tflops = peak_tflops(self.device, compute_dtype, cfg.metrics.peak_tflops)
            self.metrics = MetricsLogger(
                cfg.job.dump_folder,
                cfg.training.steps,
                start_step=self.state.step,
                mlflow=MlflowMetricsSink.from_env(cfg.metrics.enable_mlflow),
                append=self.resumed_from is not None or restarted_group(),
                run_id=cfg.job.run_id,
            )
        self.ft = None  # the other replica groups (fault_tolerance.enable), after the logger
        if cfg.fault_tolerance.enable:
            from titan_kedro.ft.replica import ReplicaGroupFT

            self.ft = ReplicaGroupFT(
                cfg,
                self.device,
                group_rank=self.rank,
                state_dict=self._live_state,
                load_state_dict=self._load_live_state,
                start_step=self.state.step,
            )

    def _live_state(self) -> dict[str, Any]:
        """What a restarted replica group receives from a live one (no RNG: it is per rank)."""
        state = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return {**state, "dataloader": self.train_loader.state_dict()}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        for name, obj in self.stateful.items():
            obj.load_state_dict(state[name])
        self.train_loader.load_state_dict(state["dataloader"])
        self._train_iter = iter(self.train_loader)

    def _per_rank_state(self) -> dict[str, Any]:
        return {"dataloader": self.train_loader.state_dict(), "rng": rng_state()}

    def _restore_per_rank(self, state: dict[str, Any], same_world: bool = True) -> None:
        self.train_loader.load_state_dict(state["dataloader"])  # a global position
        self._train_iter = iter(self.train_loader)
        if same_world:
            set_rng_state(state["rng"])
        else:
            torch.manual_seed(self.cfg.job.seed + 1 + self.rank)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = next(self._train_iter)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def mixed_precision(self) -> torch.autocast:
        """Autocast to ``autocast_dtype`` for forward passes (disabled when None)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone().float()
        dist.all_reduce(value, group=self.dp_group)
        value = value / self.parallel_dims.dp_degree
        return value if self.ft is None else self.ft.replica_mean(value)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its metrics."""
        model = self.model
        accum = self.cfg.grad_accum_steps
        if self.ft is not None:  # the quorum (and healing) before any batch is drawn
            self.ft.begin_step()
            data_at_start = self.train_loader.state_dict()
        has_moe = hasattr(model, "expert_load")
        if has_moe:
            model.reset_expert_load()
        self.optimizers.zero_grad()
        data_time = 0.0
        ce_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        mtp_sum = torch.zeros((), device=self.device)
        has_mtp = False
        for _ in range(accum):
            start = time.perf_counter()
            inputs, labels = self._next_batch()
            data_time += time.perf_counter() - start
            with self.mixed_precision():
                output = model(inputs, **document_inputs(inputs, self.document_bos))
                ce = self.loss_fn(output, labels)
                mtp = mtp_loss(model, self.loss_fn, labels)
            loss = ce
            if mtp is not None:
                has_mtp = True
                loss = loss + mtp_loss_weight(self.cfg) * mtp
                mtp_sum += mtp.detach().float()
            if hasattr(model, "moe_aux_loss"):
                aux = model.moe_aux_loss()
                loss = loss + aux
                aux_sum += aux.detach().float()
            (loss / accum).backward()
            ce_sum += ce.detach().float()
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        if self.ft is not None:
            self.ft.average_gradients(params)
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm)
        loss_value = float(self._dp_mean(ce_sum / accum))
        if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):
            last = self.checkpointer.last_saved
            raise NonFiniteLossError(
                f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient norm'} at "
                f"step {self.state.step + 1} (loss={loss_value}, grad_norm={float(grad_norm)}); "
                f"no update was applied. Last good checkpoint: {last or 'none'} (it stays the "
                "latest; lower optimizer.lr or raise lr_scheduler.warmup_steps and resume)"
            )
        lr = self.optimizers.param_groups[0]["lr"]
        # Every reduction happens before the commit vote, so all groups run the same ones.
        aux_value = (
            float(self._dp_mean(aux_sum / accum)) if hasattr(model, "moe_aux_loss") else None
        )
        mtp_value = float(self._dp_mean(mtp_sum / accum)) if has_mtp else None
        if has_moe:
            load = model.expert_load().detach().float().to(self.device)
            dist.all_reduce(load, group=self.dp_group)
            if self.ft is not None:
                self.ft.replica_sum(load)
        if self.ft is not None and not self.ft.should_commit():
            self.train_loader.load_state_dict(data_at_start)  # the retry reads the same batch
            self._train_iter = iter(self.train_loader)
            return {}
        self.optimizers.step()
        self.lr_schedulers.step()
        metrics: dict[str, Any] = {
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "data_time_s": data_time,
        }
        if mtp_value is not None:
            metrics["mtp_loss"] = mtp_value
        if aux_value is not None:
            metrics["moe_aux_loss"] = aux_value
        if has_moe:
            model.update_expert_bias(load)
            metrics.update(expert_load_stats(load))
        return metrics

    def _validation_loader(self) -> Any:
        cfg = self.cfg
        return self._token_loader_cls(
            self.val_tokens,
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            dp_rank=self.parallel_dims.dp_rank,
            dp_degree=self.parallel_dims.dp_degree,
            seed=cfg.job.seed,
            name="validation",
        )

    def validate(self) -> dict[str, float]:
        """Mean loss over ``validation.steps`` held-out batches (the same batches every time).

        Every rank scores its share of the batches; the mean is over all of them.
        """
        with self.mixed_precision():
            val_loss, _ = mean_loss(
                self.model,
                self._validation_loader(),
                self.loss_fn,  # takes the model's hidden states under the fused loss
                n_batches=self.val_batches,
                device=self.device,
                group=self.dp_group,
                bos_id=self.document_bos,
            )
        return {"val_loss": val_loss, "val_perplexity": perplexity(val_loss)}

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train up to ``training.steps``; returns the summary (also written by rank 0).

        Args:
            stop_at: Stop after this step (with a checkpoint) instead of ``training.steps``;
                the schedule still spans ``training.steps``, so a later run resumes it.
        """
        cfg = self.cfg
        last_step = min(stop_at or cfg.training.steps, cfg.training.steps)
        start_time = time.perf_counter()
        if self.metrics is not None:
            self.metrics.echo(
                f"training {self.spec.name}/{cfg.model.flavor}: {self.n_params / 1e6:.2f}M params, "
                f"world {self.world_size} ({self.device.type}), global batch "
                f"{cfg.global_batch_size} × {cfg.training.seq_len} tokens, "
                f"{cfg.grad_accum_steps} micro-batch(es)/step, steps {self.state.step + 1}–"
                f"{cfg.training.steps}"
                + (f", resumed from {self.resumed_from}" if self.resumed_from else "")
            )
            if self.ft is None or self.ft.logs_run_constants:
                self.metrics.log_once({"peak_tflops": self.peak_tflops}, step=self.state.step)
        step_metrics: dict[str, Any] = {}
        while self.state.step < last_step:
            maybe_crash(self.state.step + 1, self.rank)
            step_start = time.perf_counter()
            step_metrics = self.train_step()
            if not step_metrics:  # a fault-tolerant step that was not committed
                continue
            step = self.state.step + 1  # after train_step: healing may have moved it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_time = time.perf_counter() - step_start
            self.state.step = step
            leader = self.ft is None or self.ft.is_leader
            if self.ft is not None:
                step_metrics.update(self.ft.step_metrics())
                share = step_metrics["ft/participants"] / self.cfg.replica_groups
                self.state.tokens_seen += round(self.tokens_per_step_global * share)
            else:
                self.state.tokens_seen += self.tokens_per_step_global
            self.state.last_loss = step_metrics["loss"]
            if cfg.validation.freq and (
                step % cfg.validation.freq == 0 or step == cfg.training.steps
            ):
                step_metrics.update(self.validate())
            if self.metrics is not None and leader:
                if (
                    step % cfg.metrics.log_freq == 0
                    or step == cfg.training.steps
                    or "val_loss" in step_metrics
                ):
                    tps = self.tokens_per_step_local / step_time
                    tflops = tps * self.flops_per_token / 1e12
                    step_metrics.update(
                        step_time_s=step_time,
                        tps=tps,
                        tflops=tflops,
                        mfu_pct=100.0 * tflops / self.peak_tflops if self.peak_tflops else 0.0,
                        **memory_metrics(self.device),
                        tokens_seen=self.state.tokens_seen,
                    )
                    self.metrics.log(step, step_metrics)
                self.metrics.advance()
            if (step % cfg.checkpoint.interval == 0 or step == last_step) and leader:
                self.checkpointer.save(step, {"loss": self.state.last_loss, **self.run_metadata})
        summary = {
            "checkpoint_dir": str(self.checkpointer.last_saved)
            if self.checkpointer.last_saved
            else None,
            "final_step": self.state.step,
            "final_loss": self.state.last_loss,
            "tokens_seen": self.state.tokens_seen,
            "wall_time_s": time.perf_counter() - start_time,
        }
        if self.ft is not None:  # lets anyone check that the groups ended in lock-step
            self.ft.write_state_digest(Path(cfg.job.dump_folder) / "ft", self.rank, self.state.step)
        if self.rank == 0 and (self.ft is None or self.ft.is_leader):
            write_summary(cfg.job.dump_folder, summary)
        return summary

    def close(self) -> None:
        """Close the progress bar and leave the process group."""
        if self.metrics is not None:
            self.metrics.close()
        if self.ft is not None:
            self.ft.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def write_summary(dump_folder: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically (NaN becomes null)."""
    path = Path(dump_folder) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in summary.items()
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
