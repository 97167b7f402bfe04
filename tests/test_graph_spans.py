"""Graphs whose cost follows the work: KV spans, values outside the graphs' keys, a bounded number of graphs.

In ``cuda_graphs="static"`` (the static-buffer path a capture records, run without capturing on the CPU):

- every traced step and graph-runner pass attends over a KV span (``kv_span``: 256, 512, ... slots from the rows'
  longest length) rather than the session's capacity, so a session larger than a call needs is reused and costs
  the same per step; spans small enough to change every few steps keep the output exactly ``model.generate``'s;
- ``max_new_tokens``, temperature, top-p and min-p are device scalars the session holds (bit for bit the scores
  transformers' warpers give), so a call with other values prepares no new graph;
- at most ``max_graphs`` graphs are kept, the least recently used evicted.
"""

import gc

import pytest
import torch
from test_engine_greedy import staggered_eos, train_drafter
from test_engine_sampling import NEW_TOKENS, PROMPT, SAMPLES, _pad, hf_samples, two_sample_pvalue
from tiny_models import EOS, PAD, padded_prompts, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.generation.logits_process import TemperatureLogitsWarper

from tlt_trainers import BlockDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.modeling import rows as rows_module
from tlt_trainers.modeling.kv_cache import RowKV, RowState
from tlt_trainers.modeling.rows import ActiveRows, kv_span
from tlt_trainers.rollout.graphs import GraphRunner
from tlt_trainers.rollout.step_graphs import StepGraphs
from tlt_trainers.rollout.step_probe import _launches_nothing, in_graph_region
from tlt_trainers.sampling.distribution import SamplingParams, SamplingScalars, process_logits


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", logit_scale=4.0, max_position_embeddings=2048)
    return model, train_drafter(model, steps=60)


def prepared(rollout) -> int:
    return rollout.graphs.shapes_prepared + rollout.step_graphs.shapes_prepared


def test_kv_spans_double_from_256_up_to_the_capacity():
    assert [kv_span(n, 4096) for n in (1, 256, 257, 300, 513, 2049, 5000)] == [256, 256, 512, 512, 1024, 4096, 4096]
    assert kv_span(300, 768) == 512 and kv_span(600, 768) == 768


def test_rows_that_leave_no_longer_reach_past_the_live_rows():
    """A padded graph step computes on dead rows; one that finished longest keeps no length past the live rows'
    span (its tree mask would index past the span)."""
    lengths = torch.tensor([5, 7, 9, 300])
    rows = ActiveRows(state=RowState(torch.zeros(4, dtype=torch.long), lengths.clone()), draft_state=None,
                      cache=None, draft_kv=None, index=torch.arange(4), seq=torch.zeros(4, 512, dtype=torch.long),
                      generated=torch.zeros(4, dtype=torch.long))
    rows.compact([False, False, False, True])  # the longest row finishes: no hole to fill, it stays as a dead row
    assert rows.size == 3 and rows.padded(4).state.length.tolist() == [5, 7, 9, 0]
    rows.compact([True, False, False])  # row 2 moves into row 0's place; rows 2 and 3 are dead
    assert rows.padded(4).state.length.tolist() == [9, 7, 0, 0]


@pytest.mark.parametrize("strategy", ["none", "chain:3", "tree:3x2:6", "block:3", "history:4"])
def test_small_kv_spans_stay_exact(trained, monkeypatch, strategy):
    """Spans of 8, 16, 32, ... slots: every few steps a step crosses into the next span (a new graph) and rows finish
    at different steps, so dead rows, catch-ups, drafts and verified nodes must all fit the span computed on the
    host (``ActiveRows.kv_bound`` raises otherwise); the output stays ``model.generate``'s."""
    model, drafter = trained
    monkeypatch.setattr(rows_module, "KV_SPAN_STEP", 8)
    if strategy.startswith("block"):
        torch.manual_seed(0)
        drafter = BlockDrafter.from_target(model, block_size=4)
    history = strategy.startswith("history")
    engine = SpeculativeGenerator(model, None if history or strategy == "none" else drafter,
                                  TLTConfig(speculation="never" if strategy == "none" else "always",
                                            strategy=None if strategy == "none" else strategy, cuda_graphs="static",
                                            history_drafting=history))
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    eos = staggered_eos(model, ids, mask, 40)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD)
    if history:  # an earlier rollout to propose from
        engine.generate(ids, **kwargs)
    rollout = engine.start(ids, **kwargs)
    result = rollout.run()
    reference = model.generate(ids, **kwargs)
    assert torch.equal(result.sequences, reference)
    spans = {key[1] for key in rollout.step_graphs.entries}
    assert len(spans) >= 2 and max(spans) < rollout.capacity, spans  # traced steps at several spans
    assert {r.batch_size for r in result.stats.trace} - {1, 2, 4, 8}, "the test needs padded steps"


