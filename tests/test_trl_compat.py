"""The swap-in keeps every GRPOTrainer feature: each feature that TRL's own GRPO tests exercise runs through stock
``GRPOTrainer`` and ``TLTGRPOTrainer`` with the same settings, and the outcome must be the same.

Rollouts are greedy (``do_sample=False``) so that both trainers see the same completions: then every step's
completions, rewards, losses, gradient norms and completion statistics must agree, not only "the run finished".
Where TLT's engine cannot reproduce stock generation (a replaced ``generate``, beam search, a hybrid model), the
rollout goes the stock way and the outcome is still the same. Runs are tiny (random 2-layer models, offline,
seconds each); a TRL upgrade that changes a feature shows here as the first failing row.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from tiny_models import EOS, PAD, tiny_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_scripts.common import Recorder, char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset  # noqa: E402

from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer  # noqa: E402
from tlt_trainers.modeling.target import compute_dtype  # noqa: E402
from tlt_trainers.trl.stock_generation import TRANSFORMERS_GENERATE  # noqa: E402

# Logged values that depend only on the completions and the optimisation (not on timing or on TLT's own counters).
DETERMINISTIC_PREFIXES = ("loss", "reward", "rewards/", "completions/", "kl", "entropy", "clip_ratio", "grad_norm",
                          "frac_reward_zero_std", "num_tokens", "learning_rate", "tools/", "eval_loss",
                          "eval_reward", "eval_completions/", "eval_rewards/")
GREEDY = {"do_sample": False}


def vowel_reward(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in str(c))) for c in completions]


def recording(reward):
    """``reward`` that also keeps every batch of completions it scores (the rollouts themselves)."""
    seen = []

    def wrapped(completions, **kwargs):
        seen.append([str(c) for c in completions])
        return reward(completions, **kwargs)

    wrapped.__name__ = reward.__name__
    return wrapped, seen


def run(trainer_cls, tmp_path: Path, *, config: dict | None = None, model_factory=policy, tokenizer=char_tokenizer,
        reward_funcs=(length_reward,), dataset=None, prepare=None, train_kwargs=None, tlt: dict | None = None,
        **trainer_kwargs):
    """One tiny GRPO run; returns (trainer, recorder, completions seen by the first reward per step).

    ``tlt``: TLTGRPOConfig settings for a TLTGRPOTrainer run (a plain GRPOConfig otherwise, as a swapped-in script
    has)."""
    if model_factory == "saved":  # a path, as TRL's own tests pass: the reference model is loaded from it
        model_factory = saved_policy(tmp_path)
    settings = {"generation_kwargs": dict(GREEDY), **(config or {})}
    kwargs = grpo_kwargs(tmp_path / trainer_cls.__name__, **settings)
    args = TLTGRPOConfig(**kwargs, **tlt) if tlt and trainer_cls is TLTGRPOTrainer else GRPOConfig(**kwargs)
    first, seen = recording(reward_funcs[0]) if callable(reward_funcs[0]) and not isinstance(
        reward_funcs[0], torch.nn.Module) else (reward_funcs[0], [])
    recorder = Recorder()
    trainer = trainer_cls(model=model_factory(), reward_funcs=[first, *reward_funcs[1:]], args=args,
                          train_dataset=dataset if dataset is not None else prompt_dataset(),
                          processing_class=tokenizer(), callbacks=[recorder], **trainer_kwargs)
    if prepare is not None:
        with prepare(trainer):
            trainer.train(**(train_kwargs or {}))
    else:
        trainer.train(**(train_kwargs or {}))
    return trainer, recorder, seen


def saved_policy(tmp_path: Path):
    path = tmp_path / "policy"
    if not path.is_dir():
        policy().save_pretrained(path)
    return lambda: str(path)


def deterministic(log: dict) -> dict:
    return {k: v for k, v in log.items() if k.startswith(DETERMINISTIC_PREFIXES) and isinstance(v, (int, float))}


def assert_same_outcome(stock, ours, rel: float = 1e-5) -> None:
    """Same log keys (TLT's may add), same completions every step, same deterministic logged values."""
    _, stock_rec, stock_seen = stock
    _, ours_rec, ours_seen = ours
    missing = stock_rec.keys() - ours_rec.keys()
    assert not missing, f"TLTGRPOTrainer drops log keys {sorted(missing)}"
    assert ours_seen == stock_seen, "the rollouts differ from stock GRPOTrainer's"
    stock_logs, ours_logs = [deterministic(x) for x in stock_rec.logs], [deterministic(x) for x in ours_rec.logs]
    assert len(stock_logs) == len(ours_logs)
    for step, (expected, got) in enumerate(zip(stock_logs, ours_logs)):
        assert expected.keys() == got.keys(), (step, sorted(expected.keys() ^ got.keys()))
        for key, value in expected.items():
            both_nan = math.isnan(value) and math.isnan(got[key])
            assert both_nan or math.isclose(value, got[key], rel_tol=rel, abs_tol=1e-7), (step, key, value, got[key])


def compare(tmp_path: Path, **kwargs):
    stock = run(GRPOTrainer, tmp_path, **{k: v for k, v in kwargs.items() if k != "tlt"})
    ours = run(TLTGRPOTrainer, tmp_path, **kwargs)
    assert_same_outcome(stock, ours)
    return stock, ours


# ---------------------------------------------------------------------------------------------- GRPOConfig features
FEATURES = {
    "reward_weights": dict(reward_funcs=(length_reward, vowel_reward), config={"reward_weights": [1.0, 0.5]}),
    "multi_objective_aggregation": dict(reward_funcs=(length_reward, vowel_reward),
                                        config={"multi_objective_aggregation": "normalize_then_sum"}),
    "beta_reference_model": dict(config={"beta": 0.1}, model_factory="saved"),
    "num_iterations": dict(config={"num_iterations": 2}),
    "steps_per_generation": dict(config={"steps_per_generation": 2, "per_device_train_batch_size": 2}),
    "gradient_accumulation": dict(config={"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
    "scale_rewards_none": dict(config={"scale_rewards": "none"}),
    "scale_rewards_batch": dict(config={"scale_rewards": "batch"}),
    "sequence_importance_sampling": dict(config={"importance_sampling_level": "sequence"}),
    "top_entropy_quantile": dict(config={"top_entropy_quantile": 0.2}),
    "delta_clipping": dict(config={"delta": 2.0, "num_iterations": 2}),
    "mask_truncated_completions": dict(config={"mask_truncated_completions": True, "max_completion_length": 4}),
    "max_completion_length_cut": dict(config={"max_completion_length": 3}),
    "repetition_penalty": dict(config={"generation_kwargs": {**GREEDY, "repetition_penalty": 1.5}}),
    "evaluation": dict(config={"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4},
                       eval_dataset=prompt_dataset(4)),
    "logging_completions": dict(config={"log_completions": True, "num_completions_to_print": 2}),
    "disable_dropout": dict(config={"disable_dropout": True}),
    "gradient_checkpointing": dict(config={"gradient_checkpointing": True}),
    "sync_ref_model": dict(config={"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1,
                                   "ref_model_mixup_alpha": 0.5}, model_factory="saved"),
}
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_config_feature_has_the_stock_outcome(tmp_path, feature):
    compare(tmp_path, **FEATURES[feature])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_has_the_stock_outcome(tmp_path, loss_type):
    compare(tmp_path, config={"loss_type": loss_type, "gradient_accumulation_steps": 2,
                              "per_device_train_batch_size": 2})


def test_reward_model_has_the_stock_outcome(tmp_path):
    def reward_model():
        torch.manual_seed(5)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=PAD, num_labels=1)
        return AutoModelForSequenceClassification.from_config(config).eval()

    stock = run(GRPOTrainer, tmp_path, reward_funcs=(length_reward, reward_model()),
                reward_processing_classes=[None, char_tokenizer()])
    ours = run(TLTGRPOTrainer, tmp_path, reward_funcs=(length_reward, reward_model()),
               reward_processing_classes=[None, char_tokenizer()])
    assert_same_outcome(stock, ours)


def test_lora_has_the_stock_outcome(tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    stock = run(GRPOTrainer, tmp_path, peft_config=lora())
    ours = run(TLTGRPOTrainer, tmp_path, peft_config=lora())
    assert_same_outcome(stock, ours)
    assert type(ours[0].model).__name__.startswith("Peft")


def test_several_eos_ids_end_completions_as_stock(tmp_path):
    def two_eos_policy():
        model = policy()
        model.generation_config.eos_token_id = [EOS, 7]  # an end-of-turn token besides the tokenizer's EOS
        return model

    stock, ours = compare(tmp_path, model_factory=two_eos_policy, config={"max_completion_length": 16})
    assert ours[0].eos_token_ids == stock[0].eos_token_ids == [EOS, 7]
    completions = [c for batch in ours[2] for c in batch]
    assert all("e" not in c[:-1] for c in completions)  # token 7 is "e": it ends a completion


def test_checkpoints_resume_as_stock(tmp_path):
    config = {"save_strategy": "steps", "save_steps": 1, "max_steps": 2}
    stock = run(GRPOTrainer, tmp_path / "first", config=config)
    ours = run(TLTGRPOTrainer, tmp_path / "first", config=config)
    assert_same_outcome(stock, ours)
    stock_files = {p.name for p in (tmp_path / "first" / "GRPOTrainer" / "checkpoint-1").iterdir()}
    ours_files = {p.name for p in (tmp_path / "first" / "TLTGRPOTrainer" / "checkpoint-1").iterdir()}
    assert stock_files <= ours_files and "drafter" in ours_files
    resumed = {"max_steps": 3}
    stock = run(GRPOTrainer, tmp_path / "first", config={**config, **resumed},
                train_kwargs={"resume_from_checkpoint": str(tmp_path / "first" / "GRPOTrainer" / "checkpoint-2")})
    ours = run(TLTGRPOTrainer, tmp_path / "first", config={**config, **resumed},
               train_kwargs={"resume_from_checkpoint": str(tmp_path / "first" / "TLTGRPOTrainer" / "checkpoint-2")})
    assert_same_outcome(stock, ours)
    assert ours[0].state.global_step == stock[0].state.global_step == 3


# --------------------------------------------------------------- generation TLT's engine does not reproduce: stock
def max_lengths(result) -> list[float]:
    return [log["completions/max_length"] for log in result[1].logs if "completions/max_length" in log]


def short_generate(model):
    """A test double in place of ``model.generate``: transformers' generate capped at 3 new tokens (any custom
    decoding looks like this to the trainer)."""
    original = TRANSFORMERS_GENERATE  # as defined, even while a test patches GenerationMixin.generate

    def generate(*args, **kwargs):
        config = kwargs["generation_config"]
        kwargs["generation_config"] = type(config)(**{**config.to_dict(), "max_new_tokens": 3})
        return original(model, *args, **kwargs)

    return generate


class ShortGenerateLlama(LlamaForCausalLM):
    def generate(self, *args, **kwargs):
        return short_generate(self)(*args, **kwargs)


def short_generate_policy():
    model = policy()
    model.__class__ = ShortGenerateLlama
    return model


def patched_on_instance(trainer):
    return patch.object(trainer.model, "generate", short_generate(trainer.model))


ALWAYS = {"speculation": "always", "num_speculative_tokens": 3}


def test_generate_replaced_on_the_instance_is_honoured(tmp_path, caplog):
    stock, ours = compare(tmp_path, prepare=patched_on_instance, config={"max_completion_length": 8}, tlt=ALWAYS)
    assert max_lengths(ours) == [3, 3]  # the double's completions (3 tokens), not the engine's (8)
    assert all(log["tlt/draft_tokens"] == 0 for log in ours[1].logs if "tlt/draft_tokens" in log)
    assert "generate is replaced on the model instance" in caplog.text


def test_generate_patched_on_generation_mixin_is_honoured(tmp_path):
    """As TRL's own tests do: ``patch("transformers.generation.utils.GenerationMixin.generate")`` (no ``self``)."""

    def patched_on_the_mixin(trainer):
        double = short_generate(trainer.model)
        return patch("transformers.generation.utils.GenerationMixin.generate",
                     side_effect=lambda *args, **kwargs: double(*args, **kwargs))

    stock, ours = compare(tmp_path, prepare=patched_on_the_mixin, config={"max_completion_length": 8}, tlt=ALWAYS)
    assert max_lengths(ours) == [3, 3]


def test_generate_overridden_in_a_subclass_is_honoured(tmp_path):
    stock, ours = compare(tmp_path, model_factory=short_generate_policy, config={"max_completion_length": 8})
    assert max_lengths(ours) == [3, 3]
    assert ours[0].drafter_trainer.step > 0  # the drafter still learns from the stock rollouts


@pytest.mark.parametrize("setting", [{"num_beams": 2}, {"no_repeat_ngram_size": 2}], ids=["num_beams",
                                                                                          "no_repeat_ngram_size"])
def test_generation_settings_the_engine_does_not_reproduce_go_stock(tmp_path, setting):
    stock, ours = compare(tmp_path, config={"generation_kwargs": {**GREEDY, **setting}})
    assert ours[0]._tlt_stock_reason and next(iter(setting)) in ours[0]._tlt_stock_reason


def test_speculation_resumes_where_the_settings_allow(tmp_path):
    """A replaced generate goes stock only while it is replaced: later rollouts speculate again."""

    class PatchFirstStep:
        def __init__(self, trainer):
            self.trainer, self.patcher = trainer, None

        def __enter__(self):
            self.patcher = patched_on_instance(self.trainer)
            self.patcher.start()
            trainer = self.trainer

            class Unpatch(Recorder):
                def on_step_end(inner, args, state, control, **kwargs):
                    if state.global_step == 1:
                        self.patcher.stop()

            trainer.add_callback(Unpatch())
            return self

        def __exit__(self, *exc):
            try:
                self.patcher.stop()
            except RuntimeError:
                pass

    ours = run(TLTGRPOTrainer, tmp_path, prepare=PatchFirstStep, config={"max_completion_length": 8}, tlt=ALWAYS)
    step_logs = [log for log in ours[1].logs if "tlt/draft_tokens" in log]
    assert step_logs[0]["tlt/draft_tokens"] == 0 and step_logs[1]["tlt/draft_tokens"] > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])
def test_cast_lm_head_to_fp32_has_the_stock_outcome(tmp_path, kind):
    def bf16_policy():
        return tiny_model(kind, logit_scale=4.0).to(torch.bfloat16)

    stock, ours = compare(tmp_path, model_factory=bf16_policy, config={"cast_lm_head_to_fp32": True}, tlt=ALWAYS)
    head = ours[0].model.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and compute_dtype(ours[0].model) == torch.bfloat16
    assert sum(log.get("tlt/draft_tokens", 0) for log in ours[1].logs) > 0  # speculated, with TRL's fp32 head


def test_hybrid_model_generates_the_stock_way(tmp_path):
    from transformers import AutoModelForCausalLM, NemotronHConfig

    def hybrid_policy():
        torch.manual_seed(0)
        config = NemotronHConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 layers_block_type=["mamba", "attention"], num_attention_heads=4,
                                 num_key_value_heads=2, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                                 n_groups=1, use_mamba_kernels=False, pad_token_id=PAD, eos_token_id=EOS,
                                 bos_token_id=2)
        return AutoModelForCausalLM.from_config(config).eval()

    stock, ours = compare(tmp_path, model_factory=hybrid_policy)
    assert "TLT's cache" in ours[0]._tlt_stock_reason


# ------------------------------------------------------------------------------------------ tools and environments
TOOL_CALL = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def chat_tokenizer():
    """A character-level tokenizer with Qwen 2.5's chat template (tool calling) and its special tokens."""
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": PAD, **{tok: i + 1 for i, tok in enumerate(SPECIAL)}}
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()  # characters back to text without spaces between them
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        padding_side="left", additional_special_tokens=SPECIAL)
    template = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tokenizer.chat_template = template.read_text()
    return tokenizer


