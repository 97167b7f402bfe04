"""Drift on SmolLM2-135M-Instruct: the policy moves, the stale drafter loses acceptance, online updates win it back.

    python benchmarks/bench_drift.py [--drafter DIR] [--quick]

1. Start from a warmed-up drafter (``bench_warmup.py`` saves one; without it a short warm-up runs here).
2. Measure acceptance on reasoning-gym arithmetic prompts (greedy and temperature 1.0).
3. Move the policy: a few SFT steps teaching it a new answer style on that task (as RL moves it).
4. Measure the stale drafter; then update it on fresh rollouts of the moved policy, whose hidden states
   come from the engine's own passes (no extra forward), for a short time budget; measure again.
Writes benchmarks/results/bench_drift[_quick].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import cache_root, load_smollm2  # noqa: E402
from tlt_trainers.warmup import chat_prompt, measure_acceptance, warmup_drafter  # noqa: E402

TASK = "basic_arithmetic"


def task_items(count: int, seed: int):
    import reasoning_gym

    return list(reasoning_gym.create_dataset(TASK, size=count, seed=seed))


def styled_answer(item) -> str:
    """The new behaviour the policy is pushed towards (a distinctive, consistent answer style)."""
    expression = item["question"].removeprefix("Calculate ").rstrip(".")
    return (f"Let us work it out carefully, one operation at a time. We evaluate {expression} from left to right. "
            f"The result is {item['answer']}. So the final answer is {item['answer']}.")


def move_policy(model, tok, items, steps: int, lr: float, batch_size: int = 4) -> list[float]:
    """SFT steps on (prompt, styled answer) pairs, loss on the answer only; returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = [items[(step * batch_size + i) % len(items)] for i in range(batch_size)]
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--drafter", default=None, help="warmed drafter dir (default: the one bench_warmup saved)")
    p.add_argument("--sft-steps", type=int, default=None, help="default 24 (quick: 12)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--update-seconds", type=float, default=None, help="drafter update budget, default 180 (quick 60)")
    p.add_argument("--rollout-prompts", type=int, default=None, help="fresh rollouts, default 48 (quick: 16)")
    p.add_argument("--eval-prompts", type=int, default=8)
    args = p.parse_args()
    sft_steps = args.sft_steps or (12 if args.quick else 24)
    update_seconds = args.update_seconds if args.update_seconds is not None else (60 if args.quick else 180)
    n_rollouts = args.rollout_prompts or (16 if args.quick else 48)

    model, tok = load_smollm2()
    warm_dir = Path(args.drafter) if args.drafter else cache_root() / "drafters" / "warm"
    if (warm_dir / "config.json").is_file():
        drafter = EagleDrafter.from_pretrained(warm_dir, target=model)
        print(f"drafter from {warm_dir}")
    else:
        from tlt_trainers.warmup import reasoning_gym_prompts

        print(f"no warmed drafter at {warm_dir}: warming one up briefly")
        drafter, _ = warmup_drafter(model, tok, reasoning_gym_prompts(tok, 32, seed=1000), max_new_tokens=128,
                                    train_seconds=60, eval_prompts=None)

    eval_prompts = [chat_prompt(tok, item["question"]) for item in task_items(args.eval_prompts, seed=7)]

    def measure() -> dict:
        return {name: measure_acceptance(model, tok, drafter, eval_prompts, max_new_tokens=48, temperature=t)
                ["acceptance_length"] for name, t in (("greedy", 0.0), ("t1.0", 1.0))}

    aligned = measure()
    print(f"aligned policy: {aligned}")
    start = time.perf_counter()
    losses = move_policy(model, tok, task_items(256, seed=3), sft_steps, args.lr)
    sft_seconds = time.perf_counter() - start
    print(f"policy moved by {sft_steps} SFT steps in {sft_seconds:.0f}s (loss {losses[0]:.2f} -> {losses[-1]:.2f})")
    stale = measure()
    print(f"stale drafter: {stale}")

    trainer = DrafterTrainer(drafter, model, lr=1e-3, unroll_steps=2)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=4))
    start = time.perf_counter()
    prompts = [chat_prompt(tok, item["question"]) for item in task_items(n_rollouts, seed=11)]
    answer_tokens = 0
    for offset in range(0, len(prompts), 16):
        enc = tok(prompts[offset : offset + 16], return_tensors="pt", padding=True)
        res = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=96, do_sample=True,
                              temperature=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                              generator=torch.Generator().manual_seed(offset), feature_sink=trainer.add_features)
        answer_tokens += res.stats.generated_tokens
    rollout_seconds = time.perf_counter() - start
    metrics = trainer.train(max_seconds=update_seconds)
    refreshed = measure()
    print(f"refreshed drafter: {refreshed}")

    rows = [[name, aligned[name], stale[name], refreshed[name]] for name in aligned]
    print(f"\nSmolLM2-135M-Instruct, {TASK}; policy moved by {sft_steps} SFT steps; drafter updated "
          f"{metrics['seconds']:.0f}s ({metrics['steps']} steps) on {answer_tokens} fresh rollout tokens")
    table = print_table(["setting", "accept len aligned", "accept len stale", "accept len refreshed"], rows)
    path = write_results("bench_drift_quick" if args.quick else "bench_drift", {
        "settings": {**vars(args), "sft_steps": sft_steps, "update_seconds": update_seconds,
                     "rollout_prompts": n_rollouts},
        "aligned": aligned, "stale": stale, "refreshed": refreshed, "sft_losses": losses,
        "sft_seconds": sft_seconds, "rollout_seconds": rollout_seconds, "rollout_tokens": answer_tokens,
        "drafter_update": metrics, "table": table})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
