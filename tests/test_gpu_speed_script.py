"""benchmarks/gpu_speed.py runs on the CPU too (``--cpu-smoke``: tiny policies, the graphs' static path), so its code is
exercised without a GPU: the JSON holds every arm with its fields, written after each arm; a fallback to eager or a
TLT warning fails the run; the budget skips what does not fit and says so; without CUDA (and no smoke flag) it says
it measured nothing and exits 77."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_speed  # noqa: E402

from tlt_trainers.rollout.step_graphs import StepGraphs  # noqa: E402

ONE_ARM = ["--cpu-smoke", "--policies", "tiny-llama", "--dtypes", "float32", "--batches", "1", "--sampling",
           "greedy", "--no-generate"]
STRATEGY_FIELDS = {"tokens_per_s", "step_seconds_median", "step_cost_vs_plain", "replays", "replays_per_step",
                   "captures", "shapes_prepared", "eager_steps", "memory", "fallback", "acceptance_length"}
MEMORY_FIELDS = {"allocated_after_generate", "max_allocated", "held_by_engine_after_generate", "peak_cache_bytes"}


def test_cpu_smoke_writes_every_arm_with_its_fields(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_speed.py"), "--cpu-smoke", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_speed_cpu_smoke.json").read_text())
    assert results["status"] == "ok" and results["smoke"] and results["graphs"] == "static"
    arms = results["arms"]
    # two policies (Llama, Qwen2) x bf16, fp32 x batch 1, 8 x greedy, T=1
    assert {(a["policy"], a["dtype"], a["batch"], a["sampling"]) for a in arms} == {
        (p, d, b, s) for p in gpu_speed.TINY_POLICIES for d in gpu_speed.DTYPES for b in gpu_speed.BATCHES
        for s in gpu_speed.SAMPLINGS}
    lines = (tmp_path / "gpu_speed_cpu_smoke_arms.jsonl").read_text().splitlines()
    assert len(lines) == len(arms)
    for arm in arms:
        assert arm["status"] == "ok" and not arm["problems"] and not arm["tlt_warnings"], arm
        assert list(arm["strategies"]) == list(gpu_speed.STRATEGIES)
        assert arm["generate"]["tokens_per_s"] > 0
        for name, m in arm["strategies"].items():
            assert STRATEGY_FIELDS <= set(m), (name, sorted(STRATEGY_FIELDS - set(m)))
            assert MEMORY_FIELDS <= set(m["memory"])
            assert m["tokens_per_s"] > 0 and m["step_cost_vs_plain"] > 0 and m["fallback"] is None
            assert m["replays_per_step"] > 0  # the static path counts what a GPU would replay
            assert m["memory"]["allocated_after_generate"] is None  # no device memory on a CPU
            if arm["sampling"] == "greedy":
                assert m["identical_rows_vs_plain"] == arm["batch"]
        assert arm["strategies"]["plain"]["step_cost_vs_plain"] == 1.0
    assert "| policy" in results["table"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_without_cuda_it_measures_nothing_and_says_so(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_speed.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == gpu_speed.EXIT_NO_CUDA == 77
    assert "no CUDA device: nothing measured" in done.stdout
    assert json.loads((tmp_path / "gpu_speed.json").read_text())["measured"] is False


def test_a_step_graph_fallback_fails_the_run(tmp_path, monkeypatch):
    """A step shape's graph switches off (as after a failed capture self-check): the arm fails, and the run."""
    original = StepGraphs.run

    def failing(self, key, *args, **kwargs):
        self.failed.setdefault(key, "simulated: the capture raised")
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", failing)
    assert gpu_speed.main([*ONE_ARM, "--out-dir", str(tmp_path)]) == gpu_speed.EXIT_FAILED
    arm = json.loads((tmp_path / "gpu_speed_cpu_smoke.json").read_text())["arms"][0]
    assert arm["status"] == "FAILED"
    assert any("step graphs fell back to eager: " in p and "simulated" in p for p in arm["problems"]), arm["problems"]


def test_a_tlt_warning_fails_the_run(tmp_path, monkeypatch):
    original = StepGraphs.run

    def warning(self, *args, **kwargs):
        logging.getLogger("tlt_trainers.rollout.step_graphs").warning("TLT: simulated warning")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", warning)
    assert gpu_speed.main([*ONE_ARM, "--strategies", "plain", "--out-dir", str(tmp_path)]) == gpu_speed.EXIT_FAILED
    arm = json.loads((tmp_path / "gpu_speed_cpu_smoke.json").read_text())["arms"][0]
    assert "tlt_trainers.rollout.step_graphs: TLT: simulated warning" in arm["tlt_warnings"]
    assert arm["status"] == "FAILED"


def test_json_is_written_after_each_arm(tmp_path, monkeypatch):
    """Killed during the second arm (as the part's timeout would): the first arm is on disk, whole."""
    original, calls = gpu_speed.run_arm, []

    def killed_in_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise SystemExit("killed by the timeout (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(gpu_speed, "run_arm", killed_in_second)
    with pytest.raises(SystemExit):
        gpu_speed.main([*ONE_ARM, "--batches", "1,8", "--strategies", "plain,chain:4", "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "gpu_speed_cpu_smoke.json").read_text())
    assert results["status"] == "running" and len(results["arms"]) == 1
    assert results["arms"][0]["status"] == "ok" and set(results["arms"][0]["strategies"]) == {"plain", "chain:4"}
    assert len((tmp_path / "gpu_speed_cpu_smoke_arms.jsonl").read_text().splitlines()) == 1


def test_the_budget_skips_what_does_not_fit_and_says_so(tmp_path):
    import time

    assert gpu_speed.main([*ONE_ARM, "--deadline", str(time.time() - 1), "--out-dir", str(tmp_path)]) == \
        gpu_speed.EXIT_INCOMPLETE
    results = json.loads((tmp_path / "gpu_speed_cpu_smoke.json").read_text())
    assert results["status"] == "INCOMPLETE"
    assert [a["status"] for a in results["arms"]] == ["skipped"] and "budget" in results["arms"][0]["reason"]


def test_the_plan_runs_bf16_then_float32_greedy_and_leaves_float32_t1_optional():
    plan = gpu_speed.arm_plan(list(gpu_speed.POLICIES), list(gpu_speed.DTYPES), list(gpu_speed.BATCHES),
                              list(gpu_speed.SAMPLINGS))
    assert len(plan) == 16 and len({tuple(sorted(a.items())) for a in plan}) == 16
    assert all(a["dtype"] == "bfloat16" for a in plan[:8])
    assert all(a["dtype"] == "float32" and a["sampling"] == "greedy" for a in plan[8:12])
    assert [a["required"] for a in plan] == [True] * 12 + [False] * 4
    assert all(a["dtype"] == "float32" and a["sampling"] == "T=1" for a in plan[12:])