CHAT_VOCAB = 128


def chat_policy():
    return tiny_model("qwen2", vocab_size=CHAT_VOCAB, logit_scale=4.0, eos_token_id=2, pad_token_id=PAD)


def tool_calling_generate(model, tokenizer):
    """A test double for ``generate`` (as TRL's tool tests use): the first turn calls the tool, the next answers."""

    def generate(input_ids, attention_mask=None, generation_config=None, **kwargs):
        rows = []
        for row in input_ids:
            text = tokenizer.decode(row, skip_special_tokens=False)
            reply = "12<|im_end|>" if "<tool_response>" in text else TOOL_CALL
            rows.append(torch.tensor(tokenizer(reply, add_special_tokens=False).input_ids))
        width = max(len(r) for r in rows)
        completions = torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=PAD) for r in rows])
        return torch.cat([input_ids, completions.to(input_ids.device)], dim=1)

    return generate


def conversational_dataset(count: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is 3 times {i}?"}]
                                         for i in range(count)]})


def run_tools(trainer_cls, tmp_path, **kwargs):
    tokenizer = chat_tokenizer()

    def prepare(trainer):
        return patch.object(trainer.model, "generate", tool_calling_generate(trainer.model, tokenizer))

    return run(trainer_cls, tmp_path, model_factory=chat_policy, tokenizer=lambda: tokenizer,
               dataset=conversational_dataset(), prepare=prepare,
               config={"max_completion_length": 64, "max_tool_calling_iterations": 2}, **kwargs)


