"""Faults as a user meets them: each one recovers, or stops within seconds with an error naming the cause and the
fix, and loses nothing (the last complete checkpoint loads, drafter included).

Each fault, what happens, and where it is tested:

- a truncated or corrupt drafter weights file, at load and at resume: a ValueError naming the file and the fix (here);
- a checkpoint without ``drafter/``: a warning, and training goes on with the drafter it started with
  (test_trl_trainer.py);
- a write error (a full disk) during a drafter save: the error says nothing was replaced; the previous drafter and
  checkpoint load as they were (here);
- NaN or inf in the policy's logits: ``NonFiniteLogitsError`` naming the cause and the fix, plain and chain, greedy
  and sampled; a policy that is NaN already is refused when the engine is built (here);
- an interrupt during a rollout: the interrupted rollout lets go of the engine's kept graph session at once (its
  traceback may outlive it), the next call takes that session again and is exact, and a step of the interrupted
  rollout says to start a new one (here);
- a rank killed during idle-time drafter training (torchrun, 2 ranks, gloo; rank 0's slices are recorded, and it
  was inside one at the kill): torchrun stops the other rank within seconds and names the dead one; the last
  checkpoint loads, drafter included, its tensors equal to the checkpoint's file and not the fresh drafter's (here);
- vLLM's CPU sampling fix failing or absent: the plugin never stops vLLM; sampled steps stay plain and the engine
  says why (test_vllm_cpu_sampling.py, test_vllm_law.py);
- a drafter reload into a running vLLM engine that fails half way: the engine goes on with the last good drafter
  (test_vllm.py).

The disk-full fault is a ``save_file`` / ``torch.save`` that writes part of its file and raises ``OSError(ENOSPC)``
(a real full disk cannot be made here without root); everything else is real.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import free_port
from tiny_models import padded_prompts, tiny_model

from tlt_trainers import Drafter, DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout.rollout import NonFiniteLogitsError

SCRIPTS = Path(__file__).parent / "trl_scripts"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def drafter(model):
    torch.manual_seed(0)
    return EagleDrafter.from_target(model)


def _states_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


# ------------------------------------------------------------------------------------------ drafter files
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_drafter_file_names_the_file_and_the_fix(model, drafter, tmp_path, damage):
    drafter.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        Drafter.from_pretrained(tmp_path, target=model)
    assert str(weights) in str(error.value) and "re-save" in str(error.value)


def test_a_damaged_drafter_checkpoint_stops_the_resume_with_the_fix(model, drafter, tmp_path):
    trainer = DrafterTrainer(drafter, model)
    trainer.save_checkpoint(tmp_path)
    for name in ("model.safetensors", "optimizer.pt"):
        damaged = tmp_path / "damaged" / name
        damaged.parent.mkdir(exist_ok=True)
        for other in tmp_path.iterdir():
            if other.is_file():
                (damaged.parent / other.name).write_bytes(other.read_bytes())
        damaged.write_bytes(damaged.read_bytes()[:100])
        with pytest.raises(ValueError, match="incomplete or corrupt.*earlier checkpoint") as error:
            DrafterTrainer(EagleDrafter.from_target(model), model).load_checkpoint(damaged.parent)
        assert str(damaged.parent) in str(error.value)


def _full_disk(real, fraction=0.5):
    """``real`` (a writer taking the file as its second argument) that writes part of the file, then fails."""
    def write(obj, file, *args, **kwargs):
        real(obj, file, *args, **kwargs)
        path = Path(file)
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * fraction)])
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
    return write


def test_a_full_disk_during_a_save_leaves_the_previous_drafter_whole(model, drafter, tmp_path, monkeypatch):
    import tlt_trainers.drafter.base as base

    drafter.save_pretrained(tmp_path)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)
    monkeypatch.setattr(base, "save_file", _full_disk(base.save_file))
    with pytest.raises(OSError, match="No space left") as error:
        drafter.save_pretrained(tmp_path)
    assert "Nothing in" in "".join(getattr(error.value, "__notes__", []))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temporary left
    assert _states_equal(Drafter.from_pretrained(tmp_path, target=model).state_dict(), before)


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_checkpoint_whole(model, drafter, tmp_path, monkeypatch):
    import tlt_trainers.drafter.trainer as trainer_module

    trainer = DrafterTrainer(drafter, model)
    trainer.save_checkpoint(tmp_path)
    saved = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer.step = 7
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)
    monkeypatch.setattr(trainer_module.torch, "save", _full_disk(torch.save))  # the optimizer state, written 2nd
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(tmp_path)
    monkeypatch.undo()
    resumed = DrafterTrainer(EagleDrafter.from_target(model), model)
    resumed.load_checkpoint(tmp_path)
    assert resumed.step == 0 and _states_equal(resumed.drafter.state_dict(), saved)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ the rollout
class NaNAfter:
    """Makes the policy's final hidden states NaN from its ``calls``-th decoder pass on (0: at once)."""

    def __init__(self, model, calls: int, value: float = float("nan")):
        self.left, self.value = calls, value
        self.handle = model.model.norm.register_forward_hook(self)

    def __call__(self, module, args, out):
        self.left -= 1
        return out if self.left >= 0 else torch.full_like(out, self.value)


