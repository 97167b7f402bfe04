"""The benchmark's fixed-batch sweep (``benchmarks/batch_sweep.py``) on a tiny model: the replayed rows' own answers
are kept out of the adaptive engine's history; the headline pools typical-step times over reps, the best-of-reps
statistic beside it reads each engine's fastest rep."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import SpeculativeGenerator, TLTConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from batch_sweep import (  # noqa: E402
    batch_sweep,
    best_of_reps_ratio,
    pooled_ratio,
    sweep_contexts,
    sweep_summary,
    typical_decode_seconds,
)


def record(rep, engine, seconds, batch=4, temperature=1.0):
    return {"temperature": temperature, "batch": batch, "rep": rep, "engine": engine, "seconds": seconds + 1,
            "decode_seconds": seconds, "typical_decode_seconds": seconds, "steps": 10, "acceptance_length": 1.0,
            "strategies": {"none": 10}}


def test_pooled_ratio_does_not_pick_adaptives_luckiest_call():
    # a lucky long acceptance in rep 2; the other reps lost
    records = [record(0, "no_spec", 1.0), record(0, "adaptive", 1.4), record(1, "no_spec", 1.0),
               record(1, "adaptive", 1.4), record(2, "no_spec", 1.0), record(2, "adaptive", 0.4)]
    assert pooled_ratio(records) == pytest.approx(3.0 / 3.2)
    assert best_of_reps_ratio(records) == pytest.approx(2.5)
    assert sweep_summary(records)[0]["1.0"]["4"]["decode_speedup_typical"] == pytest.approx(3.0 / 3.2)


def test_best_of_reps_reads_each_engines_fastest_rep():
    # rep 1's no-spec call hit a burst of slowness; adaptive's fastest rep is rep 0
    records = [record(0, "no_spec", 1.0), record(0, "adaptive", 1.02), record(1, "no_spec", 1.5),
               record(1, "adaptive", 1.1)]
    assert best_of_reps_ratio(records) == pytest.approx(1.0 / 1.02)
    summary, rows = sweep_summary(records)
    entry = summary["1.0"]["4"]
    assert entry["decode_speedup_best_of_reps"] == pytest.approx(1.0 / 1.02)
    assert entry["decode_speedups"] == pytest.approx([1.0 / 1.02, 1.5 / 1.1])
    assert rows[0][3] == f"{2.5 / 2.12:.3f}" and rows[0][4] == "0.980"
    assert entry["decode_speedup_lockstep"] == pytest.approx(2.5 / 2.12)


def test_typical_decode_seconds_ignores_a_burst_but_not_the_overhead_outside_steps():
    trace = [SimpleNamespace(strategy="none", seconds=0.1)] * 8 + [SimpleNamespace(strategy="none", seconds=0.5)]
    trace += [SimpleNamespace(strategy="chain:2", seconds=0.2)] * 3
    stats = SimpleNamespace(trace=trace, prefill_seconds=1.0, total_seconds=1.0 + 0.8 + 0.5 + 0.6 + 0.05)
    assert typical_decode_seconds(stats) == pytest.approx(9 * 0.1 + 3 * 0.2 + 0.05)


def test_sweep_replays_rows_without_their_own_answers_in_the_history():
    model = tiny_model("llama", logit_scale=4.0)
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    ids, mask = padded_prompts([5, 3, 5, 3], seed=3)
    ids[2], mask[2], ids[3], mask[3] = ids[0], mask[0], ids[1], mask[1]  # two prompts, two samples each
    keys = [tuple(ids[r][mask[r].bool()].tolist()) for r in range(4)]
    no_spec = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    adaptive = SpeculativeGenerator(model, None, TLTConfig(speculation="adaptive"))
    reference = adaptive.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD,
                                  do_sample=True, generator=torch.Generator().manual_seed(0), history_keys=keys)
    snapshot_tokens = adaptive.rollout_history.num_tokens
    assert snapshot_tokens > 0
    records = batch_sweep(no_spec, adaptive, tok, ids, mask, reference.sequences, temperature=1.0,
                          sampling={"do_sample": True}, sizes=(1, 4), new_tokens=4, prefix=6, reps=2,
                          log=lambda *_: None)
    assert {(r["batch"], r["engine"]) for r in records} == {(b, e) for b in (1, 4) for e in ("no_spec", "adaptive")}
    discarded = {r["batch"]: r["own_answers_discarded"] for r in records if r["engine"] == "adaptive"}
    assert discarded == {1: 1, 4: 4}  # each replayed row's own answer, not its sibling's
    assert all(r["tokens"] == r["batch"] * 4 for r in records)  # EOS ignored: the batch stays full
    assert all(len(r["trace"]) == r["steps"] and r["typical_decode_seconds"] > 0 for r in records)
    assert adaptive.rollout_history.num_tokens == snapshot_tokens  # the rollout's history is restored afterwards
    contexts, _, lengths = sweep_contexts(ids, mask, reference.sequences, tok, prefix=6)
    for context, length, m in zip(contexts, lengths, mask):  # prompt + up to 6 tokens, stopping before an EOS
        assert len(context) == int(m.sum()) + min(6, length - 1)


def test_a_rollout_stepped_by_hand_is_generate():
    """The lockstep sweep drives rollouts one step at a time: start/begin/step/finish must be generate()."""
    model = tiny_model("llama", logit_scale=4.0)
    ids, mask = padded_prompts([5, 3, 7], seed=4)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    kwargs = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, do_sample=True)
    reference = engine.generate(ids, generator=torch.Generator().manual_seed(5), **kwargs)
    rollout = engine.start(ids, generator=torch.Generator().manual_seed(5), **kwargs)
    rollout.begin()
    steps = 0
    while rollout.step():
        steps += 1
    result = rollout.finish()
    assert torch.equal(result.sequences, reference.sequences)
    assert steps + 1 == result.stats.steps == reference.stats.steps
    assert not rollout.step()
