"""The GPU paths check themselves before first use and fall back with one warning: run here on CPU.

- The Triton verification kernels (the default on CUDA with Triton) are compared exactly with the torch path on a
  small batch per device and shape class before their first launch (``tlt_trainers.kernels.fused_verification``).
  Here they run under Triton's interpreter (``TRITON_INTERPRET=1``, tests/conftest.py), injected where the engine
  looks them up: the check passes and the kernels verify; a kernel that returns wrong tokens, raises at
  compile/launch, or fails after its check is switched off with exactly one warning, and the rollout equals the
  torch path's.
- CUDA graphs (``cuda_graphs="auto"`` on CUDA) compare each graph's first replay with the eager pass on the same
  inputs (``tlt_trainers.rollout.graphs``), EAGLE-3 feature taps included. CPU cannot capture, so the capture is
  faked as a GPU does it: the capture runs nothing (its outputs hold garbage until a replay), and the replay reruns
  the pass eagerly into them (a faithful graph), or then corrupts the logits or the features, or perturbs them by a
  known amount, or computes nothing (stale outputs), or the capture raises; the warm-up, the comparison, the
  fallback and its logging are the real code, so a check that does not replay, or compares the wrong thing, fails.
"""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch
from test_engine_greedy import train_drafter
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import Eagle3Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.kernels import fused_verification as verify_module
from tlt_trainers.rollout import graphs as graphs_module
from tlt_trainers.rollout import step_graphs as step_graphs_module
from tlt_trainers.rollout.graphs import GraphRunner
from tlt_trainers.rollout.step_graphs import StepGraphs


def tlt_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tlt_trainers")]


@pytest.fixture(autouse=True)
def fresh_checks():
    """Each test starts with no self-check done and nothing switched off (a process checks each shape once)."""
    for module, name in ((verify_module, "reset_kernel_self_checks"), (graphs_module, "reset_graph_self_checks")):
        getattr(module, name, lambda: None)()
    yield
    for module, name in ((verify_module, "reset_kernel_self_checks"), (graphs_module, "reset_graph_self_checks")):
        getattr(module, name, lambda: None)()


# ------------------------------------------------------------------ Triton verification kernels
def triton_kernels():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton is imported (conftest.py)")
    import tlt_trainers.kernels.verify_triton as verify_triton

    return verify_triton


# Where Triton runs the kernels: the GPU, or the CPU under the interpreter (how the suite runs without a GPU). The
# engines of these tests run there too: a kernel is chosen by the tensors' device.
KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.fixture(scope="module")
def sampled_setup():
    model = tiny_model("llama", logit_scale=4.0)
    drafter = train_drafter(model, steps=60)
    return model.to(KERNEL_DEVICE), drafter.to(KERNEL_DEVICE)


def sample(setup, strategy, rounds=1):
    model, drafter = setup
    ids, mask = (t.to(KERNEL_DEVICE) for t in padded_prompts([3, 6, 4, 5], seed=2))
    # Eager steps: every verification calls the kernel from Python (a graph replay would not), which these count
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy,
                                                            cuda_graphs="off"))
    results = [engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.9,
                               eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(5 + r))
               for r in range(rounds)]
    return [r.sequences for r in results]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def injected(monkeypatch, chain=None, tree=None):
    """Make the engine find these launchers where it finds the Triton kernels on CUDA (defaults: the real ones,
    counted)."""
    verify_triton = triton_kernels()
    calls = {"chain": 0, "tree": 0}

    def counted(kind, launcher):
        def launch(*args, **kwargs):
            calls[kind] += 1
            return launcher(*args, **kwargs)
        return launch

    kernels = types.SimpleNamespace(verify_chain_triton=counted("chain", chain or verify_triton.verify_chain_triton),
                                    verify_tree_triton=counted("tree", tree or verify_triton.verify_tree_triton))
    monkeypatch.setattr(verify_module, "fused_kernels", lambda device: kernels)
    return calls


@pytest.mark.parametrize("strategy", ["chain:4", "tree:3x2:5"])
def test_kernels_pass_their_self_check_and_verify(monkeypatch, caplog, sampled_setup, strategy):
    torch_path = sample(sampled_setup, strategy)
    calls = injected(monkeypatch)
    with caplog.at_level(logging.WARNING):
        fused = sample(sampled_setup, strategy)
    kind = "chain" if strategy.startswith("chain") else "tree"
    checks = verify_module.kernel_self_checks()
    assert checks and all(c["agrees"] for c in checks), checks
    assert {c["kernel"] for c in checks} == {f"verify_{kind}_triton"}
    assert calls[kind] > len(checks)  # one launch per shape class for the check, then the verify steps
    assert same(fused, torch_path)
    assert not tlt_warnings(caplog)


