"""What a step would cost a GPU, counted on the CPU: device-to-host reads per step and graph captures per call.

A GPU step stalls at every value read back to the host and relaunches at every op outside a graph replay; the CPU
has neither cost but ``StepProbe`` counts them (tlt_trainers/rollout/step_probe.py). These tests hold the engine to
one read per step (two on a step where rows finish: which ones, and their lengths) for every strategy, and to zero
graph captures in a second call with the same shapes, with the output still exactly ``model.generate``'s.
"""

import numpy as np
import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import BlockDrafter, Eagle3Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout.step_probe import StepProbe, graph_region, host_buffer


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", logit_scale=4.0, num_hidden_layers=4)


def test_probe_counts_reads_and_graph_regions():
    """The probe is what the other tests trust: every kind of read is counted, ops in a graph region are not eager."""
    x = torch.arange(6.0)
    with StepProbe() as probe:
        int(x.sum())
        bool(x.max() > 2)
        x.nonzero()
        x.tolist()
        with graph_region():
            y = x * 2 + 1
        y.view(2, 3)  # a view launches nothing; sum, max, gt, nonzero and the two scalar reads do
    counts = probe.counts
    assert counts.host_reads == 4, counts.reads_by_op
    assert counts.graph_ops == 2 and counts.eager_ops == 6, (counts.graph_ops, counts.eager_by_op)
    assert torch.Tensor.tolist.__name__ == "tolist"  # the patch is undone on exit


HOST_COPIES = {
    "tolist": lambda x: x.tolist(),
    "cpu": lambda x: x.cpu(),
    "numpy": lambda x: x.numpy(),
    "array": lambda x: np.asarray(x),
    "to('cpu')": lambda x: x.to("cpu"),
    "to(device='cpu')": lambda x: x.to(device="cpu"),
    "to('cpu', dtype)": lambda x: x.to("cpu", torch.float16),
    "copy_ into a host buffer": lambda x: host_buffer(torch.empty(6)).copy_(x),
}
NOT_HOST_COPIES = {
    "to(dtype)": lambda x: x.to(torch.float16),
    "to(x.device)": lambda x: x.to(x.device),
    "to(other tensor)": lambda x: x.to(torch.zeros(1, dtype=torch.float64)),
    "copy_ into a device buffer": lambda x: torch.empty(6).copy_(x),
}


def probed(call):
    """The probe's counts for ``call`` on a host tensor of 6 values."""
    x = torch.arange(6.0)
    with StepProbe() as probe:
        call(x)
    return probe.counts


@pytest.mark.parametrize("name", list(HOST_COPIES))
def test_probe_counts_each_copy_to_the_host(name):
    """Each way to copy a tensor to the host is one read: on a GPU each waits for the device (issue 54)."""
    counts = probed(HOST_COPIES[name])
    assert counts.host_reads == 1, counts.reads_by_op


@pytest.mark.parametrize("name", list(NOT_HOST_COPIES))
def test_probe_leaves_casts_and_device_copies_uncounted(name):
    counts = probed(NOT_HOST_COPIES[name])
    assert counts.host_reads == 0, counts.reads_by_op
    assert torch.Tensor.copy_.__name__ == "copy_" and torch.Tensor.to.__name__ == "to"  # unpatched on exit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device-to-host copy needs a device (runs on the GPU)")
def test_probe_counts_a_copy_from_the_device_into_any_host_tensor():
    x = torch.arange(6.0, device="cuda")
    with StepProbe() as probe:
        torch.empty(6).copy_(x)
        x.to(torch.device("cpu"))
        torch.empty(6, pin_memory=True).copy_(x, non_blocking=True)
    assert probe.counts.host_reads == 3, probe.counts.reads_by_op


def step_reads(engine, ids, mask, **kwargs) -> list[tuple[int, bool]]:
    """(host reads, rows finished at this step) for each step of one call after the prefill."""
    rollout = engine.start(ids, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD, **kwargs)
    steps = []
    with StepProbe() as probe:
        rollout.begin()
        probe.take()
        more = True
        while more:
            before = rollout.rows.size
            more = rollout.step()
            steps.append((probe.take().host_reads, rollout.rows.size < before))
    result = rollout.finish()
    return steps, result


