"""A drafter's acceptance on prompts it was trained on against held-out ones: how much of a gap is generalisation.

    python benchmarks/bench_seen_vs_held_out.py [--architecture block] [--prompts 8]

The shipped drafter of ``--architecture`` for SmolLM2-135M-Instruct, greedy, drafting its whole block (a block
drafter) or a chain of 4, on the first greedy prompts of the cached training answers
(``scripts/train_shipped_drafter.py sample``) and on held-out prompts (bench_drafters' evaluation mix). Writes
benchmarks/results/bench_seen_vs_held_out.json.
"""

from __future__ import annotations

import argparse

import torch
from common import cache_root, print_table, write_results

from tlt_trainers import Drafter
from tlt_trainers.pretrained import load_smollm2
from tlt_trainers.shipped import shipped_drafter_for
from tlt_trainers.shipped.prompts import EVAL_CHAT_TOPICS, prompt_mix
from tlt_trainers.warmup import measure_acceptance


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--architecture", default="block", choices=["eagle3", "block"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()
    model, tok = load_smollm2()
    folder = shipped_drafter_for(model, args.architecture)
    drafter = Drafter.from_pretrained(folder, target=model)
    k = drafter.max_drafts if drafter.drafts_blocks else 4
    answers = torch.load(cache_root() / "shipped-drafter" / "answers.pt")["sequences"]
    seen = [tok.decode(s["tokens"][: s["prompt_len"]]) for s in answers if s["temperature"] == 0][: args.prompts]
    held_out = prompt_mix(tok, args.prompts, seed=7, topics=EVAL_CHAT_TOPICS)
    results = {name: measure_acceptance(model, tok, drafter, prompts, max_new_tokens=args.new_tokens,
                                        num_speculative_tokens=k, temperature=0.0)
               for name, prompts in (("trained on", seen), ("held out", held_out))}
    table = print_table(["prompts", "tokens per forward (greedy)", "drafts"],
                        [[name, round(r["acceptance_length"], 2), k] for name, r in results.items()])
    path = write_results("bench_seen_vs_held_out", {"args": vars(args), "drafter": str(folder), "results": results,
                                                    "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
