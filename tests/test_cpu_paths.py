"""The engine's few-row CPU linear path: same products as ``F.linear``, scoped to the engine's forward."""

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from tlt_trainers.modeling.cpu_paths import FEW_ROWS, _few_row_linear
from tlt_trainers.modeling.target import TargetModel


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, FEW_ROWS, FEW_ROWS + 1])
def test_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        ours = _few_row_linear(layer, x)
        reference = nn.functional.linear(x, layer.weight, layer.bias)
    assert ours.shape == reference.shape and ours.is_contiguous()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    layer = nn.Linear(48, 80)
    x = torch.randn(48, 6).t()
    with torch.no_grad():
        torch.testing.assert_close(_few_row_linear(layer, x), nn.functional.linear(x, layer.weight, layer.bias))


def test_training_keeps_f_linear():
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    out = _few_row_linear(layer, x)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"  # F.linear's own node, not our matmul
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("case", ["additive", "bool", "none_causal", "one_query", "fewer_queries"])
def test_gqa_attention_equals_transformers_sdpa_exactly(case):
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tlt_trainers.modeling.cpu_paths import sdpa_gqa_attention

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q_len = {"one_query": 1, "fewer_queries": 3}.get(case, 6)
    kv_len = 6 if case in ("additive", "bool", "none_causal") else 9
    query = torch.randn(2, q_len, 6, 16).transpose(1, 2)
    key, value = torch.randn(2, 2, kv_len, 16), torch.randn(2, 2, kv_len, 16)
    allowed = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    allowed[0, ..., :2] = False
    mask = {"additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
            "bool": allowed, "none_causal": None}.get(case, allowed)
    ours, _ = sdpa_gqa_attention(module, query, key, value, mask, scaling=0.25)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(ours, reference)


def test_patch_lives_only_inside_the_engine_forward():
    model = tiny_model()
    target = TargetModel(model)
    linears = target._cpu_paths.linears
    assert linears, "the tiny llama has float32 CPU linears"
    seen = []
    hook = linears[0].register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__))
    from tlt_trainers.rollout.costs import _verify_runs

    with torch.no_grad():
        _verify_runs(target, 2, [3], 4)[3]()
    hook.remove()
    assert seen and all(seen)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        ids = torch.arange(5)[None]
        torch.testing.assert_close(target.logits(target.decoder(input_ids=ids).last_hidden_state),
                                   model(input_ids=ids).logits.float())


def test_gqa_attention_is_exact_and_scoped():
    """The tiny llama has 4 query heads over 2 K/V heads: the engine's forward uses our attention and equals the
    model's (to float32 rounding: the linears differ), with the config back on ``sdpa`` after."""
    from tlt_trainers.modeling.cpu_paths import SDPA_GQA

    model = tiny_model()
    assert model.config._attn_implementation == "sdpa"
    target = TargetModel(model)
    seen = []
    attn = model.model.layers[0].self_attn
    hook = attn.register_forward_pre_hook(lambda m, args: seen.append(m.config._attn_implementation))
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (3, 7))
    from tlt_trainers.modeling.kv_cache import RowState, WritePlan

    state = RowState(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    slots = torch.arange(7).expand(3, -1)
    with torch.no_grad():
        mask = target.attention_mask(state, slots, 7)
        cache = target.new_cache(8)
        cache.plan = WritePlan(slots, 7)
        ours = target.forward(ids, slots, mask, cache)
        hook.remove()
        reference = model.model(input_ids=ids).last_hidden_state
    assert seen == [SDPA_GQA]
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_padding_mask_survives_inside_the_context():
    """A decoder call with a 2-D padding mask while the paths are active (another caller of the same policy)
    must build its mask as under ``sdpa``."""
    from tlt_trainers.modeling.cpu_paths import CpuDecodePaths

    model = tiny_model()
    ids = torch.randint(3, 60, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        reference = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        with CpuDecodePaths(model.model, model.config):
            ours = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours[mask.bool()], reference[mask.bool()], rtol=1e-5, atol=1e-5)


def test_nested_and_non_sdpa_models_keep_their_state():
    from tlt_trainers.modeling.cpu_paths import SDPA_GQA, CpuDecodePaths

    model = tiny_model()
    outer, inner = CpuDecodePaths(model.model, model.config), CpuDecodePaths(model.model, model.config)
    linear = model.model.layers[0].mlp.down_proj
    with outer:
        with inner:
            pass
        assert "forward" in linear.__dict__ and model.config._attn_implementation == SDPA_GQA
    assert "forward" not in linear.__dict__ and model.config._attn_implementation == "sdpa"

    model.config._attn_implementation = "eager"
    with CpuDecodePaths(model.model, model.config):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"
