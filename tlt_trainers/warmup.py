"""Warm-up: make a fresh drafter useful before RL starts, from the policy's own answers.

Sample answers with the plain engine (sampled and greedy, as rollouts will be), feed them to the trainer's buffer
(an EAGLE-3 drafter's through one policy forward, which gives the policy's next-token law to learn; other kinds take
the engine's hidden states as they come, no second forward), build the draft vocabulary from the tokens seen, train,
and measure real acceptance before and after on held-out prompts.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .config import TLTConfig
from .drafter.base import Drafter
from .drafter.trainer import DrafterTrainer, learns_policy_law
from .kinds.setup import drafter_class
from .rollout.generator import SpeculativeGenerator
from .rollout.memory import give_back
from .shipped.prompts import chat_prompt


@dataclass
class WarmupReport:
    answer_tokens: int = 0
    sampling_seconds: float = 0.0
    training: dict = field(default_factory=dict)
    acceptance_before: dict = field(default_factory=dict)
    acceptance_after: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def reasoning_gym_prompts(tokenizer, count: int, task: str = "gsm_symbolic", seed: int = 0,
                          suffix: str = " Think step by step.") -> list[str]:
    """Chat-formatted questions from a reasoning-gym task (generated locally, offline)."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError("reasoning-gym prompts need `pip install reasoning-gym` (or tlt-trainers[repro]).") from err
    data = reasoning_gym.create_dataset(task, size=count, seed=seed)
    return [chat_prompt(tokenizer, item["question"] + suffix) for item in data]


