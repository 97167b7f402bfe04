"""TLTGRPOTrainer as a drop-in for trl.GRPOTrainer: logs, LoRA, two ranks with idle-time drafter updates, resume,
and greedy rollouts identical to stock GRPO's."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from processes import free_port  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_scripts.common import Recorder, char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset  # noqa: E402

from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer  # noqa: E402
from tlt_trainers.trl.trainer import effective_generation_config, generation_settings  # noqa: E402

TLT_KEYS = {"tlt/acceptance_length", "tlt/draft_tokens", "tlt/accepted_tokens", "tlt/speculative_step_fraction",
            "tlt/drafter_loss", "tlt/drafter_idle_seconds", "tlt/drafter_steps", "tlt/rollout_seconds",
            "tlt/history_proposed_tokens"}
SCRIPTS = Path(__file__).parent / "trl_scripts"


def run(trainer_cls, args, peft_config=None, callbacks=(), **kwargs):
    recorder = Recorder()
    reward_funcs = kwargs.pop("reward_funcs", length_reward)
    trainer = trainer_cls(model=policy(), reward_funcs=reward_funcs, args=args, train_dataset=prompt_dataset(),
                          processing_class=char_tokenizer(), callbacks=[recorder, *callbacks],
                          peft_config=peft_config, **kwargs)
    trainer.train()
    return trainer, recorder


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_swapping_the_import_keeps_every_log_key(tmp_path, lora):
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    # A stock script: GRPOConfig and GRPOTrainer; then the same script with only the trainer's import changed.
    with_eval = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    _, stock = run(GRPOTrainer, GRPOConfig(**grpo_kwargs(tmp_path / "stock", **with_eval)), peft_config,
                   eval_dataset=prompt_dataset(4))
    trainer, ours = run(TLTGRPOTrainer, GRPOConfig(**grpo_kwargs(tmp_path / "tlt", **with_eval)), peft_config,
                        eval_dataset=prompt_dataset(4))
    missing = stock.keys() - ours.keys()
    assert not missing, f"TLTGRPOTrainer drops log keys {sorted(missing)}"
    assert TLT_KEYS <= ours.keys(), sorted(TLT_KEYS - ours.keys())
    assert {"eval_tlt/acceptance_length", "eval_tlt/draft_tokens"} <= ours.keys()
    step_logs = [log for log in ours.logs if "tlt/rollout_seconds" in log]
    assert len(step_logs) == 2
    assert all(log["tlt/drafter_steps"] >= 1 for log in step_logs)
    assert all(log["tlt/rollout_seconds"] > 0 for log in step_logs)
    assert all(log["tlt/drafter_idle_seconds"] == 0 for log in step_logs)  # one process: no idle time
    # The adaptive engine learnt its costs from its steps (no timing pass in one process) and chose a strategy at
    # every step (on this tiny model plain decoding often wins: a drafter layer costs about as much as one of the
    # policy's two layers).
    engine = trainer._tlt_engine
    assert engine.cost_profile.plain and not engine.cost_profile.verify
    assert any(sel.chosen for sel in engine._selectors.values())
    assert ours.updates and {u["trigger"] for u in ours.updates} == {"post_rollout"}
    assert all(u["rank"] == 0 and u["steps"] >= 1 and "loss" in u and u["seconds"] > 0 for u in ours.updates)
    # The final drafter is saved under output_dir.
    drafter_dir = Path(trainer.args.output_dir) / "drafter"
    assert (drafter_dir / "model.safetensors").is_file() and (drafter_dir / "optimizer.pt").is_file()
    if lora:
        assert type(trainer.model).__name__.startswith("Peft")


@pytest.mark.parametrize("speculation,architecture", [("always", "auto"), ("never", "auto"), ("always", "block")],
                         ids=["always", "never", "block-drafter"])
def test_greedy_rollouts_are_identical_to_stock(tmp_path, speculation, architecture):
    def recording_reward():
        seen = []

        def reward(completions, **kwargs):
            seen.append(list(completions))
            return length_reward(completions)

        return reward, seen

    # 4 prompts of different lengths (left padding) per step, 2 greedy completions each.
    greedy = dict(generation_kwargs={"do_sample": False}, max_completion_length=12, per_device_train_batch_size=8,
                  num_generations=2)
    stock_reward, stock_seen = recording_reward()
    run(GRPOTrainer, GRPOConfig(**grpo_kwargs(tmp_path / "stock", **greedy)), reward_funcs=stock_reward)
    ours_reward, ours_seen = recording_reward()
    trainer, recorder = run(TLTGRPOTrainer, TLTGRPOConfig(**grpo_kwargs(tmp_path / "tlt", **greedy),
                                                          speculation=speculation, num_speculative_tokens=3,
                                                          drafter_architecture=architecture),
                            reward_funcs=ours_reward)
    assert len(stock_seen) == len(ours_seen) == 2
    # Every step, not just the first: the policy updates (from identical completions) are identical too.
    assert ours_seen == stock_seen
    drafted = sum(log.get("tlt/draft_tokens", 0) for log in recorder.logs)
    if speculation == "never":  # the same engine without a drafter: the baseline
        assert drafted == 0 and trainer.drafter is None
    else:
        assert drafted > 0
        assert (type(trainer.drafter).__name__ == "BlockDrafter") == (architecture == "block")
        assert trainer.drafter_trainer.step > 0  # trained on the rollouts' features


def test_resume_restores_the_drafter(tmp_path):
    kwargs = grpo_kwargs(tmp_path / "run", save_strategy="steps", save_steps=1)
    args = TLTGRPOConfig(**kwargs, drafter_max_steps_per_update=2, drafter_update_fraction=1e3)  # 2 steps per update
    run(TLTGRPOTrainer, args)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    saved = load_file(str(checkpoint / "drafter" / "model.safetensors"))
    saved_step = json.loads((checkpoint / "drafter" / "trainer_state.json").read_text())["step"]
    assert saved_step == 2
    assert (checkpoint / "tlt_rng_state_0.pth").is_file()
    assert (tmp_path / "run" / "checkpoint-2" / "drafter" / "optimizer.pt").is_file()

    class Snapshot(Recorder):
        first = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first is None:
                self.first = ({k: v.clone() for k, v in trainer.drafter.state_dict().items()},
                              trainer.drafter_trainer.step)

    snapshot = Snapshot()
    trainer = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer(), callbacks=[snapshot])
    fresh = trainer.drafter.state_dict()
    assert not all(torch.equal(fresh[k], saved[k]) for k in saved)  # the checkpoint holds a trained drafter
    trainer.train(resume_from_checkpoint=str(checkpoint))
    weights, step = snapshot.first
    assert step == saved_step
    assert set(weights) == set(saved) and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert trainer.drafter_trainer.step == saved_step + 2  # one more update, from step 1 to 2
    assert trainer.state.global_step == 2


def test_warmup_and_drafter_from_a_folder(tmp_path):
    # Warm-up: the drafter is fitted to the policy's answers to train prompts before the first step.
    class FirstStep(Recorder):
        weights = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.weights is None:
                self.weights = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}

    args = TLTGRPOConfig(**grpo_kwargs(tmp_path / "warm", max_steps=1), drafter_warmup_prompts=4,
                         drafter_warmup_seconds=0.5)
    first = FirstStep()
    trainer = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer(), callbacks=[first])
    fresh = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    trainer.train()
    assert not all(torch.equal(fresh[k], first.weights[k]) for k in fresh)
    final = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    # The final drafter (output_dir/drafter) starts the next run via drafter_name_or_path.
    args = TLTGRPOConfig(**grpo_kwargs(tmp_path / "next"), drafter_name_or_path=str(tmp_path / "warm" / "drafter"))
    loaded = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                            processing_class=char_tokenizer())
    assert all(torch.equal(final[k], v) for k, v in loaded.drafter.state_dict().items())


@pytest.mark.parametrize("targets", ["auto", "sampled"])
def test_an_eagle3_drafter_learns_the_policys_law_from_the_engines_rollouts(tmp_path, targets):
    """At T=1 the token the policy sampled is a noisy target an EAGLE-3 drafter memorises
    (benchmarks/bench_adaptation_offline.py): by default its rollouts go through one policy forward that gives the
    policy's top-k law; 'sampled' keeps the engine's features and the sampled tokens."""
    from tiny_models import tiny_model

    from tlt_trainers import Eagle3Drafter
    from tlt_trainers.drafter.trainer import TARGET_TOP_K

    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    # learning_rate 0: the policy stays the one that sampled, whose law the buffer must hold
    args = TLTGRPOConfig(**grpo_kwargs(tmp_path, max_steps=1, temperature=1.0, learning_rate=0.0),
                         drafter_architecture="eagle3",
                         drafter_targets=targets, drafter_max_steps_per_update=1, speculation="always")
    trainer = TLTGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer())
    assert isinstance(trainer.drafter, Eagle3Drafter)
    rollout_policy = copy.deepcopy(model)
    trainer.train()
    sequences = list(trainer.drafter_trainer.buffer.sequences)
    assert len(sequences) == 4  # the step's rollouts, each once
    if targets == "sampled":
        assert all(seq.target_ids is None and seq.final is None for seq in sequences)
        return
    trainer.drafter_trainer.settle_laws(sequences)  # deferred to training: any the one micro-step did not read
    for seq in sequences:
        assert seq.target_ids.shape == (seq.features.shape[0], TARGET_TOP_K)
        with torch.no_grad():
            law = rollout_policy(seq.tokens[None]).logits[0, 1:].float().softmax(-1).topk(TARGET_TOP_K)
        torch.testing.assert_close(seq.target_probs.float(), law.values, atol=1e-3, rtol=1e-3)  # kept in float16
        assert torch.equal(seq.target_ids[:, 0], law.indices[:, 0])


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep-vocabulary", "rebuild-vocabulary"])
def test_starts_from_a_speculators_folder_trains_it_and_saves_one_that_loads_back(tmp_path, rebuild, monkeypatch):
    from tiny_models import tiny_model

    from tlt_trainers import Drafter, Eagle3Drafter
    from tlt_trainers.drafter.export_eagle3 import export_eagle3_vllm

    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    torch.manual_seed(3)
    published = Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5], draft_vocab_size=32)
    published.set_draft_vocab(torch.arange(20, 52))
    folder = export_eagle3_vllm(published, tmp_path / "speculators", "tiny/policy")  # what vLLM serves
    args = TLTGRPOConfig(**grpo_kwargs(tmp_path / "out", max_steps=2), drafter_name_or_path=str(folder),
                         drafter_update_fraction=1e3, drafter_max_steps_per_update=2,  # 2 steps, not 30 s
                         drafter_rebuild_draft_vocab=rebuild)
    recorder = Recorder()
    trainer = TLTGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer(), callbacks=[recorder])
    start = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    assert isinstance(trainer.drafter, Eagle3Drafter)
    assert all(torch.equal(start[k], v) for k, v in published.state_dict().items())  # the published drafter
    trainer.train()
    assert [log["tlt/drafter_steps"] for log in recorder.logs if "tlt/drafter_steps" in log][0] >= 1
    trained = trainer.drafter.state_dict()
    assert not torch.equal(trained["fc.weight"], start["fc.weight"])  # trained online
    assert torch.equal(trained["d2t"], start["d2t"]) != rebuild  # its vocabulary is kept unless asked
    # trainer.push_to_hub() carries the drafter, with its card. Only the Hub's network is mocked: the upload is
    # copied to a local folder.
    import shutil
    from types import SimpleNamespace

    import huggingface_hub

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: SimpleNamespace(repo_id=f"someone/{repo_id}"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, *, repo_id, folder_path, **kw: (
        shutil.copytree(folder_path, hub / repo_id, ignore=shutil.ignore_patterns("_*", "checkpoint-*"))))
    trainer.push_to_hub()
    pushed = hub / "someone" / "out" / "drafter"
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in pushed.iterdir()}
    assert "Drafter.from_pretrained" in (pushed / "README.md").read_text()
    loaded = Drafter.from_pretrained(pushed, target=model)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_tool_loop_gets_one_drafter_update_per_rollout(tmp_path, monkeypatch):
    """TRL's tool loop calls _generate_single_turn a data-dependent number of times: the update (with its
    collectives) must come once per rollout, after the loop."""
    import inspect

    calls = []

    def fake_tool_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        extra = {"num_generations": len(prompt_ids)} if "num_generations" in inspect.signature(
            self._generate_single_turn).parameters else {}
        for _ in range(1 + len(calls) % 2):  # 1 or 2 more turns, as tool calls would need
            self._generate_single_turn(prompt_ids, None, {}, **extra)
        calls.append(len(prompt_ids))
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        return tool_mask, completions, completion_ids, logprobs, 0, 0, [[] for _ in completion_ids]

    def lookup(query: str) -> str:
        """A tool.

        Args:
            query: what to look up.
        """
        return query

    monkeypatch.setattr(GRPOTrainer, "_tool_call_loop", fake_tool_loop)
    recorder = Recorder()
    trainer = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=GRPOConfig(**grpo_kwargs(tmp_path)),
                             train_dataset=prompt_dataset(), processing_class=char_tokenizer(), callbacks=[recorder])
    trainer.tools = trainer._standalone_tools = [lookup]  # set after construction: the char tokenizer has no template
    trainer.train()
    assert len(calls) == 2
    assert len(recorder.updates) == 2 and [u["global_step"] for u in recorder.updates] == [0, 1]
    # The drafter trained after the loop, on every turn's rows: 4 rows x (1 + 1) turns, then 4 x (1 + 2) more.
    assert [u["buffer_sequences"] for u in recorder.updates] == [8, 20]
    assert all("tools/call_frequency" in log for log in recorder.logs if "tlt/rollout_seconds" in log)



@pytest.mark.multiprocess
def test_two_ranks_train_the_drafter_in_idle_time_and_agree(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(SCRIPTS / "two_ranks.py"), str(tmp_path), "--steps", "3",
               "--slow-seconds", "1.0", "--speculation", "adaptive"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    fast, slow = ranks
    assert fast["world"] == 2
    # The fast rank trained while rank 1 was still generating: one idle update per step.
    idle = [u for u in fast["updates"] if u["trigger"] == "idle"]
    assert len(idle) == 3 and all(u["steps"] >= 1 and u["seconds"] > 0 for u in idle)
    # The slow rank had nobody to wait for. (It may squeeze in a micro-step before it sees that the others have
    # arrived; its drafter is discarded anyway, since the source is the rank that trained most.)
    assert len(slow["updates"]) == 3 and any(u["trigger"] == "post_rollout" for u in slow["updates"])
    assert sum(u["steps"] for u in slow["updates"]) <= 3 < sum(u["steps"] for u in idle)
    assert all(u["source_rank"] == 0 for u in fast["updates"] + slow["updates"])
    # Its first idle time also timed the engine's passes, the tail's batch sizes first (then nothing is left).
    assert fast["updates"][0]["costs_timed"][:2] == [1, 2] and not fast["updates"][-1]["costs_timed"]
    # Bit-identical drafters (weights, draft vocabulary) and optimizer states on both ranks.
    weights = [load_file(str(tmp_path / f"drafter_rank{r}.safetensors")) for r in (0, 1)]
    assert set(weights[0]) == set(weights[1])
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    optim = [torch.load(tmp_path / f"optimizer_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert optim[0]["state"].keys() == optim[1]["state"].keys() and optim[0]["state"]
    for key, state in optim[0]["state"].items():
        assert all(torch.equal(value, optim[1]["state"][key][name]) for name, value in state.items())
    assert fast["drafter_step"] == slow["drafter_step"] > 0
    step_logs = [log for log in fast["logs"] if "tlt/drafter_idle_seconds" in log]
    assert len(step_logs) == 3 and all(log["tlt/drafter_idle_seconds"] > 0 for log in step_logs)


def test_settings_that_cannot_be_honoured_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="needs CUDA.*vllm_mode='colocate'"):
        TLTGRPOTrainer(model=policy(), reward_funcs=length_reward,
                       args=GRPOConfig(**grpo_kwargs(tmp_path), use_vllm=True, vllm_mode="server"),
                       train_dataset=prompt_dataset(), processing_class=char_tokenizer())
    with pytest.raises(ValueError, match="speculation"):
        TLTGRPOConfig(**grpo_kwargs(tmp_path), speculation="sometimes")


def test_generation_settings_follow_transformers_merge():
    from transformers import GenerationConfig

    model = policy()
    model.generation_config.top_k = 7  # the model's value fills what TRL leaves unset (None) ...
    settings = generation_settings(effective_generation_config(
        GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=5, eos_token_id=[1]), model))
    assert settings["top_k"] == 7 and settings["temperature"] == 0.7 and settings["top_p"] == 0.9
    assert settings["do_sample"] and settings["eos_token_id"] == [1]
    settings = generation_settings(effective_generation_config(GenerationConfig(top_k=0, do_sample=True), model))
    assert settings["top_k"] == 0  # ... but not what TRL sets explicitly
    with pytest.raises(ValueError, match="stop_strings"):
        generation_settings(effective_generation_config(GenerationConfig(stop_strings=["\n"]), model))


def test_history_drafting_is_on_by_default(tmp_path):
    """GRPO groups share a prompt, so siblings propose drafts for each other unless switched off."""
    from tlt_trainers.trl.config import resolve_tlt_settings

    for args in (TLTGRPOConfig(**grpo_kwargs(tmp_path)), GRPOConfig(**grpo_kwargs(tmp_path))):
        config = resolve_tlt_settings(args).tlt_config()
        assert config.history_drafting and any(s.history_tokens for s in config.speculation_strategies())
    off = resolve_tlt_settings(TLTGRPOConfig(**grpo_kwargs(tmp_path), history_drafting=False)).tlt_config()
    assert not any(s.history_tokens for s in off.speculation_strategies())


def test_where_the_drafter_trains_with_vllm():
    """A rank trains in idle time only where it can finish generating before another: without vLLM, or colocated
    vLLM whose tensor-parallel groups do not span all ranks. Server mode and one process train after the old-logps
    pass, for a budget."""
    from types import SimpleNamespace

    def trains_at_generation_end(use_vllm, mode="colocate", tp=1, world=1):
        trainer = SimpleNamespace(use_vllm=use_vllm, vllm_mode=mode, vllm_tensor_parallel_size=tp,
                                  _tlt_ranks=SimpleNamespace(distributed=world > 1, world=world))
        return TLTGRPOTrainer._tlt_trains_at_generation_end.fget(trainer)

    assert trains_at_generation_end(False) and trains_at_generation_end(False, world=4)
    assert not trains_at_generation_end(True)
    assert trains_at_generation_end(True, world=2)
    assert not trains_at_generation_end(True, "server", world=2)
    assert not trains_at_generation_end(True, tp=2, world=2)
    assert trains_at_generation_end(True, tp=2, world=4)


class EngineMemoryProbe(TrainerCallback):
    """What the trainer's engine holds during each training step: read after the loss's backward, before the
    optimizer step (GRPO's rollout for the step has run by then), with the last release the trainer made."""

    def __init__(self):
        self.trainer = None
        self.held: list[int] = []
        self.releases: list = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.held.append(self.trainer._tlt_engine.held_bytes())
        self.releases.append(self.trainer._tlt_memory_release)
        self.trainer._tlt_memory_release = None  # each step's rollout must release anew


@pytest.mark.parametrize("keep", [False, True], ids=["given-back", "kept"])
def test_engine_memory_is_given_back_before_the_training_step(tmp_path, keep):
    """The engine's graph session (``cuda_graphs="static"``: the CPU stand-in for CUDA graphs, which keeps the same
    caches and buffers across calls) is freed after each rollout, before the step, unless keep_engine_memory."""
    probe = EngineMemoryProbe()
    args = TLTGRPOConfig(**grpo_kwargs(tmp_path), speculation="always", num_speculative_tokens=3,
                         cuda_graphs="static", keep_engine_memory=keep)
    trainer = TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                             processing_class=char_tokenizer(), callbacks=[probe])
    probe.trainer = trainer
    trainer.train()
    assert len(probe.held) == 2  # both steps
    if keep:
        assert all(held > 0 for held in probe.held)
        assert probe.releases == [None, None]
    else:
        assert probe.held == [0, 0]
        assert all(r is not None and r.held_bytes > 0 and r.session_freed for r in probe.releases)
