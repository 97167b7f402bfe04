"""The GPU path's capture rules, checked on a CPU: the capture rehearsal on ``meta`` for every traced step kind, and
the faults it and a CUDA engineer's reading found (issue 52), each with a test that fails without its fix.

How each was seen failing (the fix undone once): the rehearsal cases on main 00fbb6a (every drafter kind: "tensor off
the device: arange at drafter/rope.py:53"; every kind: "device not bound"; under autocast: "autocast weight cache");
the head cache refilled by replacement (``weight.detach()[d2t]`` each time: another address); the autocast state left
out of the session key (the same session under and outside autocast); a failed capture switching every step graph
off (the other strategy captured nothing); a capture counted only when it succeeded (the failed one priced); the
eager catch-up after the prefill priced; the history drafts built with ``chains()`` (two device tensors, a blocking
copy).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.proposers.history import HistoryProposer
from tlt_trainers.rollout import graphs as graphs_module
from tlt_trainers.rollout.capture import capture_context
from tlt_trainers.rollout.capture_rehearsal import CaptureFault, CaptureRehearsal
from tlt_trainers.rollout.selector import StrategySelector
from tlt_trainers.rollout.step_graphs import StepGraphs

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from rehearsal_cases import all_cases, rehearse_case  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_graph_checks():
    graphs_module.reset_graph_self_checks()
    yield
    graphs_module.reset_graph_self_checks()


# ------------------------------------------------------------------------------------------ the rehearsal itself
@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
def test_each_traced_step_would_capture(case):
    """Every step kind the engine replays from a graph, rehearsed on meta: no host copy, read or tensor inside."""
    result = rehearse_case(case)
    assert result.passes, f"{case.name}: {result.describe()}"
    assert result.ops > 100  # the step's ops ran under the rehearsal (not an empty region)


def _meta(*shape):
    return torch.zeros(*shape, device="meta")


ILLEGAL = {  # (a device tensor, a host tensor made before the capture) -> an op a capture refuses
    "host tensor in an op": lambda x, host: x + host,
    "tensor off the device": lambda x, host: torch.arange(3),
    "host-to-device copy": lambda x, host: host.to("meta"),
    "host-to-device copy (copy_)": lambda x, host: x.copy_(host),
    "host read": lambda x, host: x.sum().item(),
    "host read (tolist)": lambda x, host: x.tolist(),
    "host read (nonzero)": lambda x, host: x.nonzero(),
    "device-to-host copy": lambda x, host: x.to("cpu"),
}


@pytest.mark.parametrize("rule", ILLEGAL)
def test_the_rehearsal_refuses_what_a_capture_refuses(rule):
    x, host = _meta(3), torch.ones(3)
    with capture_context("meta"), CaptureRehearsal("meta") as rehearsal:
        assert rehearsal.context_faults == []
        x * 2 + torch.arange(3, device="meta")  # legal: device ops on device tensors
        with pytest.raises(CaptureFault) as fault:
            ILLEGAL[rule](x, host)
    assert fault.value.rule == rule.split(" (")[0]
    assert "test_capture_rehearsal.py" in fault.value.where  # the line that issued it


def test_the_rehearsal_checks_the_capture_context():
    with CaptureRehearsal("meta") as unbound:
        pass
    assert [f.rule for f in unbound.context_faults] == ["device not bound"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with capture_context("meta"), CaptureRehearsal("meta") as bound:
            pass
        assert torch.is_autocast_cache_enabled()  # the caller's cache is back after the capture
    assert bound.context_faults == []


# ------------------------------------------------------------------------------------------ fault 3: the head cache
def test_draft_vocabulary_head_is_refilled_in_place():
    """EAGLE-1's sliced LM head is read by address by a step graph: a new policy head (an optimizer step) or a new
    draft vocabulary refills the same tensor, and the engine refreshes it before a replay."""
    model = tiny_model("llama")
    drafter = EagleDrafter.from_target(model, draft_vocab_size=32)
    drafter.set_draft_vocab(torch.arange(3, 35))
    before = drafter.head_weight()
    address = before.data_ptr()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)  # in place, as an optimizer step
    drafter.refresh_caches()
    assert drafter.head_weight().data_ptr() == address
    torch.testing.assert_close(drafter.head_weight(), model.get_output_embeddings().weight[3:35], rtol=0, atol=0)
    drafter.set_draft_vocab(torch.arange(10, 42))
    assert drafter.head_weight().data_ptr() == address
    torch.testing.assert_close(drafter.head_weight(), model.get_output_embeddings().weight[10:42], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ fault 4: autocast
def test_autocast_state_is_part_of_the_session_key():
    """Graphs captured under autocast cast inside the graph; replayed outside it they would still compute in bf16
    (and the reverse): another autocast state is another session."""
    model = tiny_model("llama")
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never", cuda_graphs="static"))
    ids, mask = padded_prompts([4, 6], seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    engine.generate(ids, **kwargs)
    plain = engine._graph_session
    engine.generate(ids, **kwargs)
    assert engine._graph_session is plain  # the same state: kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.generate(ids, **kwargs)
    assert engine._graph_session is not plain


def _exact_across_an_in_place_update(model, engine, device_type: str, check_session) -> None:
    """Two greedy calls under autocast(bf16), the weights updated in place between them (as an optimizer step): each
    call equals model.generate under the same autocast; ``check_session(engine)`` after each."""
    ids, mask = (t.to(model.device) for t in padded_prompts([5, 3, 7], seed=5))
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    for round_ in range(2):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            ours = engine.generate(ids, **kwargs).sequences
            reference = model.generate(ids, **kwargs)
        assert torch.equal(ours, reference[:, : ours.shape[1]]), f"round {round_}"
        check_session(engine)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)  # in place: the session's parameter key is unchanged


def test_weights_updated_in_place_between_calls_under_autocast_stay_exact():
    """As TRL runs it: fp32 weights, generation under autocast(bf16), an in-place optimizer step between calls. The
    kept session replays on the new weights, as model.generate under the same autocast."""
    model = tiny_model("llama", logit_scale=4.0)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never", cuda_graphs="static"))
    sessions = []
    _exact_across_an_in_place_update(model, engine, "cpu", lambda e: sessions.append(e._graph_session))
    assert sessions[0] is sessions[1]  # the same session, kept across the update


# ------------------------------------------------------------------------------------------ faults 1-2 on CUDA paths
def test_history_drafts_enter_a_traced_step_in_one_asynchronous_copy(monkeypatch):
    """A traced history step's drafts are matched on the host and copied once, non-blocking (from page-locked
    memory on CUDA), into the session's static buffer: no device tensors built from Python lists."""
    model = tiny_model("llama", logit_scale=6.0)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy="history:8",
                                                        history_drafting=True, cuda_graphs="static"))
    ids, mask = padded_prompts([5, 5], seed=9)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    engine.generate(ids, **kwargs)  # the history the next call matches
    copies = []
    original_copy = torch.Tensor.copy_

    def spy_copy(self, src, non_blocking=False):
        if engine._graph_session is not None and self.data_ptr() == \
                engine._graph_session.row_buffers["history_drafts"].data_ptr():
            copies.append(non_blocking)
        return original_copy(self, src, non_blocking)

    def no_device_lists(*args, **kwargs):
        raise AssertionError("chains() builds device tensors from host lists")

    monkeypatch.setattr(torch.Tensor, "copy_", spy_copy)
    monkeypatch.setattr(HistoryProposer, "chains", no_device_lists)
    result = engine.generate(ids, **kwargs)
    assert result.stats.accepted_tokens > 0  # history steps ran
    assert copies and all(copies), copies


