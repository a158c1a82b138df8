"""Export node: a thin wrapper over ``titan_kedro.models.hf_export``."""

from __future__ import annotations

import logging
from typing import Any

import mlflow
import numpy as np
import torch

from titan_kedro.config.schema import ExportSection, TokenizerSection, section_from_params
from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.models import hf_export
from titan_kedro.storage import is_remote
from titan_kedro.storage.folders import download_folder
from titan_kedro.tracking.model_registry import register_hf_folder
from titan_kedro.train.evaluate import LoadedCheckpoint

logger = logging.getLogger(__name__)


def _expert_bias_in_use(model: torch.nn.Module) -> bool:
    return any(
        name.endswith("expert_bias") and bool(torch.count_nonzero(buf))
        for name, buf in model.named_buffers()
    ) or any(
        name.endswith("expert_bias") and bool(torch.count_nonzero(p))
        for name, p in model.named_parameters()
    )


def export_final_model(
    *,
    final_model: LoadedCheckpoint,
    token_files: dict[str, Any],
    tokenizer: dict[str, Any],
    export: dict[str, Any],
    training_summary: dict[str, Any],
    evaluation_results: dict[str, Any],
    reporting_summary: dict[str, Any],
) -> dict[str, Any]:
    """Write the Hugging Face folder, check it against our model, and describe it.

    Consumes ``reporting_summary`` so it runs last; its numbers go into the model card.
    Inside an MLflow run the folder is also registered (``export.registered_model_name``,
    default ``job.name``, with ``export.alias``).

    Returns:
        The export manifest: folder, files, config facts, and the logit comparison.
    """
    resolved = final_model.resolved
    cfg = resolved.config
    settings = section_from_params(ExportSection, export)
    tok = build_tokenizer(section_from_params(TokenizerSection, tokenizer).name_or_path)
    facts = {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "parameters": f"{sum(p.numel() for p in final_model.model.parameters()):,}",
        "embedding rows (vocab_size)": getattr(resolved.model_args, "vocab_size", None),
        "tokenizer": f"{tok.name} ({tok.vocab_size:,} tokens)",
        "training steps": final_model.step,
        "tokens seen": training_summary.get("tokens_seen"),
        "final training loss": reporting_summary.get("final_loss"),
        "validation loss": evaluation_results.get("eval_loss"),
        "validation perplexity": evaluation_results.get("eval_perplexity"),
    }
    folder = settings.folder  # a local path or an object-storage URI (s3://…)
    files = hf_export.export_hf_folder(
        final_model.model,
        resolved.spec,
        resolved.model_args,
        folder,
        tokenizer=tok,
        model_card=hf_export.model_card(facts, title=f"{cfg.job.name}: {facts['model']}"),
        max_shard_gib=settings.max_shard_gib,
    )
    manifest: dict[str, Any] = {
        "folder": str(folder),
        "files": sorted(p.name for p in files),
        "model": facts["model"],
        "checkpoint": str(final_model.path),
        "step": final_model.step,
        "vocab_size": getattr(resolved.model_args, "vocab_size", None),
        "tokenizer_vocab_size": tok.vocab_size,
    }
    mtp_depth = getattr(resolved.model_args, "mtp_depth", 0)
    if mtp_depth:
        manifest["not_exported"] = (
            f"{mtp_depth} multi-token-prediction module(s): transformers does not load MTP "
            "layers, so the folder holds the main model only"
        )
    if settings.verify:
        tokens = np.asarray(token_files["validation"][: settings.verify_tokens], dtype=np.int64)
        diff = hf_export.compare_logits(folder, final_model.model, torch.from_numpy(tokens)[None])
        faithful = diff <= settings.tolerance
        manifest.update(max_abs_logit_diff=diff, tolerance=settings.tolerance, faithful=faithful)
        if faithful:
            logger.info("HF export in %s matches our logits (max |diff| %.2e)", folder, diff)
        else:
            reason = (
                "the aux-loss-free expert bias is not zero and transformers' model has no such "
                "bias, so it routes tokens differently"
                if _expert_bias_in_use(final_model.model)
                else "the state-dict adapter or config mapping is wrong"
            )
            manifest["mismatch_reason"] = reason
            logger.warning(
                "HF export in %s differs from our model: max |logit diff| %.3g > %.1e; %s",
                folder,
                diff,
                settings.tolerance,
                reason,
            )
    if mlflow.active_run() is not None:
        local = download_folder(folder) if is_remote(folder) else folder  # MLflow logs files
        registered = register_hf_folder(
            local, name=settings.registered_model_name or cfg.job.name, alias=settings.alias
        )
        manifest["registered_model"] = registered.to_dict()
    return manifest