def wrong_tokens(kind):
    verify_triton = triton_kernels()
    if kind == "chain":
        def launcher(*args, **kwargs):
            verdict = verify_triton.verify_chain_triton(*args, **kwargs)
            verdict.next_token = (verdict.next_token + 1) % args[2].shape[-1]
            return verdict
        return launcher

    def tree_launcher(*args):
        accepted, path, token = verify_triton.verify_tree_triton(*args)
        return accepted, path, (token + 1) % args[2].shape[-1]
    return tree_launcher


def raises(*args, **kwargs):
    raise RuntimeError("triton.compiler.errors.CompilationError: at 12:8: (simulated)")


@pytest.mark.parametrize("strategy", ["chain:4", "tree:3x2:5"])
@pytest.mark.parametrize("broken", ["wrong tokens", "raises"])
def test_a_broken_kernel_falls_back_to_torch_with_one_warning(monkeypatch, caplog, sampled_setup, strategy, broken):
    torch_path = sample(sampled_setup, strategy, rounds=2)
    kind = "chain" if strategy.startswith("chain") else "tree"
    launcher = wrong_tokens(kind) if broken == "wrong tokens" else raises
    calls = injected(monkeypatch, **{kind: launcher})
    with caplog.at_level(logging.WARNING):
        fused = sample(sampled_setup, strategy, rounds=2)  # two generate() calls: still one check, one warning
    assert same(fused, torch_path)
    assert calls[kind] == 1  # the self-check's launch only: never used to verify
    warnings = tlt_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert f"verify_{kind}_triton" in message and "torch path" in message
    assert ("RuntimeError" if broken == "raises" else "next tokens") in message
    assert [c["agrees"] for c in verify_module.kernel_self_checks()] == [False]


def test_a_kernel_that_fails_after_its_check_falls_back_on_the_same_uniforms(monkeypatch, caplog, sampled_setup):
    """The check passed, a later launch raises: that step and every later one verify in torch, with the uniforms
    already drawn (the rollout equals the torch path's), and one warning."""
    verify_triton = triton_kernels()
    launches = []

    def flaky(*args, **kwargs):
        launches.append(1)
        if len(launches) > 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return verify_triton.verify_chain_triton(*args, **kwargs)

    torch_path = sample(sampled_setup, "chain:4")
    injected(monkeypatch, chain=flaky)
    with caplog.at_level(logging.WARNING):
        fused = sample(sampled_setup, "chain:4")
    assert same(fused, torch_path)
    assert len(launches) == 3  # check, one verify step, the failed launch; then torch only
    warnings = tlt_warnings(caplog)
    assert len(warnings) == 1 and "at launch" in warnings[0].getMessage()


def test_the_chain_check_covers_draft_vocabularies_and_every_branch():
    """Called directly: with a draft vocabulary (EAGLE-3's d2t) the real kernel passes; a kernel that reads q at the
    target id instead of the draft id, or draws the bonus token from the wrong position, is caught."""
    from tlt_trainers.sampling.chain import ChainVerdict, verify_sampled_with_uniforms
    from tlt_trainers.sampling.distribution import inverse_cdf

    verify_triton = triton_kernels()
    cpu = KERNEL_DEVICE  # the device the check runs on
    for shape in [(3, 40, 13, True, torch.long), (1, 1500, 1500, False, torch.long), (5, 2100, 300, True, torch.long)]:
        kernels = types.SimpleNamespace(verify_chain_triton=verify_triton.verify_chain_triton)
        assert verify_module.kernel_self_check(kernels, verify_module.CHAIN, cpu, shape) is not None

    def bonus_from_last_draft(tokens, q, p, u, r, d2t=None, index=None):
        verdict = verify_sampled_with_uniforms(tokens, q, p, u, r, d2t, index)
        k = tokens.shape[1]
        kept = verdict.num_accepted == k
        bonus = inverse_cdf(p[:, k - 1], r)
        return ChainVerdict(verdict.num_accepted, torch.where(kept, bonus, verdict.next_token),
                            verdict.first_acceptance)

    def q_at_target_ids(tokens, q, p, u, r, d2t=None, index=None):
        return verify_sampled_with_uniforms(tokens, q, p, u, r, d2t, tokens.clamp(max=q.shape[-1] - 1))

    for broken, shape in ((bonus_from_last_draft, (3, 40, 40, False, torch.long)),
                          (q_at_target_ids, (3, 40, 13, True, torch.long))):
        kernels = types.SimpleNamespace(verify_chain_triton=broken)
        assert verify_module.kernel_self_check(kernels, verify_module.CHAIN, cpu, shape) is None, broken.__name__


