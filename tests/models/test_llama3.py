"""Llama 3: flavors, the model contract, parameter counts and FLOPs per token."""

from __future__ import annotations

import pytest
import torch

from titan_kedro.models import get_train_spec
from titan_kedro.models.common import Llama3RopeScaling, precompute_freqs_cis
from titan_kedro.models.counting import count_parameters
from titan_kedro.models.llama3 import Llama3Args, llama3_flops_per_token, llama3_param_count

SPEC = get_train_spec("llama3")


def small_args(**overrides: object) -> Llama3Args:
    """The debug flavor with a small vocabulary, so tests build it in milliseconds."""
    return SPEC.resolve_args("debugmodel", {"vocab_size": 512, "n_layers": 2, **overrides})


def test_8b_flavor_has_8_03b_parameters_on_meta() -> None:
    args = SPEC.flavors["8B"]
    assert (args.vocab_size, args.dim, args.n_layers) == (128256, 4096, 32)
    assert (args.n_heads, args.n_kv_heads, args.ffn_hidden_dim) == (32, 8, 14336)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == Llama3RopeScaling(factor=8.0, original_max_position_embeddings=8192)
    with torch.device("meta"):
        model = SPEC.build_model(args)
    counts = count_parameters(model)
    # Embedding + output 2·128256·4096; per block: q,o 2·4096² + k,v 2·4096·1024
    # + SwiGLU 3·4096·14336 + two norms 2·4096; final norm 4096.
    per_block = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * 128256 * 4096 + 32 * per_block + 4096
    assert counts.total == expected == 8_030_261_248
    assert counts.embedding == 128256 * 4096
    assert counts.active == counts.total
    assert llama3_param_count(args)["total"] == counts.total


def test_debugmodel_matches_the_deepseek_tokenizer_and_runs_on_cpu() -> None:
    args = SPEC.flavors["debugmodel"]
    assert args.vocab_size == 102400
    assert args.kv_heads < args.n_heads  # exercises grouped-query attention
    torch.manual_seed(0)
    model = SPEC.build_model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (2, 16, 102400)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert count_parameters(model).total == llama3_param_count(args)["total"]


def test_model_follows_the_contract() -> None:
    args = small_args()
    model = SPEC.build_model(args)
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert list(model.layers) == ["0", "1"]
    assert model.tok_embeddings.num_embeddings == 512
    assert model.output.out_features == 512
    assert model.norm.weight.shape == (args.dim,)


def test_bf16_cast_keeps_rotary_table_complex_and_logits_float32() -> None:
    torch.manual_seed(0)
    model = SPEC.build_model(small_args()).eval()
    tokens = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        reference = model(tokens)
        model.to(torch.bfloat16)
        logits = model(tokens)
    assert model.freqs_cis.dtype == torch.complex64
    assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0.05)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = SPEC.build_model(small_args()).eval()
    tokens = torch.randint(0, 512, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_construction_is_deterministic_under_a_seed() -> None:
    torch.manual_seed(3)
    first = SPEC.build_model(small_args()).state_dict()
    torch.manual_seed(3)
    second = SPEC.build_model(small_args()).state_dict()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


def test_init_weights_after_to_empty_from_meta() -> None:
    args = small_args()
    with torch.device("meta"):
        model = SPEC.build_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(
        model.freqs_cis,
        precompute_freqs_cis(args.head_size, args.max_seq_len, args.rope_theta, args.rope_scaling),
    )
    assert torch.equal(model.layers["0"].attention_norm.weight, torch.ones(args.dim))
    # Output projections of deeper blocks start smaller (depth-scaled init).
    std0 = model.layers["0"].attention.wo.weight.std()
    std1 = model.layers["1"].attention.wo.weight.std()
    assert std1 < std0
    assert model.output.weight.abs().max() <= 3 * args.dim**-0.5 + 1e-6
    # A training step moves the weights: the re-initialised model is trainable.
    loss = model(torch.randint(0, 512, (2, 8))).logsumexp(-1).mean()
    loss.backward()
    assert model.tok_embeddings.weight.grad is not None


def test_sequences_beyond_max_seq_len_fail_clearly() -> None:
    model = SPEC.build_model(small_args(max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds the 8 precomputed rotary positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 250}, "dim=250 is not divisible by n_heads=16"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"n_layers": "2"}, "n_layers must be a positive integer, got '2'"),
        ({"rope_scaling": {"factr": 8}}, "rope_scaling: .*factr"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
    ],
)
def test_invalid_args_fail_with_the_field_name(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SPEC.resolve_args("debugmodel", overrides)


def test_rope_scaling_mapping_override_becomes_a_dataclass() -> None:
    args = SPEC.resolve_args("debugmodel", {"rope_scaling": {"factor": 4.0}})
    assert args.rope_scaling == Llama3RopeScaling(factor=4.0)


def test_flops_per_token_by_hand_for_8b() -> None:
    args = SPEC.flavors["8B"]
    seq_len = 8192
    # Non-embedding parameters: 32 blocks of 218,112,000, final norm 4096, output 4096·128256.
    non_embedding = 32 * 218_112_000 + 4096 + 4096 * 128256
    assert non_embedding == 7_504_924_672
    attention = 12 * 32 * 32 * 128 * seq_len  # layers · heads · head_dim · seq_len
    assert llama3_flops_per_token(args, seq_len) == 6 * non_embedding + attention
    assert llama3_flops_per_token(args, seq_len) == 57_914_449_920
    assert SPEC.flops_per_token is llama3_flops_per_token


def test_flops_per_token_grows_linearly_with_seq_len_by_the_attention_term() -> None:
    args = small_args()
    delta = llama3_flops_per_token(args, 200) - llama3_flops_per_token(args, 100)
    assert delta == 12 * args.n_layers * args.n_heads * args.head_size * 100
