"""A full veRL training run on CPU: ``python -m tlt_trainers.verl.main_ppo`` (the real entry point, a local Ray,
gloo, FSDP2 actor, our tlt rollout backend) for 2 GRPO steps on a tiny random Llama, then a resume for a third.

Needs the ``[verl]`` extra (skipped without it). About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("verl")
pd = pytest.importorskip("pandas")

from tiny_models import EOS, tiny_model  # noqa: E402
from verl_runs import run_main_ppo, step_lines, write_assets  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_fit")
    model = tiny_model("llama", vocab_size=64, seed=11, logit_scale=2.0)
    model.generation_config.eos_token_id = EOS
    model.config.eos_token_id = EOS
    return write_assets(root, model)


def train(assets, steps: int) -> subprocess.CompletedProcess:
    return run_main_ppo(assets, steps, "fit", "tlt.speculation=always", "tlt.num_speculative_tokens=2")


def test_two_grpo_steps_on_cpu_then_resume(assets):
    first = train(assets, steps=2)
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-6000:]
    lines = step_lines(log)
    for step in (1, 2):
        line = lines.get(step)
        assert line is not None, f"no step {step} in the training log:\n{log[-4000:]}"
        for key in ("actor/pg_loss", "tlt/acceptance_length", "tlt/drafter_steps", "critic/score/mean"):
            assert key in line, f"{key} missing from step {step}"
    for step in (1, 2):
        drafter = assets / "ckpt" / f"global_step_{step}" / "drafter"
        assert (drafter / "config.json").is_file(), f"no drafter checkpoint in {drafter}"

    resumed = train(assets, steps=3)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-6000:]
    assert "TLT: drafter restored from" in log and "global_step_2" in log
    assert 3 in step_lines(log)