# ------------------------------------------------------------------------------------------ faults 6: failures, pricing
def _fake_cuda(monkeypatch, fail_first_step_capture: bool):
    """CUDA-graph mode on the CPU, as tests/test_gpu_self_check.py fakes it: a policy-pass capture records a graph
    that replays the pass; a step capture fails once (the first), then records graphs that rerun the step."""
    from test_gpu_self_check import fake_capture

    made = fake_capture(monkeypatch)
    record_step = StepGraphs._record
    failures = []

    def failing_once(self, body):
        if fail_first_step_capture and not failures:
            failures.append(1)
            raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        return record_step(self, body)

    monkeypatch.setattr(StepGraphs, "_record", failing_once)
    return made


def test_a_failed_step_capture_switches_off_its_shape_only_once_per_process(monkeypatch, caplog):
    _fake_cuda(monkeypatch, fail_first_step_capture=True)
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=4)
    drafter = EagleDrafter.from_target(model)
    ids, mask = padded_prompts([3, 9, 5, 4], seed=16)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    reference = model.generate(ids, **kwargs)
    with caplog.at_level(logging.WARNING):
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3"))
        ours = engine.generate(ids, **kwargs).sequences
        steps = engine._graph_session.step_graphs
        # a second engine on the same shapes: the failed shape is remembered, not tried (nor warned) again
        again = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3"))
        second = again.generate(ids, **kwargs).sequences
    assert torch.equal(ours, reference[:, : ours.shape[1]]) and torch.equal(second, ours)
    assert len(steps.failed) == 1 and steps.captures >= 1  # the other step shapes kept their graphs
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tlt_trainers")]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    second_steps = again._graph_session.step_graphs
    assert {k[:4] for k in second_steps.failed} == {k[:4] for k in steps.failed}
    assert second_steps.capture_attempts == steps.capture_attempts - 1  # all but the failed shape


