"""A copied Kedro project for tests of training mechanics: a small vocabulary, no tokenizer.

Layouts, resume, fault tolerance, Slurm, locks and orphans do not need the DeepSeek
tokenizer's 102,400-row embedding and output tables, which are most of a debugmodel step
on CPU. Such tests run ``kedro run --env <env> --pipelines model_spec,training`` in a
project whose token folder is written directly (``write_token_dir``: ids below
``TINY_DEEPSEEK['vocab_size']`` = 512) and whose conf env trains ``TINY_DEEPSEEK``. The
data, tokenizer, HF-parity, export and end-to-end tests keep the real tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from test_end_to_end import copy_project
from train.helpers import TINY_DEEPSEEK, write_token_dir

SMALL_PARAMS: dict[str, Any] = {
    "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": TINY_DEEPSEEK},
    "training": {"steps": 12, "seq_len": 32, "local_batch_size": 2, "device": "cpu",
                 "num_threads": 1},
    "lr_scheduler": {"warmup_steps": 2},
    "parallelism": {"expert_parallel_degree": 1},
    "launch": {"nproc_per_node": 1},
    "checkpoint": {"interval": 100},
    "validation": {"freq": 0},
    "metrics": {"system_metrics_interval_s": 0, "peak_tflops": 1.0},
}  # fmt: skip
"""The small env's parameters (over conf/base); tests merge their sections over these."""


def small_vocab_project(
    root: Path, env: str, *, model_card: bool = False, **sections: dict[str, Any]
) -> Path:
    """A project copy with written token files and a conf env ``env`` of ``SMALL_PARAMS``.

    Args:
        root: Where the copy goes.
        env: The conf env to write (``conf/<env>/parameters.yml``).
        model_card: Write an empty model card, for runs of the ``training`` pipeline alone.
        **sections: Sections merged key by key over ``SMALL_PARAMS``.
    """
    project = copy_project(root)
    tokens = write_token_dir(project / "data" / "05_model_input" / "tokens")
    if model_card:
        (project / "data" / "06_models" / "model_spec.json").write_text("{}", encoding="utf-8")
    params: dict[str, Any] = {**SMALL_PARAMS, "data": {"token_dir": str(tokens)}}
    for name, values in sections.items():
        params[name] = {**params.get(name, {}), **values}
    folder = project / "conf" / env
    folder.mkdir()
    (folder / "parameters.yml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return project
