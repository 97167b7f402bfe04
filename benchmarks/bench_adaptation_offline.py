"""The online drafter update, replayed offline: how acceptance on a new task moves per update, for each way to update.

    python benchmarks/bench_adaptation_offline.py                                 # every variant, knights_knaves
    python benchmarks/bench_adaptation_offline.py --variants 'as shipped,answers only' --steps 4

``bench_adaptation.py`` runs the real loop (``TLTGRPOTrainer``), but its per-step acceptance counts a few hundred
verify passes of one process and moves by several hundredths with the last bits of a matmul, and each run costs
ten minutes, so it cannot tell one way of updating from another. This replays the loop's drafter side on fixed data:
the policy answers the task's prompts at temperature 1 once (``--steps`` x ``--prompts-per-step`` prompts x
``--num-generations`` answers, as GRPO would sample them; the policy's own drift over a few steps at GRPO's learning
rate is left out), and, from the same starting drafter, each variant runs the update cycle: before step s, the
drafter is scored on held-out prompts of the same task (other seeds; the acceptance step s would see), then step
s's answers enter its buffer (prompt and answer, as the engine's feature sink hands them) and it trains
``micro-steps`` micro-steps, as ``train_slice`` does after a rollout. Scores are offline (``DrafterTrainer.evaluate``
on the answers' positions only): at T=1 the chain length a chain of 4 reaches from each draft step's chance that a
sampled draft is accepted, sum min(p, q); greedy, the same from top-1 agreement. The "training top-1" column is what
the loop reports as ``tlt/drafter_top1``: agreement on the batches it trained on.

A variant changes one thing against the update as shipped (TLT's defaults: lr 3e-4, unroll 2, micro-batch 8, the
payback budget's 2-3 micro-steps a step on one process): more micro-steps (a multi-rank run's idle time), the rate,
the TV term (``DrafterTrainer.tv_weight``), the targets (``policy's law``: the policy's top-k next-token law, which
``add_features`` computes when handed the final hidden states, where the engine's feature sink hands only tokens
and features, so that the loop trains on the one token the policy sampled), and the loss on answer positions only
(``answers only``: the prompt's positions are context, not targets; a drafter never drafts inside a prompt). The
answers are sampled once and cached under ``TLT_CACHE_DIR``. Writes benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_adaptation import task_dataset  # noqa: E402
from bench_drafter_recipe import answer_features  # noqa: E402
from bench_drafters_offline import policy_answers  # noqa: E402
from common import cache_root, print_table, write_results  # noqa: E402

from tlt_trainers import Drafter, DrafterTrainer, Eagle3Drafter  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.settings import TLTSettings  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402

DEFAULTS = TLTSettings()


@dataclasses.dataclass(frozen=True)
class Update:
    """One way to update the drafter after a rollout; the defaults are TLT's on one process."""

    micro_steps: int = 2  # what the payback budget gives one process on this CPU (bench_adaptation: 2-3 a step)
    lr: float = DEFAULTS.drafter_lr
    unroll_steps: int = DEFAULTS.drafter_unroll_steps
    tv_weight: float = 0.0
    answers_only: bool = False  # (with targets="law") loss on the answer's positions only; the prompt stays as context
    # "sampled": the token that followed, the only target the engine's feature sink gives (tokens and features);
    # "law": the policy's top-k next-token law, what add_features computes when handed the final hidden states
    targets: str = "sampled"


VARIANTS: dict[str, Update] = {
    "as shipped": Update(),
    "10 micro-steps": Update(micro_steps=10),
    "policy's law": Update(targets="law"),
    "policy's law + 10 micro-steps": Update(targets="law", micro_steps=10),
    "policy's law + 30 micro-steps": Update(targets="law", micro_steps=30),
    "policy's law + answers only": Update(targets="law", answers_only=True),
    "policy's law + tv 1 + 10 micro-steps": Update(targets="law", tv_weight=1.0, micro_steps=10),
    "policy's law + lr 1e-3 + 10 micro-steps": Update(targets="law", lr=1e-3, micro_steps=10),
}


def starting_drafter(model, start: str) -> Drafter:
    if start == "shipped":
        return Drafter.from_pretrained(shipped_drafter_for(model, "eagle3"), target=model).float()
    torch.manual_seed(0)
    return Eagle3Drafter.from_target(model, draft_vocab_size=4096)


def score(trainer: DrafterTrainer, held_out) -> dict:
    result = trainer.evaluate(held_out)
    return {"sampled": result["estimated_sampled_acceptance_length"],
            "first_sampled": result["sampled_acceptance_by_step"][0],
            "greedy": result["estimated_acceptance_length"], "first_greedy": result["top1_by_step"][0]}