def test_a_larger_session_is_reused_and_steps_attend_over_the_rows_span(trained, monkeypatch):
    """A call needing a third of the session's capacity reuses it (graphs and cache), and its traced passes attend
    over 256 slots, not the capacity; the output is generate's."""
    model, drafter = trained
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                            cuda_graphs="static"))
    spans = []
    write = RowKV.write

    def recording(self, keys, values, index, kv_len):
        if in_graph_region():  # a traced step or graph-runner pass (policy or drafter cache)
            spans.append(kv_len)
        return write(self, keys, values, index, kv_len)

    monkeypatch.setattr(RowKV, "write", recording)
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    long_call = engine.start(ids, attention_mask=mask, do_sample=False, max_new_tokens=700, eos_token_id=EOS,
                             pad_token_id=PAD)
    session = long_call.session
    assert session.capacity >= 768
    long_call.begin()
    for _ in range(3):
        long_call.step()
    assert spans and set(spans) == {256}, set(spans)  # rows of ~15 tokens in a session of 768 slots
    del long_call  # abandoned: the session is free again
    gc.collect()

    spans.clear()
    eos = staggered_eos(model, ids, mask, 40)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD)
    rollout = engine.start(ids, **kwargs)
    assert rollout.session is session and rollout.capacity == session.capacity  # 256 slots needed, 768 kept
    result = rollout.run()
    assert torch.equal(result.sequences, model.generate(ids, **kwargs))
    assert rollout.step_graphs.replays > 0 and spans and set(spans) == {256}, set(spans)


def test_other_max_new_tokens_and_temperature_prepare_no_new_graph():
    """Values live in the session's device scalars: a greedy call with fewer new tokens, and a sampled call with
    another temperature and max_new_tokens, replay the graphs of the call before them (plain steps: every row
    advances one token a step, so the later call's shapes are the earlier one's) and stay exact (greedy: equal to
    generate; T=0.6: generate's law)."""
    model = tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never", cuda_graphs="static"))
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], vocab_size=8, seed=16)
    eos = staggered_eos(model, ids, mask, 24)

    def greedy(new_tokens):
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos,
                      pad_token_id=PAD)
        rollout = engine.start(ids, **kwargs)
        before = prepared(rollout)
        result = rollout.run()
        assert torch.equal(result.sequences, model.generate(ids, **kwargs))
        return prepared(rollout) - before

    assert greedy(24) > 0
    assert greedy(16) == 0  # a prefix of the first call's steps: the same shapes, another max_new_tokens

    many = PROMPT.expand(SAMPLES, -1)

    def sampled(new_tokens, temperature, seed):
        # No EOS (99 is outside the vocabulary): every row runs every step, one bucket throughout
        rollout = engine.start(many, max_new_tokens=new_tokens, do_sample=True, temperature=temperature, top_k=0,
                               eos_token_id=99, pad_token_id=PAD, generator=torch.Generator().manual_seed(seed))
        before = prepared(rollout)
        result = rollout.run()
        return result.sequences[:, PROMPT.shape[1]:], prepared(rollout) - before

    _, first = sampled(NEW_TOKENS + 2, 1.0, seed=60)  # T=1: the temperature's warper runs all the same
    completions, second = sampled(NEW_TOKENS, 0.6, seed=61)
    assert first > 0 and second == 0
    after_eos = (completions == EOS).cumsum(dim=1) - (completions == EOS).to(torch.long) > 0
    completions = completions.masked_fill(after_eos, PAD)  # what generate returns: padding after EOS
    assert two_sample_pvalue(hf_samples(model, seed=62, temperature=0.6), _pad(completions)) > 1e-3


class OpRecorder(TorchDispatchMode):
    """Every op a CUDA graph would record (views launch nothing) with what it would freeze of it: tensors by shape,
    dtype and device, everything else (a Python number passed to an op) by value."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        if not _launches_nothing(func):
            self.ops.append((str(func), tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor)
                                              else a for a in flat)))
        return func(*args, **(kwargs or {}))


def record_traces(monkeypatch) -> dict:
    """key -> the op traces of every run of a traced step (StepGraphs) or graph-runner pass under that key."""
    traces: dict = {}
    step_run, runner_pass = StepGraphs.run, GraphRunner._pass

    def recorded(key, function):
        with OpRecorder() as recorder:
            out = function()
        traces.setdefault(key, []).append(recorder.ops)
        return out

    def run(self, key, body, *args, **kwargs):
        return step_run(self, key, lambda: recorded(("step", id(self), key), body), *args, **kwargs)

    def pass_(self, static):
        key = ("pass", id(self), tuple(static["tokens"].shape), static["span"])
        return recorded(key, lambda: runner_pass(self, static))

    monkeypatch.setattr(StepGraphs, "run", run)
    monkeypatch.setattr(GraphRunner, "_pass", pass_)
    return traces


def test_a_replayed_key_records_what_its_capture_recorded(trained, monkeypatch):
    """What a capture freezes (the ops, their shapes and every Python number they take) is the same on every run of
    a key, across calls with other max_new_tokens, temperature, top-p and min-p: values reach the traced ops only
    through the session's device scalars. (Static mode reruns the Python of a step; a CUDA graph would replay the
    first run's numbers.)"""
    model, drafter = trained
    monkeypatch.setattr(rows_module, "KV_SPAN_STEP", 16)  # several spans within the calls
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                            cuda_graphs="static"))
    traces = record_traces(monkeypatch)
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    for new_tokens, temperature, top_p, min_p in ((24, 0.9, 0.95, 0.05), (20, 1.0, 0.8, 0.1), (30, 1.3, 0.9, 0.02)):
        engine.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens, temperature=temperature,
                        top_k=0, top_p=top_p, min_p=min_p, eos_token_id=EOS, pad_token_id=PAD,
                        generator=torch.Generator().manual_seed(new_tokens))
    replayed = {key: runs for key, runs in traces.items() if len(runs) > 1}
    assert any(key[0] == "step" for key in replayed) and any(key[0] == "pass" for key in replayed)
    for key, runs in replayed.items():
        for other in runs[1:]:
            assert other == runs[0], f"{key[0]} {key[2:]}: a later run differs from the first (a value baked in)"


