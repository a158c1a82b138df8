"""MLflow "model from code" for an exported Hugging Face folder (not imported by the package).

MLflow runs this file when it loads the model, so nothing is unpickled: the folder is an
artifact (``hf_folder``) and ``AutoModelForCausalLM`` loads it in float32.
"""

from __future__ import annotations

from typing import Any

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class HFCausalLM(PythonModel):
    """``predict`` takes ``{"input_ids": [[...], ...]}`` (equal lengths) and returns logits
    ``[batch, seq, vocab]`` as float32; ``model`` is the transformers model itself."""

    def load_context(self, context: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            context.artifacts["hf_folder"], dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def predict(self, context, model_input, params=None):
        import torch

        ids = model_input["input_ids"]
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        with torch.no_grad():
            logits = self.model(torch.as_tensor(ids, dtype=torch.long)).logits
        return np.asarray(logits.float().numpy())


mlflow.models.set_model(HFCausalLM())