def replay(name: str, update: Update, model, start: str, steps: list[list[tuple[torch.Tensor, int]]], held_out,
           seed: int) -> dict:
    """The update cycle of ``update`` over ``steps`` (each step's answers: ``(prompt + answer ids, prompt length)``),
    scored on ``held_out`` before every update and after the last."""
    drafter = starting_drafter(model, start)
    trainer = DrafterTrainer(drafter, model, lr=update.lr, unroll_steps=update.unroll_steps,
                             micro_batch_size=DEFAULTS.drafter_micro_batch_size,
                             buffer_bytes=DEFAULTS.drafter_buffer_bytes, tv_weight=update.tv_weight, seed=seed)
    # scoring unrolls a chain of 4 whatever the update trains
    scorer = DrafterTrainer(drafter, model, unroll_steps=4)
    records = []
    for index, answers in enumerate(steps):
        before = score(scorer, held_out)
        for ids, prompt_len in answers:
            trainer.add_sequences(ids[None])
            added = trainer.buffer.sequences[-1]
            if update.targets == "sampled":
                added.target_ids = added.target_probs = None
            elif update.answers_only:
                added.target_probs[: prompt_len - 1] = 0
        if index == 0 and start == "fresh":
            trainer.rebuild_draft_vocab()
        with torch.enable_grad():
            trained = trainer.train(max_steps=update.micro_steps)
        records.append({"step": index + 1, **before, "train_top1": trained["top1"],
                        "train_seconds": trained["seconds"]})
        print(f"[{name}] step {index + 1}: T=1 {before['sampled']:.3f}, greedy {before['greedy']:.3f}; "
              f"trained {trained['steps']} steps in {trained['seconds']:.1f}s, training top-1 {trained['top1']:.3f}",
              flush=True)
    records.append({"step": len(steps) + 1, **score(scorer, held_out)})
    print(f"[{name}] after the last update: T=1 {records[-1]['sampled']:.3f}", flush=True)
    return {"update": dataclasses.asdict(update), "steps": records}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="knights_knaves", help="a reasoning-gym task held out of the shipped data")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--start", default="shipped", choices=["shipped", "fresh"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--held-out-prompts", type=int, default=16, help="other seeds of the task, 2 answers each")
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_adaptation_offline")
    args = p.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}: use {list(VARIANTS)}")
    model, tok = load_smollm2()
    start = time.perf_counter()
    train_prompts = list(task_dataset(tok, args.task, args.steps * args.prompts_per_step, args.seed)["prompt"])
    held_prompts = list(task_dataset(tok, args.task, args.held_out_prompts, args.seed + 1000)["prompt"])
    key = f"{args.task}-{args.steps}x{args.prompts_per_step}x{args.num_generations}-{args.held_out_prompts}-" \
          f"{args.max_completion_length}-{args.seed}"
    cached = cache_root() / "adaptation-answers" / f"{key}.pt"  # the same seeded answers: sampled once
    if cached.is_file():
        made, held = torch.load(cached)
    else:
        with torch.no_grad():
            made = policy_answers(model, tok, [q for q in train_prompts for _ in range(args.num_generations)], 1.0,
                                  args.max_completion_length)
            held = policy_answers(model, tok, [q for q in held_prompts for _ in range(2)], 1.0,
                                  args.max_completion_length)
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save((made, held), cached)
    per_step = args.prompts_per_step * args.num_generations
    steps = [made[i : i + per_step] for i in range(0, len(made), per_step)]
    held_out = answer_features(model, held)
    prompt_tokens = sum(n for _, n in made) / len(made)
    answer_tokens = sum(len(ids) - n for ids, n in made) / len(made)
    print(f"{len(made)} answers ({prompt_tokens:.0f} prompt + {answer_tokens:.0f} answer tokens on average), "
          f"{len(held)} held out, in {time.perf_counter() - start:.0f}s", flush=True)
    runs = {name: replay(name, VARIANTS[name], model, args.start, steps, held_out, args.seed) for name in names}
    headers = ["variant", "T=1 step 1", "T=1 step 2", f"T=1 step {args.steps}", f"T=1 after {args.steps}",
               "greedy step 1", f"greedy after {args.steps}", "first draft T=1 after", "training top-1 last",
               "train s/update"]
    rows = []
    for name, run in runs.items():
        s = run["steps"]
        trained = [r for r in s if "train_seconds" in r]
        rows.append([name, round(s[0]["sampled"], 3), round(s[1]["sampled"], 3), round(s[-2]["sampled"], 3),
                     round(s[-1]["sampled"], 3), round(s[0]["greedy"], 3), round(s[-1]["greedy"], 3),
                     round(s[-1]["first_sampled"], 3), round(trained[-1]["train_top1"], 3),
                     round(sum(r["train_seconds"] for r in trained) / len(trained), 1)])
    table = print_table(headers, rows)
    path = write_results(args.out, {"args": vars(args), "data": {
        "train_answers": len(made), "held_out_answers": len(held), "mean_prompt_tokens": prompt_tokens,
        "mean_answer_tokens": answer_tokens}, "runs": runs, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