@pytest.mark.parametrize("strategy", ["plain", "chain:3"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_logits_stop_the_rollout_with_the_cause(model, drafter, strategy, do_sample, value):
    config = TLTConfig(speculation="never") if strategy == "plain" else TLTConfig(speculation="always",
                                                                                   strategy=strategy)
    engine = SpeculativeGenerator(model, None if strategy == "plain" else drafter, config)
    ids, mask = padded_prompts([3, 5])
    hook = NaNAfter(model, 3, value)  # a few steps in: a policy that diverges mid-rollout
    try:
        with pytest.raises(NonFiniteLogitsError, match="NaN or inf.*Check the checkpoint") as error:
            engine.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=do_sample)
        assert error.value.rows >= 1 and error.value.generated > 0
    finally:
        hook.handle.remove()


def test_a_policy_with_nan_is_refused_at_construction(model):
    hook = NaNAfter(model, 0)
    try:
        with pytest.raises(ValueError, match="NaN or inf on a three-token test input"):
            SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
        # where model.generate fails too when it samples (and returns garbage when greedy)
        ids, mask = padded_prompts([3, 5])
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, pad_token_id=0)
    finally:
        hook.handle.remove()


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_an_interrupted_rollout_leaves_the_engine_exact(model, drafter, do_sample):
    """An interrupt in the middle of a call, on an engine that keeps its graph session between calls
    (``cuda_graphs="static"``: the cache, the static buffers and the step graphs' inputs a capture would record):
    the next call takes the same session again and is exact; nothing the interrupted call wrote is read."""
    config = TLTConfig(speculation="always", strategy="chain:3", cuda_graphs="static")
    ids, mask = padded_prompts([3, 5, 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=do_sample)
    reference_engine = SpeculativeGenerator(model, drafter, config)
    torch.manual_seed(1)
    reference = reference_engine.generate(ids, **kwargs).sequences

    engine = SpeculativeGenerator(model, drafter, config)
    other_ids, other_mask = padded_prompts([6, 2, 7], seed=5)  # the interrupted call fills the session with others
    torch.manual_seed(2)
    engine.generate(ids, **kwargs)  # the session the later calls keep
    session = engine._graph_session
    assert session is not None
    calls = [0]

    def interrupt(module, args):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt

    handle = model.model.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt) as interrupted:
            engine.generate(other_ids, attention_mask=other_mask, max_new_tokens=20, do_sample=do_sample)
    finally:
        handle.remove()
    assert calls[0] == 6  # interrupted in its decode steps, on that session
    # The interrupt's traceback is kept, as an interactive session keeps it (sys.last_traceback), and with it the
    # interrupted call's rollout: it must have let go of the session
    assert interrupted.value.__traceback__ is not None
    torch.manual_seed(1)
    rollout = engine.start(ids, **kwargs)
    assert rollout.session is session, "the next call took a private session: the interrupted one still holds it"
    assert torch.equal(rollout.run().sequences, reference)
    stopped = next(f.frame.f_locals["self"] for f in interrupted.traceback
                   if type(f.frame.f_locals.get("self")).__name__ == "Rollout")
    with pytest.raises(RuntimeError, match="start a new one"):
        stopped.step()


# ------------------------------------------------------------------------------------------ ranks

@pytest.mark.multiprocess
def test_a_rank_killed_during_idle_training_stops_the_run_and_keeps_the_checkpoint(tmp_path):
    pytest.importorskip("trl")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(SCRIPTS / "dead_rank.py"), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-4000:]
    killed_at = float((tmp_path / "killed_at").read_text())
    print(f"\nthe run ended {ended - killed_at:.1f} s after rank 1 was killed")
    assert ended - killed_at < 60, log[-4000:]  # not a collective timeout (30 minutes)
    assert "SIGKILL" in log and "rank" in log.lower()  # torchrun names the dead rank and its signal
    checkpoint = tmp_path / "tlt" / "checkpoint-1"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1
    from trl_scripts.common import policy

    saved = json.loads((checkpoint / "drafter" / "trainer_state.json").read_text())
    assert saved["step"] > 0  # the drafter had trained before the checkpoint: there is something to lose
    fresh = EagleDrafter.from_target(policy())
    resumed = DrafterTrainer(EagleDrafter.from_target(policy()), policy())
    resumed.load_checkpoint(checkpoint / "drafter")  # the drafter of the last complete checkpoint loads
    assert resumed.step == saved["step"]
    from safetensors.torch import load_file

    on_disk = load_file(str(checkpoint / "drafter" / "model.safetensors"))
    loaded = resumed.drafter.state_dict()
    assert on_disk and set(on_disk) <= set(loaded)
    for name, tensor in on_disk.items():
        assert torch.equal(loaded[name].to(tensor.dtype), tensor), name  # the resumed drafter is the file's
    assert any(not torch.equal(fresh.state_dict()[name].to(t.dtype), t) for name, t in on_disk.items())  # trained

    # Rank 0 was inside an idle-time training slice (step 2's, waiting for rank 1) when rank 1 died
    events = [json.loads(line) for line in (tmp_path / "idle_slices.jsonl").read_text().splitlines()]
    starts = [e for e in events if "start" in e and e["global_step"] == 1]
    ends = [e for e in events if "end" in e and e["global_step"] == 1]
    print(f"rank 0's idle slices: {events}; rank 1 killed at {killed_at}")
    assert starts and starts[-1]["start"] < killed_at, events
    assert not ends or ends[-1]["end"] > killed_at, events


def test_a_checkpoint_without_its_drafter_resumes_with_a_warning(tmp_path, caplog):
    pytest.importorskip("trl")
    import shutil

    from trl_scripts.common import char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset

    from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer

    args = TLTGRPOConfig(**grpo_kwargs(tmp_path / "run", save_strategy="steps", save_steps=1))
    TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                   processing_class=char_tokenizer()).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    shutil.rmtree(checkpoint / "drafter")  # a checkpoint written by stock GRPOTrainer, or copied without it
    trainer = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer())
    with caplog.at_level("WARNING"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "holds no drafter" in caplog.text
    assert trainer.state.global_step == 2 and trainer.drafter_trainer.step > 0  # went on, and trained its drafter
