"""The train-spec registry: registration, lookup, flavors/overrides and custom-model import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from titan_kedro.config import ConfigError
from titan_kedro.models import (
    TrainSpec,
    get_train_spec,
    import_custom_model,
    list_train_specs,
    register_train_spec,
)
from titan_kedro.models import registry as registry_module
from titan_kedro.models.llama3 import LLAMA3_SPEC, Llama3Args, Llama3Model
from titan_kedro.models.resolve import resolve_job_config

REPO = Path(__file__).resolve().parents[2]
USER_MODULE_PREFIX = "user_models_"


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Undo every registration and custom-module import a test makes."""
    before = dict(registry_module._REGISTRY)
    modules = set(sys.modules)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(before)
    for name in set(sys.modules) - modules:
        if name.startswith(("titan_kedro_custom_", USER_MODULE_PREFIX)):
            del sys.modules[name]


def _spec(name: str) -> TrainSpec:
    return TrainSpec(name=name, model_cls=nn.Linear, flavors={})


def _write_module(folder: Path, stem: str, body: str) -> Path:
    path = folder / f"{stem}.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


REGISTERS = """
    from torch import nn
    from titan_kedro.models import TrainSpec, register_train_spec

    register_train_spec(TrainSpec(name="{name}", model_cls=nn.Linear, flavors={{}}))
"""


def test_builtin_specs_are_registered() -> None:
    names = list_train_specs()
    assert {"llama3", "deepseek_v2"} <= set(names)
    assert get_train_spec("llama3") is LLAMA3_SPEC
    assert LLAMA3_SPEC.model_cls is Llama3Model
    assert set(LLAMA3_SPEC.flavors) == {"debugmodel", "8B"}
    for name in registry_module.BUILTIN_SPECS:
        assert get_train_spec(name).name == name


