"""Drift on SmolLM2-135M-Instruct: the policy keeps moving; a frozen drafter falls behind, online updates keep up.

    python benchmarks/bench_drift.py [--drafter DIR] [--rounds 4] [--update-steps N] [--quick] [--name NAME]

1. Start from the drafter shipped for SmolLM2-135M-Instruct (or ``--drafter DIR``, any saved drafter): two copies,
   one frozen, one updated online.
2. Measure both on reasoning-gym arithmetic prompts (greedy and temperature 1.0): the aligned starting point.
3. Each round moves the policy further (SFT steps teaching it a new answer style on that task, as RL moves it),
   then measures the frozen drafter and the online one before its update (both stale), rolls out fresh prompts of
   the moved policy with TLT's engine (the online drafter's features come from the engine's own passes, no extra
   forward), trains the online drafter for a time budget with the rollout's default drafter settings
   (``DrafterSettings``) and measures it again.
A block drafter (``--drafter`` a saved ``BlockDrafter``) drafts ``block:4`` where EAGLE-3 drafts a chain of 4, so
their acceptance lengths compare. Writes benchmarks/results/bench_drift[_quick].json (or ``--name``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers import Drafter, DrafterTrainer, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.settings import DrafterSettings  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402
from tlt_trainers.shipped.prompts import chat_prompt  # noqa: E402
from tlt_trainers.warmup import measure_acceptance  # noqa: E402

TASK = "basic_arithmetic"
TEMPERATURES = (("greedy", 0.0), ("t1.0", 1.0))


def task_items(count: int, seed: int):
    import reasoning_gym

    return list(reasoning_gym.create_dataset(TASK, size=count, seed=seed))


def styled_answer(item) -> str:
    """The new behaviour the policy is pushed towards (a distinctive, consistent answer style)."""
    expression = item["question"].removeprefix("Calculate ").rstrip(".")
    return (f"Let us work it out carefully, one operation at a time. We evaluate {expression} from left to right. "
            f"The result is {item['answer']}. So the final answer is {item['answer']}.")


def move_policy(model, tok, items, steps: int, lr: float, batch_size: int = 4, offset: int = 0) -> list[float]:
    """SFT steps on (prompt, styled answer) pairs from ``items[offset:]``, loss on the answer only; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = [items[(offset + step * batch_size + i) % len(items)] for i in range(batch_size)]
        prompts = [chat_prompt(tok, item["question"]) for item in batch]
        texts = [p + styled_answer(item) + tok.eos_token for p, item in zip(prompts, batch)]
        enc = tok(texts, return_tensors="pt", padding=True)
        labels = enc.input_ids.clone()
        labels[enc.attention_mask == 0] = -100
        for row, prompt in enumerate(prompts):
            prompt_len = len(tok(prompt).input_ids)
            pad = int((enc.attention_mask[row] == 0).sum())
            labels[row, : pad + prompt_len] = -100
        loss = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def roll_out(model, tok, drafter, trainer, prompts: list[str], seed: int, max_new_tokens: int = 96) -> int:
    """Sample the moved policy's answers with TLT's engine, features to ``trainer``; the answer tokens."""
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=4))
    tokens = 0
    for offset in range(0, len(prompts), 16):
        enc = tok(prompts[offset : offset + 16], return_tensors="pt", padding=True)
        res = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=True, temperature=1.0, top_k=0, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(seed + offset),
                              feature_sink=trainer.add_features)
        tokens += res.stats.generated_tokens
    return tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--drafter", default=None, help="a saved drafter (default: the one shipped for SmolLM2)")
    p.add_argument("--rounds", type=int, default=None, help="policy moves, each followed by an update (default 4, "
                   "quick 2)")
    p.add_argument("--sft-steps", type=int, default=12, help="SFT steps per round")
    p.add_argument("--lr", type=float, default=1e-4, help="the policy's SFT learning rate")
    p.add_argument("--update-seconds", type=float, default=None, help="drafter update per round, default 120 "
                   "(quick 45)")
    p.add_argument("--update-steps", type=int, default=None, help="drafter update per round in micro-steps instead of "
                   "seconds (the same training whatever else loads the CPU)")
    p.add_argument("--rollout-prompts", type=int, default=None, help="fresh rollouts per round, default 32 "
                   "(quick 16)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--name", default=None, help="result file name (default bench_drift[_quick])")
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    update_seconds = args.update_seconds if args.update_seconds is not None else (45 if args.quick else 120)
    n_rollouts = args.rollout_prompts or (16 if args.quick else 32)

    model, tok = load_smollm2()
    source = Path(args.drafter) if args.drafter else shipped_drafter_for(model)
    if source is None:
        raise SystemExit("no drafter is shipped for this policy: pass --drafter DIR (e.g. from `tlt warmup-drafter`)")
    frozen = Drafter.from_pretrained(source, target=model).eval()
    online = Drafter.from_pretrained(source, target=model).eval()
    print(f"drafter {type(online).__name__} from {source}")
    settings = DrafterSettings()
    trainer = DrafterTrainer(online, model, lr=settings.drafter_lr, unroll_steps=settings.drafter_unroll_steps,
                             micro_batch_size=settings.drafter_micro_batch_size,
                             precision=settings.drafter_precision, show_progress=False)

    eval_prompts = [chat_prompt(tok, item["question"]) for item in task_items(args.eval_prompts, seed=7)]
    sft_items = task_items(rounds * args.sft_steps * 4, seed=3)

    def measure(drafter) -> dict:
        return {name: round(measure_acceptance(model, tok, drafter, eval_prompts, max_new_tokens=48,
                                               temperature=t)["acceptance_length"], 3) for name, t in TEMPERATURES}

    start = measure(frozen)
    history = [{"round": 0, "sft_steps": 0, "frozen": start, "online_before": start, "online_after": start}]
    print(f"round 0 (aligned): {start}")
    for r in range(1, rounds + 1):
        losses = move_policy(model, tok, sft_items, args.sft_steps, args.lr, offset=(r - 1) * args.sft_steps * 4)
        stale, before = measure(frozen), measure(online)
        rollout_start = time.perf_counter()
        prompts = [chat_prompt(tok, item["question"]) for item in task_items(n_rollouts, seed=100 + r)]
        tokens = roll_out(model, tok, online, trainer, prompts, seed=1000 * r)
        rollout_seconds = time.perf_counter() - rollout_start
        metrics = (trainer.train(max_steps=args.update_steps) if args.update_steps
                   else trainer.train(max_seconds=update_seconds))
        after = measure(online)
        history.append({"round": r, "sft_steps": r * args.sft_steps, "sft_loss": [losses[0], losses[-1]],
                        "frozen": stale, "online_before": before, "online_after": after,
                        "rollout_tokens": tokens, "rollout_seconds": rollout_seconds,
                        "update": {k: metrics[k] for k in ("steps", "tokens", "seconds", "loss") if k in metrics}})
        print(f"round {r}: SFT loss {losses[0]:.2f} -> {losses[-1]:.2f}; frozen {stale}, online before update "
              f"{before}, after {after} ({metrics['steps']} steps, {tokens} rollout tokens)")

    rows = [[h["round"], h["sft_steps"], *(h[kind][name] for kind in ("frozen", "online_before", "online_after")
                                           for name, _ in TEMPERATURES)] for h in history]
    budget = f"{args.update_steps} steps" if args.update_steps else f"{update_seconds:.0f}s"
    print(f"\nSmolLM2-135M-Instruct, {TASK}; acceptance length (chain of 4, {args.eval_prompts} held-out prompts); "
          f"policy moved by {args.sft_steps} SFT steps a round; online drafter updated {budget} a round "
          f"on {n_rollouts} fresh rollouts")
    table = print_table(["round", "policy SFT steps", "frozen greedy", "frozen T=1", "online before update greedy",
                         "online before update T=1", "online after update greedy", "online after update T=1"], rows)
    path = write_results(args.name or ("bench_drift_quick" if args.quick else "bench_drift"), {
        "settings": {**vars(args), "rounds": rounds, "update_seconds": update_seconds, "rollout_prompts": n_rollouts,
                     "drafter": str(source), "drafter_settings": dataclasses.asdict(settings)},
        "rounds": history, "table": table})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
