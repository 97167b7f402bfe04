"""The ``tlt`` command: ``tlt warmup-drafter --model PATH_OR_ID --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _warmup_parser(sub) -> None:
    p = sub.add_parser("warmup-drafter", help="train a fresh drafter on the policy's own answers",
                       description="Sample answers from the policy, train an EAGLE drafter on them, and report "
                       "acceptance length before and after. Works offline on the embedded SmolLM2-135M-Instruct.")
    p.add_argument("--model", default="smollm2-135m",
                   help="policy: a Hub id or local path, or 'smollm2-135m' (embedded, offline; the default)")
    p.add_argument("--out", required=True, help="directory to save the drafter (config.json + model.safetensors)")
    p.add_argument("--dataset", default="reasoning-gym:gsm_symbolic",
                   help="'reasoning-gym:TASK' or a `datasets` name/path with a prompt column")
    p.add_argument("--prompt-column", default="prompt", help="column holding the prompts (datasets only)")
    p.add_argument("--split", default="train")
    p.add_argument("--num-prompts", type=int, default=96, help="prompts answered for training")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for measuring acceptance")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-seconds", type=float, default=300.0)
    p.add_argument("--draft-vocab-size", type=int, default=4096, help="0 drafts over the full vocabulary")
    p.add_argument("--unroll-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the warm-up report as JSON here")


def _prompts(args, tokenizer, count: int, seed: int) -> list[str]:
    from .drafter.warmup import dataset_prompts, reasoning_gym_prompts

    if args.dataset.startswith("reasoning-gym:"):
        return reasoning_gym_prompts(tokenizer, count, task=args.dataset.split(":", 1)[1], seed=seed)
    return dataset_prompts(tokenizer, args.dataset, count, column=args.prompt_column, split=args.split, seed=seed)


def warmup_command(args) -> int:
    from .drafter.warmup import warmup_drafter
    from .pretrained import load_model

    model, tokenizer = load_model(args.model)
    prompts = _prompts(args, tokenizer, args.num_prompts, args.seed)
    eval_prompts = _prompts(args, tokenizer, args.eval_prompts, args.seed + 10_000) if args.eval_prompts else None
    drafter, report = warmup_drafter(
        model, tokenizer, prompts, draft_vocab_size=args.draft_vocab_size or None,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, train_seconds=args.train_seconds,
        unroll_steps=args.unroll_steps, lr=args.lr, eval_prompts=eval_prompts, seed=args.seed)
    out = Path(args.out)
    drafter.config.target_name_or_path = args.model
    drafter.save_pretrained(out)
    (out / "warmup_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    print(f"saved drafter to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tlt", description="tlt-trainers command line")
    sub = parser.add_subparsers(dest="command", required=True)
    _warmup_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "warmup-drafter":
        return warmup_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