def test_capture_attempts_and_eager_runs_of_traced_strategies_price_nothing(monkeypatch):
    """The selector prices a strategy by its replayed steps: a step that tried a capture (a failed one too) and a
    traced strategy's step run eagerly (the drafter's wide catch-up after the prefill) are observed uncosted."""
    _fake_cuda(monkeypatch, fail_first_step_capture=True)
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=4)
    drafter = EagleDrafter.from_target(model)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="adaptive", strategies=["chain:2"]))
    observed = []
    original_observe = StrategySelector.observe
    original_run = StepGraphs.run
    runs = []

    def spy_run(self, *args, **kwargs):
        runs.append(self.capture_attempts)
        return original_run(self, *args, **kwargs)

    def spy_observe(self, strategy, batch, emitted, seconds, accepted=None, **kwargs):
        attempts = [g.capture_attempts for g in (engine._graph_session.runner, engine._graph_session.step_graphs)]
        observed.append((strategy.name, kwargs.get("costed", True), len(runs), attempts))
        return original_observe(self, strategy, batch, emitted, seconds, accepted, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", spy_run)
    monkeypatch.setattr(StrategySelector, "observe", spy_observe)
    chain = engine.strategies[0]
    monkeypatch.setattr(StrategySelector, "choose", lambda self, batch, expected=None: chain)  # always the chain
    ids, mask = padded_prompts([3, 9, 5, 4], seed=16)
    saw_eager_without_capture, saw_failed_capture = False, False
    for _ in range(2):  # the second call replays what the first captured: its eager catch-up tries no capture
        observed.clear()
        previous_runs = len(runs)
        previous_attempts = [g.capture_attempts for g in (engine._graph_session.runner,
                                                          engine._graph_session.step_graphs)] \
            if engine._graph_session is not None else [0, 0]
        engine.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                        pad_token_id=PAD)
        for name, costed, run_count, attempts in observed:
            traced = run_count > previous_runs
            tried = attempts != previous_attempts
            if name != "none" and not traced:
                saw_eager_without_capture |= not tried
                assert not costed, "an eager run of a traced strategy was priced"
            if tried:
                saw_failed_capture |= attempts[1] > previous_attempts[1]
                assert not costed, "a step that tried a capture was priced"
            previous_runs, previous_attempts = run_count, attempts
        assert any(costed for name, costed, *_ in observed if name != "none")  # replayed steps are priced
    assert saw_eager_without_capture and saw_failed_capture


# ------------------------------------------------------------------------------------------ on a GPU only
def cuda_only(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@cuda_only
def test_catch_up_is_timed_on_the_device():
    """Catch-up spans are CUDA events (the host only launches the work; its clock would time the launches)."""
    from tlt_trainers.rollout.stats import GenerationStats, StepTimer

    timer = StepTimer(GenerationStats(), torch.device("cuda"))
    start = timer.mark()
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(20):
        x = torch.tanh(x @ x)
    end = timer.mark()
    assert isinstance(start, torch.cuda.Event)
    assert timer.seconds_between(start, end) > 0


@cuda_only
def test_graphs_captured_under_autocast_replay_exactly_after_an_in_place_update():
    """Fault 4 on a GPU: fp32 weights, generation under autocast(bf16) with graphs kept across calls, an in-place
    weight update between the calls: the second call's replays read the new weights, as model.generate does."""
    model = tiny_model("llama", logit_scale=4.0).cuda()
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))

    def captured(engine):
        assert engine._graph_session is not None and engine._graph_session.runner.captures > 0

    _exact_across_an_in_place_update(model, engine, "cuda", captured)