def test_builtin_packages_are_imported_on_their_first_lookup_only() -> None:
    script = """
import sys
from titan_kedro.models import get_train_spec, list_train_specs
packages = ("titan_kedro.models.llama3", "titan_kedro.models.deepseek_v2")
assert {"llama3", "deepseek_v2"} <= set(list_train_specs())
assert not [p for p in packages if p in sys.modules], sorted(sys.modules)
get_train_spec("llama3")
assert "titan_kedro.models.llama3" in sys.modules
assert "titan_kedro.models.deepseek_v2" not in sys.modules
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_a_builtin_name_is_taken_before_its_first_lookup() -> None:
    registry_module._REGISTRY.pop("llama3", None)
    with pytest.raises(ValueError, match="'llama3' is already registered"):
        register_train_spec(_spec("llama3"))
    assert get_train_spec("llama3") is LLAMA3_SPEC


def test_a_builtin_entry_that_names_no_train_spec_fails_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = {**registry_module.BUILTIN_SPECS, "broken": "titan_kedro.models.llama3:Llama3Args"}
    monkeypatch.setattr(registry_module, "BUILTIN_SPECS", table)
    with pytest.raises(TypeError, match=r"BUILTIN_SPECS\['broken'\].*is not a TrainSpec"):
        get_train_spec("broken")


def test_train_spec_is_frozen_and_holds_every_part() -> None:
    names = {f.name for f in dataclasses.fields(TrainSpec)}
    assert {
        "name",
        "model_cls",
        "flavors",
        "extensions",
        "parallelize_fn",
        "build_optimizers_fn",
        "build_lr_schedulers_fn",
        "build_loss_fn",
        "state_dict_adapter",
        "flops_per_token",
        "validate_config_fn",
    } <= names
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA3_SPEC.name = "renamed"  # type: ignore[misc]


def test_registering_a_duplicate_name_fails_and_keeps_the_first() -> None:
    first = register_train_spec(_spec("dup_model"))
    with pytest.raises(ValueError, match="'dup_model' is already registered"):
        register_train_spec(_spec("dup_model"))
    assert get_train_spec("dup_model") is first


def test_unknown_name_lists_the_registered_specs() -> None:
    with pytest.raises(ValueError) as err:
        get_train_spec("llama4")
    message = str(err.value)
    assert "unknown model 'llama4'" in message
    assert "llama3" in message and "deepseek_v2" in message
    assert "custom_model_path" in message


def test_resolve_args_applies_overrides_without_touching_the_flavor() -> None:
    args = LLAMA3_SPEC.resolve_args("debugmodel", {"n_layers": 2, "vocab_size": 512})
    assert isinstance(args, Llama3Args)
    assert (args.n_layers, args.vocab_size, args.dim) == (2, 512, 256)
    assert LLAMA3_SPEC.flavors["debugmodel"].n_layers == 6


def test_resolve_args_rejects_unknown_flavor_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"no flavor '70B'.*\['8B', 'debugmodel'\]"):
        LLAMA3_SPEC.resolve_args("70B")
    with pytest.raises(ValueError, match="'n_layer' \\(did you mean 'n_layers'\\?\\)"):
        LLAMA3_SPEC.resolve_args("debugmodel", {"n_layer": 2})
    with pytest.raises(ValueError, match="n_heads=16 must be a multiple of n_kv_heads=5"):
        LLAMA3_SPEC.resolve_args("debugmodel", {"n_kv_heads": 5})


def test_build_model_instantiates_the_model_class() -> None:
    model = LLAMA3_SPEC.build_model(
        LLAMA3_SPEC.resolve_args("debugmodel", {"vocab_size": 64, "n_layers": 1})
    )
    assert isinstance(model, Llama3Model)
    assert model.output.out_features == 64


def test_custom_path_registers_its_spec_once(tmp_path: Path) -> None:
    path = _write_module(tmp_path, "my_model", REGISTERS.format(name="from_path"))
    assert import_custom_model(path=str(path)) == ["from_path"]
    assert get_train_spec("from_path").model_cls is nn.Linear
    assert import_custom_model(path=str(path)) == []  # already imported: no second registration


def test_custom_dotted_module_registers_its_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_module(tmp_path, f"{USER_MODULE_PREFIX}dotted", REGISTERS.format(name="from_module"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_custom_model(module=f"{USER_MODULE_PREFIX}dotted") == ["from_module"]
    assert "from_module" in list_train_specs()


def test_custom_path_that_does_not_exist_fails_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(
        FileNotFoundError, match=r"model\.custom_model_path .*nope\.py' does not exist"
    ):
        import_custom_model(path=str(missing))


def test_custom_module_that_raises_shows_the_original_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = """
        def helper():
            return 1 / 0

        helper()
    """
    path = _write_module(tmp_path, "broken", body)
    with pytest.raises(ImportError) as err:
        import_custom_model(path=str(path))
    message = str(err.value)
    assert "importing model.custom_model_path" in message
    assert "ZeroDivisionError: division by zero" in message
    assert f'File "{path}", line 3, in helper' in message
    assert isinstance(err.value.__cause__, ZeroDivisionError)

    _write_module(tmp_path, f"{USER_MODULE_PREFIX}broken", body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"(?s)model\.custom_import .*ZeroDivisionError"):
        import_custom_model(module=f"{USER_MODULE_PREFIX}broken")


def test_custom_module_that_registers_nothing_fails(tmp_path: Path) -> None:
    path = _write_module(tmp_path, "empty", "X = 1\n")
    with pytest.raises(ImportError, match=r"registered no train spec.*register_train_spec"):
        import_custom_model(path=str(path))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (None, "does not exist"),
        ("raise RuntimeError('boom in user code')\n", "RuntimeError: boom in user code"),
        ("X = 1\n", "registered no train spec"),
    ],
    ids=["missing", "raises", "registers-nothing"],
)
def test_resolve_job_config_reports_custom_import_failures(
    tmp_path: Path, body: str | None, expected: str
) -> None:
    path = tmp_path / "custom.py"
    if body is not None:
        path.write_text(body, encoding="utf-8")
    raw = {"model": {"name": "custom", "custom_model_path": str(path)}}
    with pytest.raises(ConfigError, match=f"(?s)invalid job config.*{expected}"):
        resolve_job_config(raw)


def test_a_spec_without_flops_per_token_is_refused_at_resolution(tmp_path: Path) -> None:
    """No fallback count: MFU, the plan's cost and the model card all read the spec's."""
    path = _write_module(tmp_path, "no_flops", REGISTERS.format(name="no_flops"))
    raw = {"model": {"name": "no_flops", "custom_model_path": str(path)}}
    with pytest.raises(
        ConfigError,
        match=r"train spec 'no_flops' has no flops_per_token: give its TrainSpec "
        r"flops_per_token=fn, where fn\(model_args, seq_len\)",
    ):
        resolve_job_config(raw)
    spec = get_train_spec("no_flops")  # registered: only resolving (using) it is refused
    with pytest.raises(ValueError, match="'no_flops' has no flops_per_token"):
        spec.training_flops_per_token(None, 16)


def test_resolve_job_config_imports_the_example_and_merges_its_extension() -> None:
    example = REPO / "examples" / "custom_model" / "tiny_gpt.py"
    raw = {"model": {"name": "tiny_gpt", "flavor": "tiny", "custom_model_path": str(example)}}
    resolved = resolve_job_config(raw)
    assert resolved.spec.name == "tiny_gpt"
    assert resolved.model_args.dim == 64
    assert resolved.config.training.label_smoothing == 0.0  # the extension's default
    raw["training"] = {"label_smoothing": 0.1}
    assert resolve_job_config(raw).config.training.label_smoothing == 0.1


def test_failed_import_leaves_no_half_registration_and_can_be_retried(tmp_path: Path) -> None:
    registers = textwrap.dedent(REGISTERS.format(name="half_done"))
    path = _write_module(tmp_path, "half", registers + "\nraise RuntimeError('late failure')\n")
    with pytest.raises(ImportError, match="late failure"):
        import_custom_model(path=str(path))
    assert "half_done" not in list_train_specs()
    _write_module(tmp_path, "half", registers)  # the user fixes the file
    assert import_custom_model(path=str(path)) == ["half_done"]