def dataset_prompts(tokenizer, name_or_path: str, count: int, column: str = "prompt", split: str = "train",
                    seed: int = 0) -> list[str]:
    """Prompts from any `datasets` dataset with a text (or chat-messages) column."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("Prompts from a dataset need `pip install datasets`.") from err
    data = datasets.load_dataset(name_or_path, split=split)
    if column not in data.column_names:
        raise ValueError(f"Dataset {name_or_path!r} has no column {column!r}; columns: {data.column_names}. "
                         "Pass --prompt-column.")
    data = data.shuffle(seed=seed).select(range(min(count, len(data))))
    prompts = []
    for value in data[column]:
        if isinstance(value, list):  # conversational: a list of {"role", "content"} messages
            prompts.append(tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True))
        else:
            prompts.append(chat_prompt(tokenizer, str(value)))
    return prompts


def _special_tokens(tokenizer, model) -> tuple[int | list[int] | None, int]:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if isinstance(eos, int) else eos[0])
    return eos, pad


@torch.no_grad()
def measure_acceptance(model, tokenizer, drafter: Drafter, prompts: list[str], max_new_tokens: int = 64,
                       num_speculative_tokens: int = 4, temperature: float = 0.0, batch_size: int = 4,
                       seed: int = 0) -> dict:
    """Real acceptance length of ``drafter`` on ``prompts`` (speculation always on; a block drafter drafts at most
    its block)."""
    if drafter.drafts_blocks:
        num_speculative_tokens = min(num_speculative_tokens, drafter.max_drafts)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always",
                                                            num_speculative_tokens=num_speculative_tokens))
    eos, pad = _special_tokens(tokenizer, model)
    emitted = forwards = 0
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        res = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0, eos_token_id=eos,
                              pad_token_id=pad, generator=torch.Generator().manual_seed(seed + start))
        emitted += res.stats.generated_tokens_in_steps
        forwards += res.stats.row_forwards
    give_back(engine)  # its cache and graphs now, not whenever the garbage collector finds them
    return {"acceptance_length": emitted / max(forwards, 1), "temperature": temperature,
            "num_speculative_tokens": num_speculative_tokens, "prompts": len(prompts)}


def warmup_drafter(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    drafter: Drafter | None = None,
    architecture: str = "auto",
    draft_vocab_size: int | None = 4096,
    max_new_tokens: int = 192,
    temperatures: tuple[float, ...] = (1.0, 0.0),
    batch_size: int = 32,
    train_seconds: float = 300.0,
    unroll_steps: int = 2,
    lr: float = 1e-3,
    lr_schedule: str = "cosine",
    eval_prompts: list[str] | None = None,
    eval_new_tokens: int = 48,
    seed: int = 0,
    show_progress: bool = True,
    log=print,
) -> tuple[Drafter, WarmupReport]:
    """Sample answers to ``prompts`` from the policy, train a drafter on them, report acceptance before/after.

    Without ``drafter``, a fresh one of ``architecture`` ('auto', 'eagle3', 'eagle', 'block': see ``drafter_class``).

    The prompts are split evenly across ``temperatures`` (0.0 = greedy). Training runs ``train_seconds`` at
    ``lr`` decayed by ``lr_schedule`` ('cosine': down to a tenth, the shipped drafters' recipe; 'constant').
    Acceptance is measured greedily and at temperature 1.0 on ``eval_prompts`` (none: skipped).
    """
    if not prompts:
        raise ValueError("warmup_drafter needs at least one prompt.")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule={lr_schedule!r}: choose 'cosine' (the shipped drafters' recipe) or 'constant'.")
    vocab = model.get_output_embeddings().weight.shape[0]
    if drafter is None:
        torch.manual_seed(seed)
        size = draft_vocab_size if draft_vocab_size and draft_vocab_size < vocab else None
        drafter = drafter_class(model, architecture).from_target(model, draft_vocab_size=size)
    trainer = DrafterTrainer(drafter, model, lr=lr, unroll_steps=unroll_steps, show_progress=show_progress,
                             seed=seed)
    report = WarmupReport()

    def measure() -> dict:
        if not eval_prompts:
            return {}
        return {f"t{t:g}": measure_acceptance(model, tokenizer, drafter, eval_prompts, eval_new_tokens,
                                              temperature=t, seed=seed) for t in (0.0, 1.0)}

    report.acceptance_before = measure()
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never", show_progress=show_progress))
    eos, pad = _special_tokens(tokenizer, model)
    # An EAGLE-3 drafter learns the policy's next-token law, which one forward over the answers gives (the engine
    # hands features and the sampled tokens only): the engine then captures no features at all. Other kinds take
    # the engine's features as they come
    answers: list[torch.Tensor] = []
    law = learns_policy_law(drafter)
    sink = None if law else trainer.add_features
    start = time.perf_counter()
    shares = [prompts[i :: len(temperatures)] for i in range(len(temperatures))]
    for temperature, share in zip(temperatures, shares):
        for offset in range(0, len(share), batch_size):
            enc = tokenizer(share[offset : offset + batch_size], return_tensors="pt", padding=True)
            res = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new_tokens,
                                  do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0, eos_token_id=eos,
                                  pad_token_id=pad, generator=torch.Generator().manual_seed(seed + offset),
                                  feature_sink=sink, feature_layers=None if law else drafter.feature_layers)
            report.answer_tokens += res.stats.generated_tokens
            if law:
                answers.extend(res.token_rows(enc.attention_mask))
    give_back(engine)  # the sampling engine's cache and graphs: the drafter's training needs the memory
    if answers:
        trainer.add_token_rows(answers)
    report.sampling_seconds = time.perf_counter() - start
    log(f"sampled {report.answer_tokens} answer tokens from {len(prompts)} prompts in {report.sampling_seconds:.0f}s")
    trainer.rebuild_draft_vocab()
    report.training = trainer.train(max_seconds=train_seconds, lr_schedule=lr_schedule)
    log(f"trained {report.training['steps']} steps in {report.training['seconds']:.0f}s: "
        f"loss {report.training['loss']:.3f}, top-1 {report.training['top1']:.2f}, "
        f"estimated acceptance {report.training['estimated_acceptance_length']:.2f}")
    report.acceptance_after = measure()
    if report.acceptance_after:
        log("acceptance length before -> after: " + ", ".join(
            f"{key}: {report.acceptance_before[key]['acceptance_length']:.2f} -> "
            f"{report.acceptance_after[key]['acceptance_length']:.2f}" for key in report.acceptance_after))
    return drafter, report
