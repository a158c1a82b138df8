"""Evaluation nodes: thin wrappers over ``titan_kedro.train.evaluate`` and ``.validation``."""

from __future__ import annotations

import logging
from typing import Any

from titan_kedro.config.schema import EvaluationSection, TokenizerSection, section_from_params
from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train import evaluate, validation
from titan_kedro.train.documents import masking_bos_id

logger = logging.getLogger(__name__)


def load_final_model(
    training_summary: dict[str, Any], **sections: dict[str, Any]
) -> evaluate.LoadedCheckpoint:
    """The checkpoint training finished with, loaded into a single-process model.

    Args:
        training_summary: The training node's summary (names the final checkpoint).
        **sections: Every job-config section (``pipelines/job_params.JOB_PARAMS``), so
            this node resolves the same config as the hooks and the training node.
    """
    resolved = resolve_job_config(sections)
    path = evaluate.resolve_checkpoint(training_summary, resolved.config.checkpoint.folder)
    loaded = evaluate.load_checkpoint_model(resolved, path, evaluate.evaluation_device(resolved))
    logger.info("loaded %s/%s from %s", resolved.spec.name, resolved.config.model.flavor, path)
    return loaded


def compute_validation_loss(
    final_model: evaluate.LoadedCheckpoint,
    token_files: dict[str, Any],
    evaluation: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mean loss over ``evaluation.batches`` validation batches (the trainer's batch shape).

    Fewer batches are used when the split is smaller, so no window counts twice.

    Returns:
        The results (saved as JSON) and the same numbers as MLflow metrics at the
        checkpoint's step.
    """
    cfg = final_model.resolved.config
    settings = section_from_params(EvaluationSection, evaluation)
    if "validation" not in token_files:
        raise ValueError(
            "the token files have no 'validation' split; set data.validation_fraction > 0 "
            "and re-run data_processing"
        )
    loader = TokenLoader(
        token_files["validation"],
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        data_rank=0,
        data_ranks=1,
        seed=cfg.job.seed,
        name="validation",
    )
    loss_fn = final_model.resolved.spec.build_loss_fn(cfg)
    eval_loss, tokens = validation.mean_loss(
        final_model.model,
        iter(loader),
        loss_fn,
        n_batches=validation.capped_batches(
            settings.batches, loader.batches_per_epoch, "evaluation.batches"
        ),
        bos_id=masking_bos_id(cfg, final_model.model, token_files.get("metadata", {})),
    )
    eval_perplexity = validation.perplexity(eval_loss)
    logger.info(
        "eval_loss %.4f (perplexity %.1f) over %d tokens", eval_loss, eval_perplexity, tokens
    )
    results = {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "checkpoint": str(final_model.path),
        "step": final_model.step,
        "eval_loss": eval_loss,
        "eval_perplexity": eval_perplexity,
        "tokens_evaluated": tokens,
    }
    metrics = {
        "eval_loss": {"value": eval_loss, "step": final_model.step},
        "eval_perplexity": {"value": eval_perplexity, "step": final_model.step},
    }
    return results, metrics


def generate_samples(
    final_model: evaluate.LoadedCheckpoint,
    token_files: dict[str, Any],
    tokenizer: dict[str, Any],
    evaluation: dict[str, Any],
) -> dict[str, Any]:
    """Greedy and top-k continuations of prompts cut from validation documents."""
    name_or_path = section_from_params(TokenizerSection, tokenizer).name_or_path
    settings = section_from_params(EvaluationSection, evaluation)
    tok = build_tokenizer(name_or_path)
    expected = (token_files.get("metadata") or {}).get("tokenizer", {}).get("fingerprint")
    if expected and expected != tok.fingerprint:
        raise ValueError(
            f"tokenizer '{name_or_path}' (fingerprint {tok.fingerprint}) is not the "
            f"one the token files were made with ({expected}); re-run data_processing or set "
            "tokenizer.name_or_path back"
        )
    cfg = final_model.resolved.config
    prompts = evaluate.document_prompts(
        token_files["validation"],
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        count=settings.num_prompts,
        length=settings.prompt_tokens,
    )
    samples = evaluate.sample_generations(
        final_model.model,
        prompts,
        decode=tok.decode,
        max_new_tokens=settings.max_new_tokens,
        top_k=settings.top_k,
        temperature=settings.temperature,
        seed=cfg.job.seed,
        eos_id=tok.eos_id,
        vocab_limit=tok.vocab_size,
        max_context=getattr(final_model.resolved.model_args, "max_seq_len", None),
    )
    for sample in samples:
        logger.info("prompt %r → greedy %r", sample["prompt"], sample["greedy"])
    return {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "checkpoint": str(final_model.path),
        "step": final_model.step,
        "settings": {**evaluation, "seed": cfg.job.seed},
        "samples": samples,
    }
