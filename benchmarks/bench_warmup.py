"""Drafter warm-up on SmolLM2-135M-Instruct: acceptance and speedup at batch 1 before and after.

    python benchmarks/bench_warmup.py            # 96 prompts, 300 s of training (about 10 CPU-minutes in all)
    python benchmarks/bench_warmup.py --quick    # 32 prompts, 60 s of training

Before: a fresh drafter (random weights, draft vocabulary = the first ids). After: ``warmup_drafter`` on
the policy's own answers to reasoning-gym questions. At batch 1, greedy and temperature 1.0, we time
our engine with speculation off and on (interleaved, same prompts) and report the tokens/s ratio and the
acceptance length. The warmed drafter is saved for the other benchmarks. Writes
benchmarks/results/bench_warmup[_quick].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import count_generated, print_table, write_results  # noqa: E402

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import cache_root, load_smollm2  # noqa: E402
from tlt_trainers.warmup import reasoning_gym_prompts, warmup_drafter  # noqa: E402


def speed_at_batch_one(model, tok, drafter, prompts, max_new_tokens, k, temperature, seed=0) -> dict:
    """Tokens/s of our engine without and with speculation, prompt by prompt, interleaved."""
    engines = {"no_spec": SpeculativeGenerator(model, None, TLTConfig(speculation="never")),
               "spec": SpeculativeGenerator(model, drafter, TLTConfig(speculation="always",
                                                                      num_speculative_tokens=k))}
    tokens = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    emitted = forwards = 0
    for i, prompt in enumerate(prompts):
        enc = tok([prompt], return_tensors="pt")
        for name, engine in engines.items():
            start = time.perf_counter()
            res = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new_tokens,
                                  do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  generator=torch.Generator().manual_seed(seed + i))
            seconds[name] += time.perf_counter() - start
            tokens[name] += count_generated(res.sequences, enc.input_ids.shape[1], tok)
            if name == "spec":
                emitted += res.stats.generated_tokens_in_steps
                forwards += res.stats.row_forwards
    tps = {name: tokens[name] / seconds[name] for name in engines}
    return {"tokens_per_second": tps, "spec_vs_no_spec": tps["spec"] / tps["no_spec"],
            "acceptance_length": emitted / max(forwards, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--train-seconds", type=float, default=None, help="default 300 (quick: 60)")
    p.add_argument("--prompts", type=int, default=None, help="warm-up prompts, default 96 (quick: 32)")
    p.add_argument("--eval-prompts", type=int, default=None, help="default 6 (quick: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default=None, help="where to save the warmed drafter (default: the cache dir)")
    args = p.parse_args()
    train_seconds = args.train_seconds if args.train_seconds is not None else (60 if args.quick else 300)
    n_prompts = args.prompts or (32 if args.quick else 96)
    n_eval = args.eval_prompts or (3 if args.quick else 6)
    out = Path(args.out) if args.out else cache_root() / "drafters" / ("warm-quick" if args.quick else "warm")

    model, tok = load_smollm2()
    prompts = reasoning_gym_prompts(tok, n_prompts, seed=1000)
    eval_prompts = reasoning_gym_prompts(tok, n_eval, seed=7)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=4096)
    settings = [("greedy", 0.0), ("temperature 1.0", 1.0)]
    before = {name: speed_at_batch_one(model, tok, drafter, eval_prompts, args.max_new_tokens, args.k, t)
              for name, t in settings}
    start = time.perf_counter()
    drafter, report = warmup_drafter(model, tok, prompts, drafter=drafter, max_new_tokens=160,
                                     train_seconds=train_seconds, unroll_steps=2, eval_prompts=None)
    warmup_seconds = time.perf_counter() - start
    drafter.save_pretrained(out)
    after = {name: speed_at_batch_one(model, tok, drafter, eval_prompts, args.max_new_tokens, args.k, t)
             for name, t in settings}

    rows = []
    for name, _ in settings:
        for label, res in (("before", before[name]), ("after", after[name])):
            tps = res["tokens_per_second"]
            rows.append([name, label, res["acceptance_length"], tps["no_spec"], tps["spec"], res["spec_vs_no_spec"]])
    print(f"\nSmolLM2-135M-Instruct fp32, batch 1, {args.max_new_tokens} new tokens, k={args.k}; warm-up "
          f"{warmup_seconds:.0f}s ({report.answer_tokens} answer tokens, {report.training['steps']} steps)")
    table = print_table(["setting", "drafter", "accept len", "no-spec tok/s", "spec tok/s", "spec/no-spec"], rows)
    path = write_results("bench_warmup_quick" if args.quick else "bench_warmup", {
        "settings": {**vars(args), "train_seconds": train_seconds, "prompts": n_prompts, "eval_prompts": n_eval},
        "warmup_seconds": warmup_seconds, "warmup_report": report.to_dict(), "drafter_path": str(out),
        "before": before, "after": after, "table": table})
    print(f"\nwrote {path}; drafter saved to {out}")


if __name__ == "__main__":
    main()
