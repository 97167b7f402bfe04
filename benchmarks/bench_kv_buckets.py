"""What a traced step costs when its rows hold ~300 tokens, in a 512-slot and a 4096-slot graph session.

    python benchmarks/bench_kv_buckets.py                                  # SmolLM2-135M-shaped random Llama, fp32
    python benchmarks/bench_kv_buckets.py --threads 1                      # steadier on a shared CPU
    python benchmarks/bench_kv_buckets.py --model tiny --reps 20           # a seconds-long smoke run

Steps replayed from graphs have fixed shapes, so their attention cannot follow the rows' lengths step by step. Before
issue 52 it spanned the session's whole capacity: a session kept from a call with long answers (or sized for
veRL's largest ``max_new_tokens``) made every step of short rows pay for thousands of empty slots (scores, softmax
and, on a GPU, SDPA's per-head copies of K/V when a mask is passed). Now a traced step attends over a KV span
(``tlt_trainers.modeling.rows.kv_span``: 256, 512, 1024, ... slots from the rows' longest length) and its graph is
keyed by it.

This times ``rollout.step()`` in ``cuda_graphs="static"`` (the ops a CUDA graph records, run eagerly on the CPU),
greedy, rows of a ~300-token prompt, in two engines whose sessions hold 512 and 4096 slots (``max_new_tokens`` sets
the capacity; the steps timed are the first ones, rows of 300-330 tokens). The 4096-slot session is timed twice, in
turn step by step: with KV spans ("span", the engine's path) and with spans switched off ("capacity": every pass over
the whole capacity, the cost before; ``KV_SPAN_STEP`` set past the capacity). Arms run interleaved, one step each in
turn, so that a shared CPU's drift hits them alike; the table gives the median step and the spread (25th-75th
percentile) and the fastest step over ``--reps`` steps per arm after ``--warmup`` steps (the fastest is the
steadiest figure where other processes share the cores), and each arm's median over the 512-slot one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import print_table, write_results
from transformers import AutoModelForCausalLM, LlamaConfig

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.modeling import rows as rows_module

MODELS = {  # random Llamas built from a config (no download)
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
}
PAD = 0


def build(name: str):
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=8192, pad_token_id=PAD, eos_token_id=1,
                         bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = PAD
    return model


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def start(model, drafter, strategy: str, ids: torch.Tensor, capacity: int):
    """A rollout, prefilled, in a new engine whose graph session holds ``capacity`` slots."""
    config = TLTConfig(cuda_graphs="static", speculation="never" if strategy == "none" else "always",
                       strategy=None if strategy == "none" else strategy, cost_cache="off")
    engine = SpeculativeGenerator(model, None if strategy == "none" else drafter, config)
    scratch = max((s.scratch_slots for s in engine.strategies), default=0)
    new_tokens = capacity - ids.shape[1] - scratch - 1 - 8  # rounds up to ``capacity`` (a multiple of 256)
    rollout = engine.start(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=PAD)
    assert rollout.session.capacity == capacity, (rollout.session.capacity, capacity)
    rollout.begin()
    return rollout


def timed_step(rollout, full_capacity: bool) -> float:
    saved = rows_module.KV_SPAN_STEP
    if full_capacity:  # the cost before: every traced pass over the whole capacity
        rows_module.KV_SPAN_STEP = 1 << 30
    try:
        start_time = time.perf_counter()
        rollout.step()
        return time.perf_counter() - start_time
    finally:
        rows_module.KV_SPAN_STEP = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--batch", default="1,4", help="rows per call, comma-separated")
    parser.add_argument("--strategies", default="none,chain:4",
                        help="traced steps to time: 'none' (plain) and/or 'chain:K' (a random EAGLE drafter)")
    parser.add_argument("--prompt", type=int, default=300, help="tokens each row holds when the timing starts")
    parser.add_argument("--capacities", default="512,4096", help="the sessions' slots (first: the reference)")
    parser.add_argument("--reps", type=int, default=11, help="steps timed per arm")
    parser.add_argument("--warmup", type=int, default=2, help="steps per arm before timing (first traces)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier where other processes share the cores")
    parser.add_argument("--out", default="bench_kv_buckets")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    capacities = [int(c) for c in args.capacities.split(",")]
    model = build(args.model)
    torch.manual_seed(1)
    drafter = EagleDrafter.from_target(model)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt), generator=gen)
        for strategy in args.strategies.split(","):
            arms = [(capacity, "span", start(model, drafter, strategy, ids, capacity)) for capacity in capacities]
            arms += [(capacity, "capacity", rollout) for capacity, _, rollout in arms[1:]]  # the same rollout
            times: dict[int, list[float]] = {i: [] for i in range(len(arms))}
            for rep in range(args.warmup + args.reps):
                for i, (_, mode, rollout) in enumerate(arms):
                    seconds = timed_step(rollout, mode == "capacity")
                    if rep >= args.warmup:
                        times[i].append(seconds)
            reference = statistics.median(times[0])
            for i, (capacity, mode, rollout) in enumerate(arms):
                median = statistics.median(times[i])
                spans = sorted({key[1] for key in rollout.step_graphs.entries})
                rows.append({"batch": batch, "strategy": strategy, "session_slots": capacity, "attention": mode,
                             "spans_traced": spans, "median_ms": 1e3 * median, "min_ms": 1e3 * min(times[i]),
                             "p25_ms": 1e3 * percentile(times[i], 0.25), "p75_ms": 1e3 * percentile(times[i], 0.75),
                             "ratio_to_first": median / reference, "steps_ms": [1e3 * t for t in times[i]],
                             "rows_tokens_at_end": rollout.rows.max_length})
            print(f"batch {batch} {strategy}: done", flush=True)
    table = print_table(
        ["batch", "strategy", "session slots", "attention over", "median ms", "p25-p75 ms", "min ms",
         f"median / {capacities[0]}-slot"],
        [[r["batch"], r["strategy"], r["session_slots"], "KV span" if r["attention"] == "span" else "capacity",
          round(r["median_ms"], 1), f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}", round(r["min_ms"], 1),
          round(r["ratio_to_first"], 2)]
         for r in rows])
    model_name = ("random Llama shaped like SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, vocab 49152), fp32"
                  if args.model == "smollm2" else "tiny random Llama (hidden 64, 2 layers, vocab 256), fp32")
    print("wrote", write_results(args.out, {"model": model_name, "prompt_tokens": args.prompt, "reps": args.reps,
                                            "warmup": args.warmup, "table": table, "rows": rows}))


if __name__ == "__main__":
    main()