def test_tools_with_a_generate_test_double_call_as_stock(tmp_path):
    stock = run_tools(GRPOTrainer, tmp_path, tools=[multiply_tool])
    ours = run_tools(TLTGRPOTrainer, tmp_path, tools=[multiply_tool])
    assert_same_outcome(stock, ours)
    frequency = [log["tools/call_frequency"] for log in ours[1].logs if "tools/call_frequency" in log]
    assert frequency and all(f > 0 for f in frequency)


class MultiplyEnvironment:
    """An environment whose tool the model calls, and which owns the reward."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs):
        self.calls = 0

    def multiply_tool(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.calls += 1
        return a * b


def environment_reward(completions, environments, **kwargs):
    return [float(env.calls) for env in environments]


def test_environment_factory_calls_as_stock(tmp_path):
    stock = run_tools(GRPOTrainer, tmp_path, reward_funcs=(environment_reward,),
                      environment_factory=MultiplyEnvironment)
    ours = run_tools(TLTGRPOTrainer, tmp_path, reward_funcs=(environment_reward,),
                     environment_factory=MultiplyEnvironment)
    assert_same_outcome(stock, ours)
    assert all(log["reward"] > 0 for log in ours[1].logs if "reward" in log)


_LIGER_RUN = """
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")  # TRL >= 1.16 deprecates use_liger_kernel itself: the user's setting, not our call
import torch
from test_trl_compat import GRPOTrainer, TLTGRPOTrainer, run
cuda = torch.cuda.is_available()
try:  # one of liger's Triton kernels (the first a patched Llama runs) on the device the runs use
    from liger_kernel.transformers import LigerRMSNorm
    device = "cuda" if cuda else "cpu"
    LigerRMSNorm(8).to(device)(torch.randn(2, 8, device=device))
