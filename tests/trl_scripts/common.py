"""Tiny GRPO runs shared by tests/test_trl_trainer.py and the torchrun scripts (offline, CPU, seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models

from datasets import Dataset  # noqa: E402
from tiny_models import char_tokenizer, tiny_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

PROMPTS = ["2+2=", "abc", "hello", "3*4=?", "what is", "x y z", "count: 1 2", "q: 7-5", "sum 1+1", "go",
           "a b c d", "12*3=", "name:", "why?", "ok.", "9-4="]


def prompt_dataset(count: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(count)]})


def length_reward(completions, **kwargs):
    """Longer answers score higher (anything that varies works for GRPO)."""
    return [float(len(c)) / 8.0 for c in completions]


def grpo_kwargs(output_dir, **overrides) -> dict:
    """GRPOConfig arguments of a tiny CPU run."""
    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to="none", bf16=False, use_cpu=True, save_strategy="no", seed=0,
        learning_rate=1e-2, disable_tqdm=True, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return kwargs


def policy():
    """A tiny Llama with sharp next-token distributions (greedy ties are then vanishingly rare)."""
    return tiny_model("llama", logit_scale=4.0)


class Recorder(TrainerCallback):
    """Keeps every log dict and every on_drafter_update call."""

    def __init__(self):
        self.logs: list[dict] = []
        self.updates: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    def on_drafter_update(self, args, state, control, drafter=None, trigger=None, rank=None, metrics=None, **kwargs):
        self.updates.append({"trigger": trigger, "rank": rank, "global_step": state.global_step, **(metrics or {})})

    def keys(self) -> set[str]:
        return set().union(*(log.keys() for log in self.logs))


__all__ = ["Recorder", "char_tokenizer", "grpo_kwargs", "length_reward", "policy", "prompt_dataset"]
