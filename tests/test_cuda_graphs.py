"""CUDA graphs captured and replayed on a real device: only on CUDA (``benchmarks/gpu_session.sh`` runs this file).

The CPU suite checks the graphs' static-buffer path (tests/test_graphs.py) and the self-check with a faked capture
(tests/test_gpu_self_check.py); what only a GPU can show is whether a real capture of each traced step kind works:
every capture passes its self-check (no fallback to eager, no "TLT:" warning), whole steps are replayed, the greedy
float32 rollout equals ``model.generate`` token for token, a second call with the same shapes captures nothing,
``release_graphs()`` gives the memory back, and in bfloat16 (where a multi-token verify pass may round a near-tie
the other way, so greedy identity is not the test) the sampled law is ``model.generate``'s.

``TLT_CUDA_TESTS_ON_CPU=1`` rehearses this file's logic on the CPU with ``cuda_graphs="static"`` (nothing captured
there: the counts are of graph shapes prepared), so the tests can be checked where no GPU is lent.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from test_engine_greedy import staggered_eos, train_drafter
from tiny_models import PAD, padded_prompts, tiny_model

from tlt_trainers import BlockDrafter, Eagle3Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout import graphs as graphs_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_exactness import sampled_law_check  # noqa: E402

REHEARSAL = not torch.cuda.is_available() and os.environ.get("TLT_CUDA_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() and not REHEARSAL,
                                                   reason="needs a CUDA device (benchmarks/gpu_session.sh)")]
DEVICE = torch.device("cpu" if REHEARSAL else "cuda")
GRAPHS = "static" if REHEARSAL else "auto"
NEW_TOKENS = 20


@pytest.fixture(autouse=True)
def fresh_graph_checks():
    """Each test starts with graphs switched on and no self-check recorded (a failure is remembered per process)."""
    graphs_module.reset_graph_self_checks()
    yield
    graphs_module.reset_graph_self_checks()


@pytest.fixture(scope="module")
def setup():
    """A tiny float32 Llama with sharp next-token laws (greedy ties vanishingly rare), a trained EAGLE-1 drafter
    (partial acceptance: commits of every length), fresh EAGLE-3 drafters (with and without a draft vocabulary) and a
    block drafter; prompts of mixed lengths and an EOS that ends the rows at different steps."""
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    drafters = {"eagle": train_drafter(model, steps=60)}
    torch.manual_seed(0)
    drafters["eagle3"] = Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5])
    drafters["eagle3-draft-vocab"] = Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5], draft_vocab_size=16)
    drafters["block"] = BlockDrafter.from_target(model, block_size=4)
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=16)
    eos = staggered_eos(model, ids, mask, NEW_TOKENS)
    model = model.to(DEVICE)
    return model, {k: d.to(DEVICE) for k, d in drafters.items()}, ids.to(DEVICE), mask.to(DEVICE), eos


def tlt_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("tlt_trainers")]


def counts(rollout) -> dict:
    runner, steps = rollout.graphs, rollout.step_graphs
    return {"captures": runner.captures + steps.captures, "shapes": runner.shapes_prepared + steps.shapes_prepared,
            "step_replays": steps.replays, "pass_replays": runner.replays,
            "disabled": [d for d in (runner.disabled, *steps.failed.values()) if d]}


CASES = {  # name: (drafter, strategy)
    "plain": (None, None),
    "eagle chain": ("eagle", "chain:4"),
    "eagle tree": ("eagle", "tree:3x2:5"),
    "eagle3 chain": ("eagle3", "chain:3"),
    "eagle3 draft vocabulary chain": ("eagle3-draft-vocab", "chain:3"),
    "block": ("block", "block:3"),
    "history": (None, "history:4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_step_kind_captures_replays_and_stays_exact(setup, caplog, case):
    model, drafters, ids, mask, eos = setup
    drafter_name, strategy = CASES[case]
    if strategy is None:
        config = TLTConfig(speculation="never", cuda_graphs=GRAPHS)
    else:
        config = TLTConfig(speculation="always", strategy=strategy, history_drafting=strategy.startswith("history"),
                           cuda_graphs=GRAPHS)
    engine = SpeculativeGenerator(model, drafters.get(drafter_name), config)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                  pad_token_id=PAD)
    reference = model.generate(ids, **kwargs)
    seen = []
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # the second call replays what the first captured (and history has rollouts to draft)
            rollout = engine.start(ids, **kwargs)
            before = counts(rollout) if rollout.graphs is not None else None
            result = rollout.run()
            seen.append((before, counts(rollout) if rollout.graphs is not None else None, result))
    assert not tlt_warnings(caplog), tlt_warnings(caplog)
    failed = [c for c in graphs_module.graph_self_checks() if not c["agrees"]]
    assert not failed, failed
    for _, after, result in seen:
        assert after is not None, "no graph session: CUDA graphs were not used"
        assert not after["disabled"], after["disabled"]
        assert torch.equal(result.sequences, reference)
    (_, first, _), (before, second, _) = seen
    if not REHEARSAL:
        assert first["captures"] > 0
    assert first["step_replays"] > 0, "no whole step was replayed from a graph"
    assert second["step_replays"] > before["step_replays"]
    assert second["shapes"] == before["shapes"], "the second call, same shapes and settings, set up new graphs"


@pytest.mark.skipif(REHEARSAL, reason="device memory: CUDA only")
def test_release_graphs_gives_the_memory_back(setup):
    model, drafters, ids, mask, eos = setup
    gc.collect()
    baseline = torch.cuda.memory_allocated(DEVICE)
    engine = SpeculativeGenerator(model, drafters["eagle"], TLTConfig(speculation="always", strategy="chain:4",
                                                                      history_drafting=False, cuda_graphs=GRAPHS))
    engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                    pad_token_id=PAD)
    gc.collect()
    held = torch.cuda.memory_allocated(DEVICE) - baseline
    engine.release_graphs()
    gc.collect()
    left = torch.cuda.memory_allocated(DEVICE) - baseline
    assert held > 0, "the engine kept no cache or graphs between calls: nothing to release"
    assert left <= 0.05 * held, f"release_graphs() kept {left} of the {held} bytes the engine held after generate()"


def test_bf16_sampled_law_with_graphs_is_generates(setup, caplog):
    """chain:4 at temperature 1 in bfloat16 with graphs: completions scored under the float32 policy are drawn from
    the law ``model.generate``'s are (two-sample Kolmogorov-Smirnov, benchmarks/gpu_exactness.py)."""
    model, drafters, _, _, _ = setup
    bf16, drafter = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(drafters["eagle"]).to(torch.bfloat16)
    engine = SpeculativeGenerator(bf16, drafter, TLTConfig(speculation="always", strategy="chain:4",
                                                           history_drafting=False, cuda_graphs=GRAPHS))
    with caplog.at_level(logging.WARNING):
        law = sampled_law_check(bf16, engine, model, DEVICE, samples=256, new_tokens=16)
    assert not tlt_warnings(caplog), tlt_warnings(caplog)
    assert engine._graph_session is not None and engine._graph_session.step_graphs.replays > 0
    assert law["ks_pvalue"] > 1e-3, law