except Exception as err:
    print(json.dumps({"unusable": f"{type(err).__name__}: {err}"}))
    sys.exit(0)
outcomes = {}
for cls in (GRPOTrainer, TLTGRPOTrainer):
    try:
        _, recorder, seen = run(cls, Path(sys.argv[1]) / cls.__name__,
                                config={"use_liger_kernel": True, "use_cpu": not cuda})
        outcomes[cls.__name__] = {"logs": recorder.logs, "seen": seen}
    except Exception as err:
        outcomes[cls.__name__] = {"error": f"{type(err).__name__}: {err}"}
print(json.dumps(outcomes))
"""


def test_liger_kernel_same_outcome_as_stock(tmp_path):
    """use_liger_kernel: TLT changes nothing about it. Where liger's Triton kernels run (a GPU), stock GRPOTrainer
    must train with them and TLTGRPOTrainer's run must be the same (completions, logged values); where they do not
    (a CPU: Triton's interpreter does not run them), both trainers could only fail alike, which proves nothing, so
    the test is skipped with liger's error. In a subprocess: liger patches transformers' Llama modules for the whole
    process, which would leave its kernels in every later test's models."""
    import json
    import subprocess
    import sys

    pytest.importorskip("liger_kernel")
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", _LIGER_RUN, str(tmp_path)], cwd=tests, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(tests)})
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    if "unusable" in outcomes:
        pytest.skip(f"liger-kernel's Triton kernels do not run here ({outcomes['unusable'][:300]}): stock "
                    "GRPOTrainer cannot train with use_liger_kernel, so there is no outcome to match")
    stock, ours = outcomes["GRPOTrainer"], outcomes["TLTGRPOTrainer"]
    assert "error" not in stock, f"stock GRPOTrainer fails with use_liger_kernel where liger runs: {stock['error']}"
    assert "error" not in ours, f"TLTGRPOTrainer fails with use_liger_kernel where stock trains: {ours['error']}"
    assert stock["seen"] and any(deterministic(log) for log in stock["logs"])  # it trained and logged

    def recorded(outcome):
        recorder = Recorder()
        recorder.logs = outcome["logs"]
        return None, recorder, outcome["seen"]

    assert_same_outcome(recorded(stock), recorded(ours))


def test_deepspeed_zero3_is_refused_with_the_fix():
    """ZeRO-3 partitions the LM head outside generation, where the drafter reads it: refused at construction with
    what to use instead. deepspeed is not installed here, so the accelerator state is a stand-in carrying the one
    field the check reads (its plugin's zero_stage)."""
    from types import SimpleNamespace

    from tlt_trainers.trl.trainer import refuse_zero3

    with pytest.raises(ValueError, match="ZeRO-3 is not supported.*use ZeRO-2, FSDP or DDP"):
        refuse_zero3(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    refuse_zero3(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    refuse_zero3(SimpleNamespace(deepspeed_plugin=None))
