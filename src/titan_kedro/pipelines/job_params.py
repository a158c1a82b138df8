"""Node inputs that hand a node every job-config section as its own parameter.

A node that needs the whole job config takes ``**sections`` and these inputs, rather
than Kedro's ``parameters`` input: kedro-mlflow logs a ``params:<section>`` input under
the same flattened keys (``training.lr``) as ``MlflowRunTagsHook``, whereas
``parameters`` would add a ``parameters.``-prefixed copy of every key to the run.
Train-spec extension fields live inside their sections, so they travel too.
"""

from __future__ import annotations

from collections.abc import Mapping

from titan_kedro.config import JobConfig

JOB_PARAMS: Mapping[str, str] = {name: f"params:{name}" for name in JobConfig.model_fields}
"""Section name → its ``params:`` dataset, for ``Node(..., inputs={**JOB_PARAMS, ...})``."""
