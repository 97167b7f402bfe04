"""Drafters compared offline on the policy's own answers to held-out prompts: the finer instrument for acceptance.

    python benchmarks/bench_drafters_offline.py --drafter 'eagle3 trained=DIR'            # the shipped one beside DIR
    python benchmarks/bench_drafters_offline.py --prompts 128 --prompt-sets families

``bench_drafters.py`` measures acceptance in TLT's engine, which is the number a user sees, but on 8 prompts of 96
tokens it counts a few hundred verify steps, and a chain's steps are a chaotic function of the drafter's argmax: the
last bits of a matmul, which differ between processes, move one step boundary and every step after it. The same
drafter measured in two processes then differs by several hundredths of a token per verify (the reps inside one
process are identical, so the range it prints does not show it), as much as two drafters of one lineage differ.

Here the policy answers ``--prompts`` held-out prompts once per prompt set and temperature (greedy and T=1, plain
decoding, seeded), the policy's features and next-token laws over those answers are computed once, and every drafter
is scored on the same positions (``DrafterTrainer.evaluate``): greedy, the chain length a chain of 4 would reach
from each draft step's top-1 agreement with the policy; at T=1, the same from each step's chance that a sampled draft
is accepted, sum min(p, q). Positions are scored independently (no step boundaries), so the estimate is
deterministic and its standard error is small. Writes benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_drafter_recipe import answer_features, answered, offline  # noqa: E402
from common import print_table, write_results  # noqa: E402

from tlt_trainers import Drafter, DrafterTrainer, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402
from tlt_trainers.shipped.prompts import PROMPT_SETS, evaluation_prompts  # noqa: E402


def policy_answers(model, tok, prompts: list[str], temperature: float, new_tokens: int,
                   batch: int = 16) -> list[tuple[torch.Tensor, int]]:
    """The policy's answers (plain decoding, seeded per batch): ``(prompt + answer ids, prompt length)``."""
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    made = []
    for start in range(0, len(prompts), batch):
        enc = tok(prompts[start : start + batch], return_tensors="pt", padding=True, padding_side="left")
        result = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=new_tokens,
                                 do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 generator=torch.Generator().manual_seed(start))
        made += answered(result.sequences, enc.attention_mask, tok.pad_token_id)
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="a saved drafter to score (repeatable); the shipped EAGLE-3 drafter is always scored")
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts per prompt set")
    p.add_argument("--prompt-sets", default="families,seeds", help=f"comma-separated, of {list(PROMPT_SETS)}")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", default="bench_drafters_offline")
    args = p.parse_args()
    model, tok = load_smollm2()
    sources = {"eagle3 shipped": str(shipped_drafter_for(model, "eagle3"))}
    for item in args.drafter:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            raise SystemExit(f"--drafter {item!r}: give NAME=DIR, a folder written by save_pretrained.")
        sources[name] = path
    drafters = {name: Drafter.from_pretrained(path, target=model).float() for name, path in sources.items()}
    rows, answers = [], {}
    with torch.no_grad():
        for prompt_set in args.prompt_sets.split(","):
            prompts = evaluation_prompts(tok, args.prompts, prompt_set)
            for temperature in (0.0, 1.0):
                start = time.perf_counter()
                made = policy_answers(model, tok, prompts, temperature, args.new_tokens)
                sequences = answer_features(model, made)
                scored = sum(int((s.target_probs.sum(-1) > 0).sum()) for s in sequences)
                answers[f"{prompt_set}|t{temperature:g}"] = {"answers": len(made), "scored_positions": scored,
                                                             "seconds": time.perf_counter() - start}
                print(f"{prompt_set} T={temperature:g}: {len(made)} answers, {scored} positions scored", flush=True)
                for name, drafter in drafters.items():
                    result = offline(DrafterTrainer(drafter, model, unroll_steps=4), sequences)  # 4 draft steps
                    key = "estimated_greedy" if temperature == 0 else "estimated_sampled"
                    by_step = result["top1_by_step"] if temperature == 0 else result["sampled_acceptance_by_step"]
                    rows.append({"drafter": name, "prompt_set": prompt_set, "temperature": temperature,
                                 "estimated_acceptance_length": result[key], "first_draft": by_step[0],
                                 "by_step": by_step})
                    print(f"  {name}: {result[key]:.3f} (first draft {by_step[0]:.3f})", flush=True)
    table = print_table(["drafter", "prompt set", "T", "offline acceptance (chain of 4)", "first draft"],
                        [[r["drafter"], r["prompt_set"], r["temperature"], f'{r["estimated_acceptance_length"]:.3f}',
                          f'{r["first_draft"]:.3f}'] for r in rows])
    path = write_results(args.out, {"args": vars(args), "drafters": sources, "answers": answers, "rows": rows,
                                    "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
