"""The rollout benchmark's drift-free tail figure (``benchmarks/bench_rollout.py``), on hand-made traces."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_rollout import lockstep_tail_speedup  # noqa: E402


def record(engine, temperature, trace):
    return {"engine": engine, "temperature": temperature, "trace": trace}


def test_lockstep_tail_reweights_no_specs_tail_by_the_sweeps_ratio_per_batch_size():
    raw = [
        record("no_spec", 1.0, [[20, "none", 20, 5.0], [16, "none", 16, 4.0], [3, "none", 3, 2.0]]),
        record("no_spec", 1.0, [[1, "none", 1, 1.0], [1, "none", 1, 1.0]]),  # a second rep: pooled
        record("adaptive", 1.0, [[1, "chain:4", 3, 9.0]]),  # not the workload: only no-spec's steps are
        record("no_spec", 0.6, [[1, "none", 1, 100.0]]),  # another temperature
    ]
    sweep = {"1.0": {"1": {"decode_speedup_lockstep": 2.0}, "4": {"decode_speedup_lockstep": 1.0},
                     "16": {"decode_speedup_lockstep": 0.5}, "64": {"decode_speedup_lockstep": 0.9}}}
    tail = lockstep_tail_speedup(raw, sweep, 1.0, tail_rows=16)
    assert tail["seconds_by_batch_size"] == {1: 2.0, 3: 2.0, 16: 4.0}  # batch 20 is not the tail
    ratio_at_3 = 2.0 + (3 - 1) / (4 - 1) * (1.0 - 2.0)
    adaptive = 2.0 / 2.0 + 2.0 / ratio_at_3 + 4.0 / 0.5
    assert tail["estimated_adaptive_seconds"] == pytest.approx(adaptive)
    assert tail["speedup"] == pytest.approx(8.0 / adaptive)


def test_lockstep_tail_clamps_outside_the_swept_sizes_and_needs_both_inputs():
    raw = [record("no_spec", 1.0, [[2, "none", 2, 1.0], [12, "none", 12, 1.0]])]
    tail = lockstep_tail_speedup(raw, {"1.0": {"4": {"decode_speedup_lockstep": 1.25},
                                               "8": {"decode_speedup_lockstep": 0.8}}}, 1.0, tail_rows=16)
    assert tail["speedup"] == pytest.approx(2.0 / (1.0 / 1.25 + 1.0 / 0.8))
    assert lockstep_tail_speedup(raw, {}, 1.0, tail_rows=16) is None
    assert lockstep_tail_speedup(raw, {"1.0": {"4": {"decode_speedup_lockstep": 1.0}}}, 0.6, tail_rows=16) is None