def test_top_p_cut_is_float32_of_one_minus_top_p():
    """transformers compares cumulative probabilities with ``1 - top_p`` computed in float64 and rounded to float32;
    a cut computed in float32 (``1.0f - float32(top_p)``) differs by an ulp, which decides a token whose cumulative
    probability lies exactly on the cut."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    cumulative = torch.sort(logits[:1], descending=False)[0].softmax(dim=-1).cumsum(dim=-1)
    params = SamplingParams(do_sample=True, top_p=1 - float(cumulative[0, 900]))  # the cut on token 900 exactly
    scalars = SamplingScalars("cpu")
    scalars.fill(params)
    reference = process_logits(logits, params)
    assert int(torch.isinf(reference[0]).sum()) == 901  # the token on the cut is removed, as in generate
    assert torch.equal(process_logits(logits, params, None, scalars.warpers(params)), reference)


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7), dict(temperature=1.3, top_p=0.9), dict(temperature=0.3, top_k=5, top_p=0.5),
    dict(temperature=0.9, min_p=0.05), dict(top_p=0.123, min_p=0.2), dict(temperature=2.0, top_k=3, min_p=0.1),
    dict(temperature=0.55, top_p=0.95, min_p=0.01), dict(), dict(top_k=7)])
def test_device_scalar_warpers_give_transformers_scores_bit_for_bit(settings):
    """The warpers that read the session's scalars score exactly as transformers' own, on one scalars object
    refilled for each setting (what a session does across calls)."""
    scalars = SamplingScalars("cpu")
    scalars.fill(SamplingParams(temperature=1.7, top_p=0.3, min_p=0.4))  # other values first: fill must replace
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=gen) * 3
    logits[:, :10] = logits[:, :1]  # ties at the top
    params = SamplingParams(do_sample=True, **settings)
    scalars.fill(params)
    ours = process_logits(logits, params, None, scalars.warpers(params))
    reference = process_logits(logits, params)
    assert torch.equal(ours, reference)
    theirs = list(params.warpers())
    if params.temperature == 1.0:  # transformers skips it; ours divides by 1, which changes no bit
        theirs.insert(0, TemperatureLogitsWarper(1.5))
    assert all(isinstance(one, type(other))  # the same warpers, in the same order
               for one, other in zip(scalars.warpers(params), theirs, strict=True))


def test_graphs_are_evicted_least_recently_used_first():
    graphs = StepGraphs("static", max_graphs=2)
    ran = []

    def run(key):
        graphs.run(key, lambda: ran.append(key), lambda: (lambda: None), lambda result: [],
                   lambda reset_only=False: None)

    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        run(key)
    assert list(graphs.entries) == ["a", "c"] and graphs.shapes_prepared == 3
    run("b")  # prepared again, and "a" goes
    assert list(graphs.entries) == ["c", "b"] and graphs.shapes_prepared == 4 and ran == list("abacb")


def test_a_session_holds_at_most_max_graphs(trained):
    """With room for two graphs each, a call stepping through buckets 8, 4, 2, 1 (and eager catch-ups through the
    runner) keeps two, evicting as it goes, and stays exact."""
    model, drafter = trained
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                            cuda_graphs="static"))
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    eos = staggered_eos(model, ids, mask, 24)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos, pad_token_id=PAD)
    rollout = engine.start(ids, **kwargs)
    rollout.step_graphs.max_graphs = rollout.graphs.max_graphs = 2
    rollout.begin()
    held = []
    while rollout.step():
        held.append(len(rollout.step_graphs.entries))
    assert torch.equal(rollout.finish().sequences, model.generate(ids, **kwargs))
    assert rollout.step_graphs.shapes_prepared > 2 and max(held) == 2  # more shapes than room: evicted
    assert len(rollout.graphs.graphs) <= 2