@pytest.mark.parametrize("strategy", ["none", "chain:4", "tree:3x2:6", "block:3", "history:4",
                                      "tree:3x2:5+history:3"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_one_read_per_step(model, strategy, do_sample):
    torch.manual_seed(0)
    drafter = None
    if strategy.startswith("block"):
        drafter = BlockDrafter.from_target(model, block_size=4)
    elif strategy not in ("none", "history:4"):
        drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[0, 1, 3])
    config = TLTConfig(speculation="never" if strategy == "none" else "always",
                       strategy=None if strategy == "none" else strategy, cuda_graphs="static",
                       history_drafting="history" in strategy)
    engine = SpeculativeGenerator(model, drafter, config)
    ids, mask = padded_prompts([5, 3, 8, 2], seed=3)
    ids = torch.cat([ids, ids])  # siblings: history proposes from the first rows' answers
    mask = torch.cat([mask, mask])
    kwargs = dict(max_new_tokens=20, do_sample=do_sample, temperature=1.0, top_k=0,
                  generator=torch.Generator().manual_seed(1))
    step_reads(engine, ids, mask, **kwargs)  # history to draw from, graphs to reuse
    steps, result = step_reads(engine, ids, mask, **kwargs)
    assert len(steps) > 3
    steady = [reads for reads, retired in steps if not retired]
    retiring = [reads for reads, retired in steps if retired]
    assert steady and max(steady) == 1, steps
    assert not retiring or max(retiring) == 2, steps
    if strategy != "none":
        assert result.stats.draft_tokens > 0


@pytest.mark.parametrize("strategy", ["none", "chain:4", "tree:3x2:6", "block:3", "history:4"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_traced_step_launches_nothing_outside_its_graph(model, strategy, do_sample):
    """Plain steps, EAGLE-3 chains and trees, block drafts and history chains run whole inside a graph region (and
    greedy, equal model.generate's tokens): outside it only the one read, a history step's copy of its drafts into
    the graph's buffer, and at T=1 the
    one launch that fills the step's uniforms (``torch.rand(out=...)``: its resize_ and uniform_), except on the
    first step (the drafter catches up on the prompt), the first traced one (it allocates the uniforms' buffer of
    its bucket) and steps where rows finish."""
    torch.manual_seed(0)
    drafter = (BlockDrafter.from_target(model, block_size=4) if strategy.startswith("block") else
               Eagle3Drafter.from_target(model, aux_layer_ids=[0, 1, 3]))
    history = strategy.startswith("history")
    engine = SpeculativeGenerator(model, None if history else drafter,
                                  TLTConfig(speculation="never" if strategy == "none" else "always",
                                            strategy=None if strategy == "none" else strategy, cuda_graphs="static",
                                            history_drafting=history))
    ids, mask = padded_prompts([5, 3, 8, 2], seed=3)
    if history:  # an earlier rollout of the same prompts to propose from
        engine.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=do_sample, eos_token_id=EOS,
                        pad_token_id=PAD, generator=torch.Generator().manual_seed(2))
    rollout = engine.start(ids, attention_mask=mask, max_new_tokens=24, do_sample=do_sample, eos_token_id=EOS,
                           pad_token_id=PAD, generator=torch.Generator().manual_seed(1))
    steady = []
    with StepProbe() as probe:
        rollout.begin()
        probe.take()
        step, more = 0, True
        while more:
            before = rollout.rows.size
            more = rollout.step()
            counts = probe.take()
            if step >= 2 and rollout.rows.size == before:
                steady.append(counts)
            step += 1
    result = rollout.finish()
    if not do_sample:
        reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=EOS,
                                   pad_token_id=PAD)
        assert torch.equal(result.sequences, reference)
    assert len(steady) >= (2 if history else 4)  # history greedy: the earlier rollout predicts whole answers
    allowed = ({"resize_", "uniform_"} if do_sample else set()) | ({"lift_fresh", "_to_copy", "copy_"} if history
                                                                    else set())
    for counts in steady:
        assert counts.host_reads == 1 and set(counts.eager_by_op) <= allowed, counts
        assert counts.graph_ops > 0
    assert rollout.step_graphs.replays >= len(steady)


def test_graphs_persist_across_calls_and_stay_exact(model):
    """A second call with the same shapes prepares no graph shape; calls with other prompts reuse the cache and
    graphs and still match generate(); a larger batch bucket, or re-allocated policy parameters, start a new set."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[0, 1, 3])
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                            cuda_graphs="static"))

    def call(lengths, seed):
        ids, mask = padded_prompts(lengths, seed=seed)
        rollout = engine.start(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=EOS,
                               pad_token_id=PAD)
        runner = rollout.graphs
        prepared = runner.shapes_prepared + rollout.step_graphs.shapes_prepared
        rollout.begin()
        while rollout.step():
            pass
        result = rollout.finish()
        assert rollout.step_graphs.replays > 0
        reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                                   pad_token_id=PAD)
        assert torch.equal(result.sequences, reference)
        return runner, runner.shapes_prepared + rollout.step_graphs.shapes_prepared - prepared

    first, prepared = call([3, 7, 5, 2], seed=4)
    assert prepared > 0
    second, prepared = call([3, 7, 5, 2], seed=4)  # the same shapes at every step
    assert second is first and prepared == 0
    other, _ = call([6, 2, 4, 7], seed=5)  # other tokens and lengths: the same cache, stale slots masked
    assert other is first
    third, _ = call([3, 7, 5, 2, 4, 6, 1, 8], seed=6)  # batch 8: a bigger bucket, a new session
    assert third is not first
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.load_state_dict(state, assign=True)  # the same values in new memory: graphs would read the old one
    fourth, prepared = call([3, 7, 5, 2, 4, 6, 1, 8], seed=6)
    assert fourth is not third and prepared > 0


def test_a_second_rollout_at_once_gets_its_own_cache(model):
    """Two rollouts of one engine driven step by step in turn (as benchmarks interleave) must not share a cache."""
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never", cuda_graphs="static"))
    ids, mask = padded_prompts([3, 5], seed=8)
    other_ids, other_mask = padded_prompts([4, 2], seed=9)
    rollouts = [engine.start(i, attention_mask=m, max_new_tokens=12, do_sample=False, eos_token_id=EOS,
                             pad_token_id=PAD) for i, m in ((ids, mask), (other_ids, other_mask))]
    for r in rollouts:
        r.begin()
    assert rollouts[0].rows.cache is not rollouts[1].rows.cache
    active = list(rollouts)
    while active:
        active = [r for r in active if r.step()]
    for (i, m), r in zip(((ids, mask), (other_ids, other_mask)), rollouts, strict=True):
        reference = model.generate(i, attention_mask=m, do_sample=False, max_new_tokens=12, eos_token_id=EOS,
                                   pad_token_id=PAD)
        assert torch.equal(r.finish().sequences, reference)
