"""Decode throughput on SmolLM2-135M-Instruct: model.generate vs our engine without and with speculation.

    python benchmarks/bench_decode.py            # full: batch 1/4/16/64, 64 new tokens, 4 min drafter warm-up
    python benchmarks/bench_decode.py --quick    # batch 1/4/16, 32 new tokens, 1 min warm-up

Runs are interleaved in one process (generate, ours without speculation, ours with it) on the same
reasoning-gym prompts; ratios are what to read, absolute tokens/s only mean something on this machine.
Also measures the cost curve the adaptive engine needs: one policy forward over q = k+1 new tokens
against q = 1, per batch size, with ~200 cached tokens. Writes benchmarks/results/bench_decode[_quick].json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import count_generated, encode, math_prompts, print_table, warm_drafter, write_results  # noqa: E402

from tlt_trainers import SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.modeling.kv_cache import RowState, WritePlan  # noqa: E402
from tlt_trainers.modeling.target import TargetModel  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small settings that finish in a few minutes")
    p.add_argument("--batch-sizes", default=None, help="comma separated, default 1,4,16,64 (quick: 1,4,16)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (quick: 32)")
    p.add_argument("--k", type=int, default=4, help="draft chain length")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions per setting, default 2 (quick: 1)")
    p.add_argument("--train-seconds", type=float, default=None, help="drafter warm-up budget, default 240 (quick 60)")
    p.add_argument("--warmup-prompts", type=int, default=None, help="prompts answered for warm-up, default 96")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--modes", default="greedy,sample", help="greedy and/or sample (temperature 1.0)")
    p.add_argument("--name", default=None, help="results file name (default bench_decode or bench_decode_quick)")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,4,16" if args.quick else "1,4,16,64")).split(",")]
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 64)
    args.train_seconds = args.train_seconds if args.train_seconds is not None else (60 if args.quick else 240)
    args.warmup_prompts = args.warmup_prompts or (32 if args.quick else 96)
    args.reps = args.reps or (1 if args.quick else 2)
    return args


def time_engines(model, tok, engines, ids, mask, max_new_tokens, do_sample, reps):
    """Interleaved runs; returns per-engine tokens/s (median), stats of the last run, and outputs."""
    sampling = dict(do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0)
    results = {name: {"tps": [], "stats": None, "sequences": None} for name in engines}
    for rep in range(reps):
        for name, engine in engines.items():
            start = time.perf_counter()
            if engine is None:
                torch.manual_seed(rep)
                seqs = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sampling)
                stats = None
            else:
                res = engine.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                      generator=torch.Generator().manual_seed(rep), **sampling)
                seqs, stats = res.sequences, res.stats
            seconds = time.perf_counter() - start
            results[name]["tps"].append(count_generated(seqs, ids.shape[1], tok) / seconds)
            results[name]["stats"], results[name]["sequences"] = stats, seqs
    return results


@torch.no_grad()
def forward_cost_curve(model, batch_sizes, widths, context=200, reps=5):
    """Seconds of one policy forward over ``w`` new tokens per row after ``context`` cached tokens."""
    target = TargetModel(model)
    curve = {}
    for batch in batch_sizes:
        cache = target.new_cache(context + max(widths) + 1)
        state = RowState(torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
        ids = torch.randint(100, 1000, (batch, context))
        slots = torch.arange(context).expand(batch, -1)
        target.forward(ids, slots, target.attention_mask(state, slots, context), _plan(cache, slots, context))
        state.length += context
        row = {}
        for width in widths:
            slots = context + torch.arange(width).expand(batch, -1)
            mask = target.attention_mask(state, slots, context + width)
            tokens = torch.randint(100, 1000, (batch, width))
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                hidden = target.forward(tokens, slots - 0, mask, _plan(cache, slots, context + width))
                target.logits(hidden)
                times.append(time.perf_counter() - start)
            row[width] = statistics.median(times)
        curve[batch] = row
    return curve


def _plan(cache, slots, kv_len):
    cache.plan = WritePlan(slots, kv_len)
    return cache


def main():
    args = parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model, tok = load_smollm2()
    drafter, warm_info = warm_drafter(
        model, tok, prompts=args.warmup_prompts, new_tokens=160, train_seconds=args.train_seconds,
        draft_vocab=args.draft_vocab,
        cache_name=f"bench-smollm2-v{args.draft_vocab}-p{args.warmup_prompts}-s{int(args.train_seconds)}")
    prompts = math_prompts(tok, max(args.batch_sizes), seed=7)
    engines = {
        "generate": None,
        "no_spec": SpeculativeGenerator(model, None, TLTConfig(speculation="never")),
        "spec": SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=args.k)),
    }
    warm_ids, warm_mask = encode(tok, prompts[:1])
    time_engines(model, tok, engines, warm_ids, warm_mask, 4, False, 1)

    rows, records = [], []
    for mode in args.modes.split(","):
        for batch in args.batch_sizes:
            ids, mask = encode(tok, prompts[:batch])
            res = time_engines(model, tok, engines, ids, mask, args.max_new_tokens, mode == "sample", args.reps)
            tps = {name: statistics.median(r["tps"]) for name, r in res.items()}
            spec_stats = res["spec"]["stats"]
            identical = None
            if mode == "greedy":
                identical = all(torch.equal(res[n]["sequences"], res["generate"]["sequences"])
                                for n in ("no_spec", "spec"))
            record = {
                "mode": mode, "batch_size": batch, "tokens_per_second": tps,
                "no_spec_vs_generate": tps["no_spec"] / tps["generate"],
                "spec_vs_no_spec": tps["spec"] / tps["no_spec"],
                "spec_vs_generate": tps["spec"] / tps["generate"],
                "acceptance_length": spec_stats.acceptance_length,
                "draft_acceptance_rate": spec_stats.draft_acceptance_rate,
                "greedy_outputs_identical": identical,
                "spec_seconds": {"draft": spec_stats.draft_seconds, "verify": spec_stats.verify_seconds,
                                 "prefill": spec_stats.prefill_seconds, "total": spec_stats.total_seconds},
                "peak_cache_bytes": {"no_spec": res["no_spec"]["stats"].peak_cache_bytes,
                                     "spec": spec_stats.peak_cache_bytes},
            }
            records.append(record)
            rows.append([mode, batch, tps["generate"], tps["no_spec"], tps["spec"], record["no_spec_vs_generate"],
                         record["spec_vs_no_spec"], record["spec_vs_generate"], record["acceptance_length"],
                         {None: "-", True: "yes", False: "NO"}[identical]])
            print(f"done {mode} batch {batch}: {tps}", flush=True)

    print(f"\nSmolLM2-135M-Instruct fp32, {args.max_new_tokens} new tokens, k={args.k}, "
          f"drafter warmed {args.train_seconds:.0f}s ({warm_info})")
    table = print_table(["mode", "batch", "generate tok/s", "ours no-spec tok/s", "ours spec tok/s",
                         "no-spec/generate", "spec/no-spec", "spec/generate", "accept len", "greedy identical"], rows)

    widths = [1, 2, 3, 5, 9]
    curve = forward_cost_curve(model, args.batch_sizes, widths)
    curve_rows = [[b] + [curve[b][w] * 1000 for w in widths] + [curve[b][w] / curve[b][1] for w in widths[1:]]
                  for b in args.batch_sizes]
    print("\nPolicy forward cost with ~200 cached tokens (ms), and relative to 1 token:")
    curve_table = print_table(["batch"] + [f"{w} tok ms" for w in widths] + [f"{w}/1" for w in widths[1:]],
                              curve_rows)
    path = write_results(args.name or ("bench_decode_quick" if args.quick else "bench_decode"), {
        "settings": vars(args), "drafter_warmup": warm_info, "results": records,
        "forward_cost_seconds": {str(b): {str(w): t for w, t in row.items()} for b, row in curve.items()},
        "table": table, "cost_table": curve_table,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
