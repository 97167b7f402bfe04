"""The engine's few-row CPU linear path: same products as ``F.linear``, scoped to the engine's forward."""

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from tlt_trainers.rollout.target import FEW_ROWS, TargetModel, _few_row_linear


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
    linears = target._few_row_linears.linears
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
