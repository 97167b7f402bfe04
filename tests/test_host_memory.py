"""Freed host memory goes back to the system (tlt_trainers/modeling/host_memory.py): glibc keeps the free pages of a
heap that small kept tensors pin, which made a drafter's feature pass over a data folder run out of memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tlt_trainers.modeling import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory read from /proc")


PATTERN = """
import ctypes, ctypes.util, importlib.util, sys, torch

spec = importlib.util.spec_from_file_location("host_memory", sys.argv[2])  # alone: the package's imports would
host_memory = importlib.util.module_from_spec(spec)  # leave the heap in a state that varies between runs
spec.loader.exec_module(host_memory)

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6

# Where a process has freed a large block, glibc serves blocks below it from the heap (its dynamic mmap threshold);
# whether torch's import already did varies between runs, so the threshold is set as it would have risen
ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
base = resident_mb()
kept = []
for i in range(100):  # a feature pass in small, shortest rows first: growing activations freed, a tensor kept beside
    activations = torch.ones((2 << 20) + i * (64 << 10), dtype=torch.uint8)
    kept.append(torch.ones(1024, dtype=torch.uint8))
    del activations
if sys.argv[1] == "release":
    assert host_memory.release_freed_host_memory()
print(resident_mb() - base)
"""


def held_mb(release: bool) -> float:
    """What the pattern leaves the process holding, in a fresh process (a heap with no earlier holes)."""
    done = subprocess.run([sys.executable, "-c", PATTERN, "release" if release else "keep", host_memory.__file__],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def test_the_pages_freed_between_kept_tensors_go_back_to_the_system():
    held = held_mb(release=False)
    assert held > 200, f"glibc kept {held:.0f} MB: the pattern no longer shows what it is for"
    assert held_mb(release=True) < 0.1 * held


def test_a_feature_pass_on_the_cpu_releases_after_each_block(monkeypatch):
    from tiny_models import padded_prompts, tiny_model

    import tlt_trainers.drafter.trainer as trainer_module
    from tlt_trainers import DrafterTrainer, EagleDrafter

    model = tiny_model("llama")
    trainer = DrafterTrainer(EagleDrafter.from_target(model), model)
    calls = []
    monkeypatch.setattr(trainer_module, "release_freed_host_memory", lambda: calls.append(len(trainer.buffer)))
    ids, mask = padded_prompts([5, 7, 4] * 30, seed=1)  # 90 rows: two blocks of at most 64
    trainer.add_sequences(ids, mask)
    assert calls == [64, 90]


def test_drafter_training_on_the_cpu_releases_every_few_micro_steps(monkeypatch):
    from tiny_models import padded_prompts, tiny_model

    import tlt_trainers.drafter.trainer as trainer_module
    from tlt_trainers import DrafterTrainer, EagleDrafter

    model = tiny_model("llama")
    trainer = DrafterTrainer(EagleDrafter.from_target(model), model, micro_batch_size=2)
    trainer.add_sequences(*padded_prompts([5, 7, 4, 6], seed=1))
    released = []
    monkeypatch.setattr(trainer_module, "RELEASE_EVERY_STEPS", 3)
    monkeypatch.setattr(trainer_module, "release_freed_host_memory", lambda: released.append(trainer.step))
    trainer.train(max_steps=7)
    assert released == [3, 6]
