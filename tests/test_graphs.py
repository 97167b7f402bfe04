"""The CUDA-graph path (static buffers, batch padded with finished rows, KV-span masks) changes nothing.

CPU cannot capture CUDA graphs; ``TLTConfig(cuda_graphs="static")`` runs the same static-buffer path without
capturing, which is what these tests check, with EAGLE-3 feature taps too. Capture and replay themselves are
exercised on a GPU by ``benchmarks/gpu_check.py``; the self-check of each capture against the eager pass, and its
fallback, are tested with a faked capture in tests/test_gpu_self_check.py.
"""

import pytest
import torch
from test_engine_greedy import staggered_eos, train_drafter
from test_engine_sampling import NEW_TOKENS, PROMPT, SAMPLES, _pad, hf_samples, two_sample_pvalue
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import BlockDrafter, Eagle3Drafter, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout.graphs import graph_bucket


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", logit_scale=4.0)
    return model, train_drafter(model, steps=60)


def runs_with_runner(engine, **kwargs):
    """generate() and the graph runner it used for the policy's passes (its ``step_replays``: whole steps replayed
    from step graphs)."""
    rollout = engine.start(**kwargs)
    result = rollout.run()
    runner = rollout.graphs
    if runner is not None:
        runner.step_replays = rollout.step_graphs.replays
    return result, runner


@pytest.mark.parametrize("strategy", ["none", "chain:3", "tree:3x2:6", "history:4", "tree:3x2:5+history:3"])
def test_static_graph_path_is_exact_greedy(trained, strategy):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)  # 8 rows finishing at different steps
    eos = staggered_eos(model, ids, mask, 24)
    config = TLTConfig(speculation="never" if strategy == "none" else "always",
                       strategy=None if strategy == "none" else strategy, cuda_graphs="static")
    engine = SpeculativeGenerator(model, None if strategy == "none" else drafter, config)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos,
                  pad_token_id=PAD)
    ours, runner = runs_with_runner(engine, **kwargs)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos,
                               pad_token_id=PAD)
    assert torch.equal(ours.sequences, reference)
    assert runner is not None and runner.replays + runner.step_replays > 0
    if "+" not in strategy:  # whole steps traced (the first one catches up eagerly)
        assert runner.step_replays > 0
    else:  # a tree merged with history: eager steps, the policy's pass from the graph runner
        assert runner.replays > 0
    # Steps at 7, 6, 5 or 3 rows ran padded (to 8 or 4) with finished rows, through the same graph shapes.
    assert {r.batch_size for r in ours.stats.trace} - {1, 2, 4, 8}, "the test needs padded steps"
    assert {key[0] for key in runner.graphs} <= {1, 2, 4, 8}  # (bucket, tokens per row, KV span)


def test_static_graph_path_sliding_window_model():
    model = tiny_model("gemma2", logit_scale=4.0)
    drafter = train_drafter(model, steps=30)
    ids, mask = padded_prompts([3, 7, 5], seed=17)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="tree:3x2:5",
                                                            cuda_graphs="static"))
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                           pad_token_id=PAD)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                               pad_token_id=PAD)
    assert torch.equal(ours.sequences, reference)


def test_static_graph_path_with_eagle3_feature_taps():
    """An EAGLE-3 drafter reads the residual streams entering three layers: the graph path taps them too (they are
    static outputs of a captured graph) and hands the drafter and the feature sink what the eager path does."""
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5])
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)  # 8 rows: bucket 8 from the first step
    runs = {}
    for graphs in ("off", "static"):
        sink = []
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                                cuda_graphs=graphs))
        result, runner = runs_with_runner(engine, input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=16, eos_token_id=EOS, pad_token_id=PAD,
                                          feature_sink=lambda seq, feats, sink=sink: sink.append((seq, feats)))
        runs[graphs] = result, runner, sink
    (eager, _, eager_sink), (static, runner, static_sink) = runs["off"], runs["static"]
    assert runner is not None and runner.feature_layers == (1, 3, 5) and runner.step_replays > 0
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                               pad_token_id=PAD)
    assert torch.equal(static.sequences, reference) and torch.equal(eager.sequences, reference)
    assert len(static_sink) == len(eager_sink) == len(ids)
    for (seq, feats), (eager_seq, eager_feats) in zip(static_sink, eager_sink, strict=True):
        assert torch.equal(seq, eager_seq) and feats.shape[-1] == 3 * model.config.hidden_size
        torch.testing.assert_close(feats, eager_feats, rtol=1e-5, atol=1e-5)
    assert static.stats.accepted_tokens == eager.stats.accepted_tokens  # the drafter saw the same features


@pytest.mark.parametrize("strategy", ["tree:3x2:5", "chain:4", "block:3"])
def test_static_graph_path_sampling_distribution(strategy):
    """Traced whole steps draw their uniforms from one buffer per step (UniformStream): the law stays generate's."""
    model = tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3)
    torch.manual_seed(11)
    drafter = (BlockDrafter.from_target(model, block_size=4) if strategy.startswith("block")
               else EagleDrafter.from_target(model))
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy,
                                                            cuda_graphs="static"))
    ids = PROMPT.expand(SAMPLES, -1)
    res = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.9, top_k=0,
                          eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(51))
    reference = hf_samples(model, seed=52, temperature=0.9)
    assert two_sample_pvalue(reference, _pad(res.sequences[:, PROMPT.shape[1]:])) > 1e-3
    assert engine._graph_session.step_graphs.replays > 0  # the steps after the first were traced


def test_graphs_only_on_cuda_by_default(trained):
    model, drafter = trained
    ids, mask = padded_prompts([3, 4], seed=1)
    _, runner = runs_with_runner(SpeculativeGenerator(model, drafter, TLTConfig()), input_ids=ids,
                                 attention_mask=mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    assert runner is None  # CPU: eager, nothing to capture
    assert [graph_bucket(b) for b in (1, 2, 3, 5, 9, 64)] == [1, 2, 4, 8, 16, 64]
    with pytest.raises(ValueError, match="cuda_graphs"):
        TLTConfig(cuda_graphs="yes")
