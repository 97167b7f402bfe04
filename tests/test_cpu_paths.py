"""The engine's few-row CPU linear path: same products as ``F.linear``, scoped to the engine's forward."""

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from tlt_trainers.rollout.cpu_paths import FEW_ROWS, _few_row_linear
from tlt_trainers.rollout.target import TargetModel


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


def test_gradient_still_flows_through_f_linear():
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    _few_row_linear(layer, x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


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
    """The tiny llama has 4 query heads over 2 K/V heads: the engine's forward must equal the model's, bit for bit
    in attention, with the config back on ``sdpa`` after."""
    from tlt_trainers.rollout.cpu_paths import SDPA_GQA

    model = tiny_model()
    model.config._attn_implementation = "sdpa"
    target = TargetModel(model)
    seen = []
    attn = model.model.layers[0].self_attn
    hook = attn.register_forward_pre_hook(lambda m, args: seen.append(m.config._attn_implementation))
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (3, 7))
    from tlt_trainers.rollout.kv_cache import RowState, WritePlan

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
