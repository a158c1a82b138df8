"""Write a trained model as a Hugging Face folder that ``AutoModelForCausalLM`` loads.

Generic over train specs: the spec's ``state_dict_adapter`` maps the weight names and
builds the transformers config; this module writes ``config.json``,
``generation_config.json``, ``model.safetensors`` (or shards plus an index), the
tokenizer files and a model card, into a fresh sibling folder that replaces the target
only when complete, and only when the target is a previous export (``export_folder``).
``compare_logits`` loads the folder back with transformers and measures how far its
logits are from ours.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from titan_kedro.models import export_folder
from titan_kedro.models.export_remote import publish_export
from titan_kedro.storage import is_remote
from titan_kedro.storage.folders import download_folder

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def require_adapter(spec: Any) -> Any:
    """The spec's ``state_dict_adapter``.

    Raises:
        ValueError: The spec has none (the model family has no Hugging Face counterpart).
    """
    if spec.state_dict_adapter is None:
        raise ValueError(
            f"model '{spec.name}' has no Hugging Face counterpart: its train spec defines no "
            "state_dict_adapter; drop export_hf from the run or add an adapter to the spec"
        )
    return spec.state_dict_adapter


def hf_state_dict(
    model: nn.Module, spec: Any, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names, on CPU, contiguous, with no shared storage.

    Raises:
        ValueError: The spec has no ``state_dict_adapter`` (no Hugging Face counterpart).
    """
    adapter = require_adapter(spec)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in adapter.to_hf(model.state_dict()).items():
        tensor = value.detach().to(device="cpu", dtype=dtype).contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def hf_config(
    spec: Any, args: Any, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None
) -> Any:
    """The spec's transformers config for ``args``, with architecture, dtype and control ids."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = require_adapter(spec).hf_config_from_args(args)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture and not getattr(config, "architectures", None):
        config.architectures = [architecture]
    config.dtype = dtype
    if bos_id is not None:
        config.bos_token_id = bos_id
    if eos_id is not None:
        config.eos_token_id = eos_id
    return config


def _write_weights(
    tensors: Mapping[str, torch.Tensor], folder: Path, max_shard_bytes: int
) -> list[Path]:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    metadata = {"format": "pt"}
    if total <= max_shard_bytes:
        save_file(dict(tensors), str(folder / SAFETENSORS_FILE), metadata=metadata)
        return [folder / SAFETENSORS_FILE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    written, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=metadata)
        written.append(folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    index_file = folder / SAFETENSORS_INDEX
    index_file.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
        encoding="utf-8",
    )
    return [*written, index_file]


def _write_export(
    model: nn.Module,
    spec: Any,
    args: Any,
    staging: Path,
    *,
    tokenizer: Any,
    model_card: str | None,
    dtype: torch.dtype,
    max_shard_gib: float,
) -> list[Path]:
    from transformers import GenerationConfig

    bos_id = getattr(tokenizer, "bos_id", None)
    eos_id = getattr(tokenizer, "eos_id", None)
    config = hf_config(spec, args, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
    config.save_pretrained(staging)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(staging)
    written = [staging / "config.json", staging / "generation_config.json"]
    written += _write_weights(
        hf_state_dict(model, spec, dtype), staging, int(max_shard_gib * 2**30)
    )
    if tokenizer is not None:
        written += [Path(p) for p in tokenizer.save(staging)]
    if model_card is not None:
        (staging / "README.md").write_text(model_card, encoding="utf-8")
        written.append(staging / "README.md")
    return written


def export_hf_folder(
    model: nn.Module,
    spec: Any,
    args: Any,
    folder: str | Path,
    *,
    tokenizer: Any = None,
    model_card: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_gib: float = 5.0,
) -> list[Path]:
    """Write ``model`` as a Hugging Face model folder, replacing ``folder`` atomically.

    Args:
        model: Our model (unsharded), e.g. from ``load_checkpoint_model``.
        spec: Its ``TrainSpec``; ``spec.state_dict_adapter`` does the mapping.
        args: Its model args (``vocab_size`` is the padded embedding size, which is what
            the config must say).
        folder: Target folder (created; a previous export there is replaced, anything else
            is refused, see ``export_folder``).
        tokenizer: Anything with ``save(folder)``, ``bos_id`` and ``eos_id`` (our
            ``Tokenizer``); None exports weights only.
        model_card: Text of ``README.md``.
        dtype: Weight dtype on disk.
        max_shard_gib: Split the weights into shards of at most this size.

    Returns:
        The files written, relative paths resolved under ``folder``.

    Raises:
        export_folder.ExportFolderError: ``folder`` exists and is not a previous export (it has no
            export marker, or holds entries its marker does not list); nothing is deleted.
    """
    require_adapter(spec)
    if is_remote(folder):  # written here, then published object by object, marker last
        with tempfile.TemporaryDirectory(prefix="titan-kedro-hf-export-") as tmp:
            staging = Path(tmp)
            _write_export(
                model, spec, args, staging, tokenizer=tokenizer, model_card=model_card,
                dtype=dtype, max_shard_gib=max_shard_gib,
            )  # fmt: skip
            return publish_export(staging, str(folder))
    target = Path(folder)
    staging = export_folder.new_staging(target)
    try:
        written = _write_export(
            model,
            spec,
            args,
            staging,
            tokenizer=tokenizer,
            model_card=model_card,
            dtype=dtype,
            max_shard_gib=max_shard_gib,
        )
        export_folder.swap_in(staging, target)
    except BaseException:
        export_folder.discard(staging)
        raise
    return [target / p.relative_to(staging) for p in written]


@torch.no_grad()
def compare_logits(
    folder: str | Path, model: nn.Module, tokens: Sequence[Sequence[int]] | torch.Tensor
) -> float:
    """Largest absolute logit difference between the exported folder and ``model``.

    Loads the folder with ``AutoModelForCausalLM`` in float32 with eager attention, on CPU.
    """
    from transformers import AutoModelForCausalLM

    if is_remote(folder):
        folder = download_folder(str(folder))
    batch = torch.as_tensor(tokens, dtype=torch.long)
    if batch.ndim == 1:
        batch = batch[None]
    hf = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ours = model(batch.to(device)).float().cpu()
    finally:
        model.train(was_training)
    theirs = hf(batch).logits.float()
    if theirs.shape != ours.shape:
        raise ValueError(
            f"exported model gives logits {tuple(theirs.shape)}, ours {tuple(ours.shape)}; "
            "the config's vocab_size must be the model's (padded) embedding size"
        )
    return float((theirs - ours).abs().max())


def model_card(facts: Mapping[str, Any], *, title: str) -> str:
    """A short README: what the model is and how it was trained, as a Markdown table."""
    rows = "\n".join(f"| {key} | {value} |" for key, value in facts.items() if value is not None)
    return (
        f"# {title}\n\n"
        "Pretrained with Titan Kedro (Kedro pipelines + torchrun, FSDP2 / expert parallelism).\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n'
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")\n'
        "```\n\n"
        "| | |\n| --- | --- |\n"
        f"{rows}\n"
    )