# ------------------------------------------------------------------ CUDA graphs (capture faked on CPU)
class FakeGraph:
    """Stands in for a captured CUDA graph. Its capture computed nothing (the outputs hold NaN until a replay, as a
    real capture leaves its output memory); its replay, by ``behaviour``:

    - "correct": reruns the pass eagerly into the captured outputs;
    - "corrupt" / "corrupt features": then negates the logits / the drafter's features (a graph that reads or
      writes the wrong memory);
    - "stale": runs nothing (a graph whose kernels write elsewhere): the outputs keep what the capture left;
    - ("noise", relative): then adds ``relative * (1 + max |logits|)`` to the logits, so that the check's
      difference for them is ``relative`` (a reduction order that differs between streams, or more).
    """

    def __init__(self, runner, static, outputs, behaviour):
        self.runner, self.static, self.outputs, self.behaviour = runner, static, outputs, behaviour
        self.replays = 0

    def replay(self):
        self.replays += 1
        if self.behaviour == "stale":
            return
        for out, fresh in zip(self.outputs, self.runner._run(self.static), strict=True):
            out.copy_(fresh)
        if self.behaviour == "corrupt":
            self.outputs[1].mul_(-1.0)
        elif self.behaviour == "corrupt features":
            self.outputs[0].mul_(-1.0)
        elif isinstance(self.behaviour, tuple):
            logits = self.outputs[1]
            logits.add_(self.behaviour[1] * (1 + logits.abs().max()))


def fake_capture(monkeypatch, behaviour="correct"):
    """CUDA graphs as on a GPU (cuda_graphs='auto' captures), the capture itself faked (see :class:`FakeGraph`;
    "raises": the capture raises). Returns the graphs made."""
    made = FakeGraphs()
    original = GraphRunner.mode_for

    def mode_for(setting, device, target, feature_layers):
        return original(setting, torch.device("cuda") if device.type == "cpu" else device, target, feature_layers)

    def record(self, static):
        if behaviour == "raises":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (simulated)")
        # A capture records the kernels and runs none: outputs of the right shapes, holding garbage until a replay
        outputs = tuple(torch.full_like(t, float("nan")) for t in self._run(static))
        made.append(FakeGraph(self, static, outputs, behaviour))
        return made[-1], outputs

    def record_step(self, body):
        """A whole step's graph (tlt_trainers.rollout.step_graphs), faked the correct way: its capture leaves
        garbage in the results, its replay reruns the step into them."""
        result = uncomputed(body())
        made.steps.append(FakeStepGraph(body, result))
        return made.steps[-1], result

    monkeypatch.setattr(GraphRunner, "mode_for", staticmethod(mode_for))
    monkeypatch.setattr(GraphRunner, "_record", record)
    monkeypatch.setattr(StepGraphs, "_record", record_step)
    return made


class FakeGraphs(list):
    """The faked policy-pass graphs, and ``steps``: the faked whole-step graphs."""

    def __init__(self):
        super().__init__()
        self.steps: list[FakeStepGraph] = []


def uncomputed(result):
    """A step's results as a capture leaves them: what the host reads holds garbage until the first replay."""
    for tensor in (result.packed, result.emitted, result.finished):
        tensor.fill_(True if tensor.dtype == torch.bool else -3)
    return result


class FakeStepGraph:
    def __init__(self, body, result, stale=False):
        self.body, self.result, self.stale = body, result, stale
        self.replays = 0

    def replay(self):
        self.replays += 1
        if self.stale:  # computes nothing: the results keep what the capture left
            return
        fresh = self.body()
        for out, new in ((self.result.packed, fresh.packed), (self.result.emitted, fresh.emitted),
                         (self.result.finished, fresh.finished)):
            out.copy_(new)


@pytest.fixture(scope="module")
def graph_models():
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    torch.manual_seed(0)
    return model, Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5]), train_drafter(model, steps=20)


def greedy(model, drafter, rounds=1):
    """Greedy rollouts with the default cuda_graphs='auto' and model.generate's, and the graph runners used."""
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3"))
    runners = []
    original = GraphRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runners.append(self)

    GraphRunner.__init__ = spy
    try:
        ours = [engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                                pad_token_id=PAD).sequences for _ in range(rounds)]
    finally:
        GraphRunner.__init__ = original
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                               pad_token_id=PAD)
    return ours, reference, runners


@pytest.mark.parametrize("drafter_kind", ["eagle3", "eagle1"])
def test_graphs_pass_their_self_check_and_replay(monkeypatch, caplog, graph_models, drafter_kind):
    model, eagle3, eagle1 = graph_models
    made = fake_capture(monkeypatch)
    with caplog.at_level(logging.WARNING):
        ours, reference, runners = greedy(model, eagle3 if drafter_kind == "eagle3" else eagle1)
    assert torch.equal(ours[0], reference)
    assert len(runners) == 1 and runners[0].mode == "cuda" and runners[0].disabled is None
    assert (runners[0].feature_layers is not None) == (drafter_kind == "eagle3")  # EAGLE-3 taps inside the graph
    checks = graphs_module.graph_self_checks()
    assert checks and all(c["agrees"] and c["difference"] == 0.0 for c in checks), checks
    assert {c["eagle3_features"] for c in checks} == {drafter_kind == "eagle3"}
    assert len(made) == runners[0].captures == len(checks)
    assert sum(g.replays for g in made) >= len(made)  # the first step's (its drafter catches up: eager step)
    # Later steps: whole steps replayed from graphs, each checked against its eager run at capture
    assert made.steps and sum(g.replays for g in made.steps) > len(made.steps)
    assert not tlt_warnings(caplog)


