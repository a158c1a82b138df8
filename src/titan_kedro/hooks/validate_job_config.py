"""Kedro hook that validates the parameters as a typed job config before anything runs."""

from __future__ import annotations

import logging
from typing import Any

from kedro.framework.hooks import hook_impl

from titan_kedro.models.resolve import resolve_job_config

logger = logging.getLogger(__name__)


class ValidateJobConfigHook:
    """Validate the parameters as a typed job config before any node runs.

    An unknown key, a wrong type or an impossible parallel layout fails here, with the
    key path and a suggestion, instead of minutes into a run.
    """

    dryrun: bool = False

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        resolved = resolve_job_config(
            context.params, source=f"conf/{context.env or 'local'} + --params"
        )
        logger.info(
            "job config OK: model %s/%s, %d steps, world size %d",
            resolved.config.model.name,
            resolved.config.model.flavor,
            resolved.config.training.steps,
            resolved.config.launch.world_size,
        )
        self.dryrun = resolved.config.launch.dryrun

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any) -> None:
        """A dry run trains nothing: refuse nodes that would read its training summary."""
        readers = sorted(n.name for n in pipeline.nodes if "training_summary" in n.inputs)
        if self.dryrun and readers:
            raise ValueError(
                f"launch.dryrun=true trains nothing, but {', '.join(readers)} would read the "
                "training summary; run only up to training: kedro run --pipelines "
                "data_processing,model_spec,training --params launch.dryrun=true"
            )
