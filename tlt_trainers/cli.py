"""The ``tlt`` command: ``tlt warmup-drafter --model PATH_OR_ID --out DIR`` and ``tlt vllm-serve-args --model
PATH_OR_ID --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .settings import DrafterSettings, add_setting_arguments

# The settings of DrafterSettings a standalone warm-up uses (the others are about training during RL).
WARMUP_SETTINGS = ("drafter_architecture", "draft_vocab_size", "drafter_unroll_steps", "drafter_warmup_lr",
                   "drafter_warmup_seconds")


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
    # The drafter's settings, named, typed and documented as in TLTGRPOConfig and veRL's tlt: section. A standalone
    # warm-up trains longer by default than the trainer's (whose warm-up delays the first RL step).
    add_setting_arguments(p, DrafterSettings, WARMUP_SETTINGS, defaults={"drafter_warmup_seconds": 300.0},
                          aliases={"drafter_warmup_seconds": ["--train-seconds"], "drafter_unroll_steps":
                                   ["--unroll-steps"], "drafter_warmup_lr": ["--lr"]})
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="cosine: from --lr down to a tenth of it over --train-seconds (the shipped drafters' recipe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the warm-up report as JSON here")


def _prompts(args, tokenizer, count: int, seed: int) -> list[str]:
    from .warmup import dataset_prompts, reasoning_gym_prompts

    if args.dataset.startswith("reasoning-gym:"):
        return reasoning_gym_prompts(tokenizer, count, task=args.dataset.split(":", 1)[1], seed=seed)
    return dataset_prompts(tokenizer, args.dataset, count, column=args.prompt_column, split=args.split, seed=seed)


def warmup_command(args) -> int:
    from .kinds.setup import draft_vocab_size
    from .pretrained import load_model
    from .warmup import warmup_drafter

    DrafterSettings(**{name: getattr(args, name) for name in WARMUP_SETTINGS})  # the same checks as the trainers'
    model, tokenizer = load_model(args.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = _prompts(args, tokenizer, args.num_prompts, args.seed)
    eval_prompts = _prompts(args, tokenizer, args.eval_prompts, args.seed + 10_000) if args.eval_prompts else None
    drafter, report = warmup_drafter(
        model, tokenizer, prompts, architecture=args.drafter_architecture,
        draft_vocab_size=draft_vocab_size(args.draft_vocab_size, vocab),
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, train_seconds=args.drafter_warmup_seconds,
        unroll_steps=args.drafter_unroll_steps, lr=args.drafter_warmup_lr, lr_schedule=args.lr_schedule,
        eval_prompts=eval_prompts, seed=args.seed)
    out = Path(args.out)
    drafter.config.target_name_or_path = args.model
    drafter.save_pretrained(out)
    (out / "warmup_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    print(f"saved drafter to {out}")
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("vllm-serve-args", help="export a drafter for `trl vllm-serve` and print the command",
                       description="Export an EAGLE drafter for the policy where vLLM loads it and print the "
                       "`trl vllm-serve` command that serves the policy with it and with TLT's drafter-reload "
                       "extension, so TLTGRPOTrainer(use_vllm=True, vllm_mode='server') can refresh it.")
    p.add_argument("--model", default="smollm2-135m",
                   help="policy: a Hub id or local path, or 'smollm2-135m' (embedded, offline; the default)")
    p.add_argument("--out", required=True, help="directory for the drafter's vLLM export")
    p.add_argument("--drafter", default=None, help="a saved drafter to serve (default: a fresh one; the trainer "
                   "pushes its own drafter when it starts)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-speculative-batch-size", type=int, default=None,
                   help="draft only while at most this many requests run (vLLM's batch-size schedule)")
    p.add_argument("--speculation", default="adaptive", choices=("adaptive", "always"),
                   help="adaptive (default): TLT's scheduler chooses each step's draft length per batch size from the "
                   "server's measured costs and acceptance; always: draft at every step (up to the cut-off)")


def serve_args_command(args) -> int:
    import torch

    from .drafter.eagle import EagleDrafter
    from .drafter.export import export_vllm
    from .pretrained import SMOLLM2_ALIASES, load_model, smollm2_hf_dir
    from .vllm.config import speculation_schedule
    from .vllm.server import serve_command

    model, _ = load_model(args.model)
    if args.drafter:
        drafter = EagleDrafter.from_pretrained(args.drafter, target=model)
    else:
        torch.manual_seed(0)
        drafter = EagleDrafter.from_target(model)
    out = export_vllm(drafter, args.out, model, num_speculative_tokens=args.num_speculative_tokens,
                      full_vocab_head=drafter.config.uses_draft_vocab)
    extra, engine = speculation_schedule(args.speculation, args.num_speculative_tokens,
                                         args.max_speculative_batch_size)
    policy = smollm2_hf_dir() if str(args.model).lower() in SMOLLM2_ALIASES else args.model
    print(f"exported the drafter to {out}; serve the policy with it:\n")
    print(serve_command(policy, Path(out).resolve(), args.num_speculative_tokens, engine, **extra))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="tlt-trainers command line")
    sub = parser.add_subparsers(dest="command", required=True)
    _warmup_parser(sub)
    _serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "warmup-drafter":
        return warmup_command(args)
    if args.command == "vllm-serve-args":
        return serve_args_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
