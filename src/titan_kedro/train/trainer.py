"""The training loop run by every torchrun worker: the ``Trainer`` builds a worker's model,
data, optimizers, checkpointing and metrics, then loops over optimizer steps.

The step itself (micro-batches, clipping, finite check, optimizer, MoE bias) is
``step.TrainStep``, which the plan measures too; the state plumbing (restored counters,
batch source, per-rank and healing state, ``summary.json``) is ``run_state.py``. Metrics
(rank 0), validation and checkpoints follow each step at their configured intervals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
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
from titan_kedro.models.sharded_init import init_on_shards
from titan_kedro.models.tensor_parallel import loss_context
from titan_kedro.runs.folders import run_folder
from titan_kedro.runs.identity import checkpoint_metadata
from titan_kedro.runs.restarts import job_restarted
from titan_kedro.tracking.mlflow_logger import MlflowMetricsSink
from titan_kedro.train.checkpoint.manager import CheckpointManager, ModelState
from titan_kedro.train.device import env_int, init_process_group, resolve_device, set_cpu_threads
from titan_kedro.train.documents import masking_bos_id
from titan_kedro.train.faults import TestHooks
from titan_kedro.train.hf_init import load_hf_weights
from titan_kedro.train.metrics import MetricsLogger, memory_metrics, peak_tflops, step_counts
from titan_kedro.train.parallel_dims import ParallelDims
from titan_kedro.train.pipeline import PipelineTrainStep, build_model_parts, pipeline_fields
from titan_kedro.train.run_state import (
    TrainBatches,
    TrainState,
    live_state,
    load_live_state,
    per_rank_state,
    restore_per_rank,
    write_summary,
)
from titan_kedro.train.step import NonFiniteLossError, TrainStep
from titan_kedro.train.validation import capped_batches, mean_loss, perplexity

__all__ = ["NonFiniteLossError", "TrainState", "Trainer", "build_model", "write_summary"]

logger = logging.getLogger(__name__)


def build_model(spec: Any, model_args: Any, seed: int, device: torch.device) -> nn.Module:
    """The whole model on one device: built on meta, allocated on ``device`` and
    initialised under ``seed`` (``models/sharded_init``: the values every layout's shards
    hold too)."""
    with torch.device("meta"):
        model = spec.build_model(model_args)
    return init_on_shards(model, seed, device)


class Trainer:
    """One worker's share of a training job (every rank builds one).

    Args:
        resolved: The validated config, train spec and model args.
    """

    def __init__(self, resolved: ResolvedJob):
        self.cfg = cfg = resolved.config
        self.spec = resolved.spec
        self.model_args = resolved.model_args
        self._init_process()
        self.test_hooks = TestHooks.from_env(self.rank)  # read once; off unless switched on
        self.parallel_dims = ParallelDims.from_config(cfg, self.world_size, self.device)
        self.parallel_dims.build_mesh()
        self.dp_group = self.parallel_dims.dp_mesh.get_group()
        self._build_model()
        self.optimizers = self.spec.build_optimizers_fn(self.model_parts, cfg)
        self.lr_schedulers = self.spec.build_lr_schedulers_fn(self.optimizers, cfg)
        # Different per rank so any sampling differs across ranks; restored on resume.
        torch.manual_seed(cfg.job.seed + 1 + self.rank)
        self._build_data()
        self.state = TrainState()
        self.stateful: dict[str, Stateful] = {
            "model": ModelState(self.model_parts),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
            "train_state": self.state,
        }
        self._build_checkpointing()
        self._build_throughput()
        self._build_metrics()
        self.ft = self._build_ft()  # the other replica groups, after the logger
        self.step_fn = (PipelineTrainStep if self.stages else TrainStep)(
            self.model_parts,
            self.loss_fn,
            self.optimizers,
            self.lr_schedulers,
            cfg,
            self.device,
            self.dp_group,
            self.parallel_dims.dp_degree,
            self.batches,
            self.document_bos,
            self.autocast_dtype,
            ft=self.ft,
            mark_data=self.batches.mark,
            failure_context=lambda: (self.state.step, self.checkpointer.last_saved),
            load_group=self.parallel_dims.load_group,
            **pipeline_fields(self.stages, self.parallel_dims),
        )

    def _init_process(self) -> None:
        """Device, process group, world-size check, CPU threads, determinism."""
        cfg = self.cfg
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

    def _build_model(self) -> None:
        """The model on meta, its loss (fused or not), document masking, sharding (this
        rank's pipeline stages under pipeline parallelism, ``train/pipeline``), then this
        rank's shards allocated and initialised (``models/sharded_init``)."""
        cfg = self.cfg
        with torch.device("meta"):  # nothing is allocated before the model is sharded
            model = self.spec.build_model(self.model_args)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.loss_fn = self.spec.build_loss_fn(cfg)
        try:
            tokens_meta = read_token_metadata(cfg.data.token_dir)
        except FileNotFoundError:  # token files written by hand: no fingerprints, no BOS
            tokens_meta = {}
        self.document_bos = masking_bos_id(cfg, model, tokens_meta)
        # Recorded in every checkpoint's metadata.json; fixed for the whole run.
        self.run_metadata = checkpoint_metadata(cfg, tokens_meta)
        self.model_parts, self.loss_fn, self.stages = build_model_parts(
            model, self.spec, self.model_args, self.parallel_dims, cfg=cfg, loss_fn=self.loss_fn
        )
        for part in self.model_parts:  # each rank allocates and initialises its shards only
            init_on_shards(part, cfg.job.seed, self.device)
        self.model = self.model_parts[0]
        self.model.train()
        # Mixed precision once: by FSDP's policy when sharded, else by autocast (one rank).
        self.autocast_dtype = autocast_dtype(self.model, cfg, self.device)

    def _build_data(self) -> None:
        """The training batches (this rank's share) and the held-out split."""
        from titan_kedro.data.loader import TokenLoader
        from titan_kedro.data.token_store import open_split

        cfg = self.cfg
        self._token_loader_cls = TokenLoader
        # With replica groups, each group reads its own share of the global order.
        data_rank, data_ranks = data_shard(
            cfg, self.parallel_dims.dp_rank, self.parallel_dims.dp_degree
        )
        self.train_loader = TokenLoader(
            open_split(cfg.data.token_dir, "train"),
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            data_rank=data_rank,
            data_ranks=data_ranks,
            seed=cfg.job.seed,
            name="train",
        )
        self.batches = TrainBatches(self.train_loader, self.device)
        self.val_tokens = None
        if cfg.validation.freq:
            self.val_tokens = open_split(cfg.data.token_dir, "validation")
            # Too few held-out tokens fail now, not mid-run.
            self.val_batches = capped_batches(
                cfg.validation.steps,
                self._validation_loader().batches_per_epoch,
                "validation.steps",
            )

    def _build_checkpointing(self) -> None:
        """The checkpoint manager, then a resume (or the initial HF weights of a fresh run)."""
        cfg = self.cfg
        self.checkpointer = CheckpointManager(
            cfg.checkpoint.folder,
            self.stateful,
            per_rank_state=lambda: per_rank_state(self.batches),
            restore_per_rank=self._restore_per_rank,
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            enable=cfg.checkpoint.enable,
        )
        self.resumed_from: Path | None = None
        # A torchrun restart or a Slurm requeue continues its own latest checkpoint.
        resume = self.checkpointer.resolve_resume(cfg.checkpoint.resume, restarted=job_restarted())
        if resume is not None:
            self.checkpointer.load(resume)
            self.resumed_from = resume
            logger.info("resumed from %s at step %d", resume, self.state.step)
        elif cfg.checkpoint.initial_load_hf:  # a fresh run continues from published weights
            load_hf_weights(
                self.model_parts, self.spec, self.model_args, cfg.checkpoint.initial_load_hf
            )

    def _restore_per_rank(self, state: dict[str, Any], same_world: bool = True) -> None:
        reseed = self.cfg.job.seed + 1 + self.rank
        restore_per_rank(self.batches, state, same_world=same_world, reseed=reseed)

    def _build_throughput(self) -> None:
        """FLOPs per token and tokens per step of this rank (``metrics.step_counts``)."""
        counts = step_counts(self.spec, self.model_args, self.cfg.layout, self.cfg.training.seq_len)
        self.flops_per_token, self.tokens_per_step_local, self.tokens_per_step_global = counts

    def _build_metrics(self) -> None:
        """Rank 0's metrics logger and the device's peak TFLOP/s (others log nothing)."""
        cfg = self.cfg
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

    def _build_ft(self) -> Any:
        """The replica groups' seam when ``fault_tolerance.enable``, else None."""
        if not self.cfg.fault_tolerance.enable:
            return None
        from titan_kedro.ft.replica import ReplicaGroupFT

        return ReplicaGroupFT(
            self.cfg,
            self.device,
            group_rank=self.rank,
            state_dict=lambda: live_state(self.stateful, self.batches),
            load_state_dict=lambda state: load_live_state(self.stateful, self.batches, state),
            start_step=self.state.step,
            degraded_step_delay_s=self.test_hooks.degraded_step_delay_s,
        )

    def mixed_precision(self) -> torch.autocast:
        """Autocast to ``autocast_dtype`` for forward passes (disabled when None)."""
        return self.step_fn.mixed_precision()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its metrics."""
        return self.step_fn()

    def _validation_loader(self) -> Any:
        cfg = self.cfg
        return self._token_loader_cls(
            self.val_tokens,
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            data_rank=self.parallel_dims.dp_rank,  # every group validates the same batches
            data_ranks=self.parallel_dims.dp_degree,
            seed=cfg.job.seed,
            name="validation",
        )

    def validate(self) -> dict[str, float]:
        """Mean loss over ``validation.steps`` held-out batches (the same batches every time).

        Every rank scores its share of the batches; the mean is over all of them.
        """
        if self.stages:  # through the pipeline schedule (train/pipeline/step.py)
            val_loss = self.step_fn.evaluate(self._validation_loader(), self.val_batches)
            return {"val_loss": val_loss, "val_perplexity": perplexity(val_loss)}
        with self.mixed_precision(), loss_context(self.cfg.layout.tp)():
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

    def _leads(self) -> bool:
        """Whether this rank's group logs, checkpoints and writes the summary: always without
        replica groups, else the group with replica rank 0 in this step's quorum. Within the
        group only rank 0 logs and writes (``self.metrics`` is rank 0's)."""
        return self.ft is None or self.ft.is_leader

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train up to ``training.steps``; returns the summary (also written by rank 0).

        The last step of the run (``training.steps``, or ``stop_at``) always validates (when
        ``validation.freq``), logs its metrics row and saves a checkpoint.

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
                f"{cfg.layout.global_batch_size} × {cfg.training.seq_len} tokens, "
                f"{cfg.layout.grad_accum_steps} micro-batch(es)/step, steps {self.state.step + 1}–"
                f"{cfg.training.steps}"
                + (f", resumed from {self.resumed_from}" if self.resumed_from else "")
            )
            if self.ft is None or self.ft.logs_run_constants:
                self.metrics.log_once({"peak_tflops": self.peak_tflops}, step=self.state.step)
        step_metrics: dict[str, Any] = {}
        leader = self._leads()  # updated by every step (its quorum) and read at the end
        crash_at = self.test_hooks.crash_at_step
        while self.state.step < last_step:
            if self.state.step + 1 == crash_at:
                self.test_hooks.crash(crash_at, self.rank)
            step_start = time.perf_counter()
            step_metrics = self.train_step()
            if not step_metrics:  # a fault-tolerant step that was not committed
                continue
            step = self.state.step + 1  # after train_step: healing may have moved it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_time = time.perf_counter() - step_start
            self.state.step = step
            leader = self._leads()
            final = step == last_step  # the last step of this run, stopped early or not
            if self.ft is not None:
                step_metrics.update(self.ft.step_metrics())
                share = step_metrics["ft/participants"] / self.cfg.replica_groups
                self.state.tokens_seen += round(self.tokens_per_step_global * share)
            else:
                self.state.tokens_seen += self.tokens_per_step_global
            self.state.last_loss = step_metrics["loss"]
            if cfg.validation.freq and (step % cfg.validation.freq == 0 or final):
                step_metrics.update(self.validate())
            if self.metrics is not None and leader:
                if step % cfg.metrics.log_freq == 0 or final or "val_loss" in step_metrics:
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
            if self.checkpointer.due(step, cfg.checkpoint.interval, final) and leader:
                meta = replace(self.run_metadata, loss=float(self.state.last_loss))
                self.checkpointer.save(step, meta)
        summary = {
            "checkpoint_dir": str(self.checkpointer.last_saved)
            if self.checkpointer.last_saved
            else None,
            "final_step": self.state.step,
            "final_loss": self.state.last_loss,
            "tokens_seen": self.state.tokens_seen,
            "wall_time_s": time.perf_counter() - start_time,
        }
        if self.ft is not None and self.test_hooks.state_digest:  # groups end in lock-step
            self.ft.write_state_digest(Path(cfg.job.dump_folder) / "ft", self.rank, self.state.step)
        if self.rank == 0 and leader:
            write_summary(run_folder(cfg.job.dump_folder, cfg.job.run_id), summary)
        return summary

    def close(self) -> None:
        """Close the progress bar and leave the process group."""
        if self.metrics is not None:
            self.metrics.close()
        if self.ft is not None:
            self.ft.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