@pytest.mark.parametrize("behaviour", ["corrupt", "corrupt features", "stale", "raises"])
@pytest.mark.parametrize("drafter_kind", ["eagle3", "eagle1"])
def test_a_graph_that_fails_its_self_check_runs_eagerly_with_one_warning(monkeypatch, caplog, graph_models,
                                                                         drafter_kind, behaviour):
    model, eagle3, eagle1 = graph_models
    fake_capture(monkeypatch, behaviour)
    with caplog.at_level(logging.WARNING):
        ours, reference, runners = greedy(model, eagle3 if drafter_kind == "eagle3" else eagle1, rounds=2)
    assert torch.equal(ours[0], reference) and torch.equal(ours[1], reference)
    # The first generate() gave up at its first capture; the second did not try again (same model class)
    assert len(runners) == 1 and runners[0].disabled is not None and not runners[0].graphs
    warnings = tlt_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "CUDA graphs" in message and "eagerly" in message
    assert ("EAGLE-3" in message) == (drafter_kind == "eagle3")
    assert ("RuntimeError" if behaviour == "raises" else "first replay differs") in message
    checks = graphs_module.graph_self_checks()
    assert [c["agrees"] for c in checks] == [False]
    if behaviour == "corrupt features":  # the features disagree, the logits do not
        assert "features, logits: " in message and ", 0;" in message, message
    # negated outputs: 2 max|x| / (1 + max|x|) of their scale; NaN left by a capture, or an exception: inf
    difference = checks[0]["difference"]
    assert (0.1 < difference < 2.0) if behaviour.startswith("corrupt") else difference == float("inf"), checks


@pytest.mark.parametrize(("relative", "agrees"), [(1e-5, True), (0.05, False)])
def test_the_graph_check_measures_the_difference_against_its_tolerance(monkeypatch, caplog, graph_models,
                                                                       relative, agrees):
    """A first replay off by a known share of the logits' scale: the check reports that share; within the float32
    tolerance (1e-3: reduction order) the graph is used, 0.05 makes the pass run eagerly with one warning. Either
    way the rollout equals generate() (a constant added to every logit changes no token)."""
    model, eagle3, _ = graph_models
    fake_capture(monkeypatch, ("noise", relative))
    with caplog.at_level(logging.WARNING):
        ours, reference, runners = greedy(model, eagle3)
    assert torch.equal(ours[0], reference)
    checks = graphs_module.graph_self_checks()
    assert checks and [c["agrees"] for c in checks] == [agrees] * len(checks), checks
    assert all(c["difference"] == pytest.approx(relative, rel=0.05) for c in checks), checks
    assert (runners[0].disabled is None) == agrees
    assert len(tlt_warnings(caplog)) == (0 if agrees else 1)


@pytest.mark.parametrize("behaviour", ["corrupt", "stale", "raises"])
def test_a_step_graph_that_fails_its_self_check_runs_eagerly_with_one_warning(monkeypatch, caplog, graph_models,
                                                                              behaviour):
    """A whole-step graph whose first replay emits other tokens (or whose capture raises) is dropped with one
    warning per step shape (every shape's capture is broken here); the step reruns eagerly from the state saved
    before it, and the rollout still equals generate()."""
    model, eagle3, _ = graph_models
    fake_capture(monkeypatch)

    def broken_step_record(self, body):
        if behaviour == "raises":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (simulated)")
        result = uncomputed(body())
        graph = FakeStepGraph(body, result, stale=behaviour == "stale")
        original_replay = graph.replay

        def corrupt_replay():
            original_replay()
            graph.result.emitted.add_(1)

        if behaviour == "corrupt":
            graph.replay = corrupt_replay
        return graph, result

    monkeypatch.setattr(StepGraphs, "_record", broken_step_record)
    with caplog.at_level(logging.WARNING):
        ours, reference, _ = greedy(model, eagle3)
    assert torch.equal(ours[0], reference)
    warnings = tlt_warnings(caplog)
    failed = step_graphs_module.failed_step_captures()
    assert failed and len(warnings) == len(failed), [r.getMessage() for r in warnings]
    for warning in warnings:
        message = warning.getMessage()
        assert "whole speculative step" in message and "eagerly" in message
        assert ("RuntimeError" if behaviour == "raises" else "other tokens") in message
