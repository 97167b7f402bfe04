"""Completion lengths of the GRPO reproduction's rollouts: ``model.generate`` vs TLT's adaptive engine.

    python benchmarks/compare_lengths.py            # 32 prompts x 4 samples x 2 seeds per side, up to 192 tokens

Both sample the same law (the engine's exactness tests say so on small models); this checks it where the GRPO
reproduction runs: SmolLM2-135M-Instruct at step 0, the prompts of ``examples/reproduce.py``, temperature 1.0, the
shipped drafter. Prints the length distribution of each side and two-sample tests (Mann-Whitney, Kolmogorov-Smirnov);
writes benchmarks/results/compare_lengths.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402
from reproduce import arithmetic_dataset  # noqa: E402

from tlt_trainers import Drafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt and seed")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=192)
    args = p.parse_args()
    from scipy.stats import ks_2samp, mannwhitneyu

    model, tok = load_smollm2()
    data = arithmetic_dataset(2 * args.prompts, 0)
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
               for r in data][: args.prompts]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    ids = enc.input_ids.repeat_interleave(args.samples, 0)
    mask = enc.attention_mask.repeat_interleave(args.samples, 0)
    engine = SpeculativeGenerator(model, Drafter.from_pretrained(shipped_drafter_for(model), target=model),
                                  TLTConfig(cost_cache="off"))
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    def lengths(sequences: torch.Tensor) -> list[int]:
        done = sequences[:, ids.shape[1]:] == tok.eos_token_id
        cap = torch.full((done.shape[0],), done.shape[1])
        return torch.where(done.any(1), done.float().argmax(1) + 1, cap).tolist()

    found: dict[str, list[int]] = {"generate": [], "tlt": []}
    seconds = {"generate": 0.0, "tlt": 0.0}
    acceptance = []
    with torch.no_grad():
        for seed in range(args.seeds):
            torch.manual_seed(100 + seed)
            start = time.perf_counter()
            found["generate"] += lengths(model.generate(ids, attention_mask=mask, **sampling))
            seconds["generate"] += time.perf_counter() - start
            start = time.perf_counter()
            result = engine.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(200 + seed),
                                     **sampling)
            seconds["tlt"] += time.perf_counter() - start
            found["tlt"] += lengths(result.sequences)
            acceptance.append(result.stats.acceptance_length)
    rows = [[name, len(v), statistics.mean(v), statistics.median(v), sum(x == args.max_new_tokens for x in v),
             seconds[name]] for name, v in found.items()]
    table = print_table(["side", "n", "mean length", "median", "at the cap", "seconds"], rows)
    tests = {"mann_whitney_p": float(mannwhitneyu(found["generate"], found["tlt"]).pvalue),
             "ks_p": float(ks_2samp(found["generate"], found["tlt"]).pvalue)}
    print(tests)
    path = write_results("compare_lengths", {"args": vars(args), "lengths": found, "seconds": seconds,
                                             "acceptance_length": acceptance, "tests": tests, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
