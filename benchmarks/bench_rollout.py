"""A GRPO-like rollout on SmolLM2-135M-Instruct: model.generate vs our engine without speculation,
with speculation always on, and adaptive.

    python benchmarks/bench_rollout.py            # 8 prompts x 8 samples = 64 sequences, 256 new tokens, 2 reps
    python benchmarks/bench_rollout.py --quick    # 4 prompts x 8 samples = 32 sequences, 128 new tokens, 1 rep
    python benchmarks/bench_rollout.py --quick --num-prompts 2 --group-size 2 --max-new-tokens 16   # smoke
    python benchmarks/bench_rollout.py --temperatures 1.0,0.6   # several sampling temperatures in one run

A rollout is what a GRPO step samples: ``num_prompts`` reasoning-gym questions, each repeated
``group_size`` times, sampled at temperature 1.0 (top_k=0, top_p=1.0) until EOS or
``max_new_tokens``. Natural EOS makes the completion lengths long-tailed: most rows finish early and
a few run on, so the active batch shrinks from ``num_prompts x group_size`` to 1. The length
distribution (min / median / p90 / max) is printed per engine.

Engines, interleaved in one process (the order rotates from rep to rep), with per-rep seeds shared by
all of them:

- ``generate``: stock ``model.generate`` with the same sampling settings (pad/eos from the tokenizer);
- ``no_spec``: ``SpeculativeGenerator(model, None, TLTConfig(speculation="never"))``: same batching and
  finished-row compaction, one token per step (the strongest baseline);
- ``always``: speculation at every step with a fixed chain of ``--k`` drafts;
- ``adaptive``: ``TLTConfig(speculation="adaptive")``. This engine is created once and reused across
  reps and temperatures, as in training, where it learns costs and acceptance online across generate
  calls; one untimed warm-up rollout on other prompts comes first.

The drafter is warmed up on the rollout's own task (``common.warm_drafter``, which runs the library's
``warmup_drafter``: the policy's answers to other prompts of ``--dataset`` at the bench's temperatures, as a TLT
drafter trained on earlier rollouts of the same task would be; cached on disk, so it is trained once),
bench_decode.py's drafter with ``--warmup-dataset gsm_symbolic``, or ``--drafter PATH``.

Definitions (seconds are wall time of the generate call; per-step times come from ``stats.trace``):

- per-bucket numbers group decode steps by the number of active rows (``stats.bucket_name``); ratios
  per bucket are tokens/s ratios (>1: faster than no_spec), because at temperature > 0 each engine
  samples different completions, so the time spent in a bucket also depends on the sampled lengths;
- the *tail* is the time after the number of active rows first drops to <= ``--tail-fraction``
  (default 25%) of the initial batch: the sum of the step times from that step on (prefill excluded).
  Rows only ever leave the batch, so this equals the time of all steps with at most that many rows.
  ``model.generate`` has no per-step trace: only its total time is measured.
- speedups are ratios of seconds, baseline / engine: >1 means the engine is faster.
- the *fixed-batch sweep* (``batch_sweep.py``, after each temperature's reps) times adaptive against no-spec at each
  batch size directly: rows held at a fixed batch size, the two engines in lockstep (one step each in turn), several
  reps. It is the
  cleanest answer to "is adaptive slower than plain decoding at any batch size?". The *tail at lockstep speed*
  (``lockstep_tail_speedup``) re-times no-spec's own tail steps at the sweep's ratio for each batch size: the tail
  comparison without the drift between rollouts run minutes apart (the sweep's ratios come from its rows, the
  longest answers a few dozen tokens in; no-spec's sampled tail sets the weights).
- *equal-batch* speedups compare an engine's steps with no-spec's plain steps at the same batch sizes (same
  rep); *same clock* ones first rescale them by a speed probe (a fixed forward timed before and after every
  rollout), because this CPU's speed drifts by up to 10-15% between rollouts minutes apart.

Until the engine exposes ``stats.trace`` the per-bucket table falls back to ``stats.buckets`` (and
the tail to whole buckets below the threshold: exact when the threshold is a bucket's upper bound,
a lower bound otherwise, marked "~"). Correctness hints: at temperature > 0 outputs differ between
engines (sampling is lossless in distribution, not identical), so we check that every engine returns
sequences of the same shape class (prompt kept, completions right-padded after EOS, each row ended by
EOS or by max_new_tokens) and compare the length distributions; at temperature 0 (greedy) the outputs
must be identical to model.generate's. Writes benchmarks/results/bench_rollout[_quick].json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batch_sweep import SWEEP_HEADERS, batch_sweep, sweep_summary  # noqa: E402
from common import completion_mask, encode, math_prompts, print_table, warm_drafter, write_results  # noqa: E402

from tlt_trainers import Drafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.rollout.stats import BUCKETS, bucket_name  # noqa: E402

TAIL_ROWS = [0.0]  # set in main(): the tail's row threshold
ENGINES = ("generate", "no_spec", "always", "adaptive", "model_only", "history_only")
# Adaptive engines by proposer: the model drafter and rollout history (default), each alone (issue 8's comparison).
ADAPTIVE = {"adaptive": dict(), "model_only": dict(history_drafting=False), "history_only": dict()}
BUCKET_ORDER = [bucket_name(low) for low, _ in BUCKETS]
EQUAL_BUCKETS = ("17-64", "5-16", "2-4", "1")  # equal-batch speedups printed per bucket


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="32 sequences, 128 new tokens, 1 rep")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per rollout, default 8 (quick: 4)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group), default 8")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (quick: 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--temperatures", default=None,
                   help="comma separated list of temperatures, e.g. 1.0,0.6 (overrides --temperature)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions, default 2 (quick: 1)")
    p.add_argument("--seed", type=int, default=0, help="rep r samples with seed + r, the same for all engines")
    p.add_argument("--prompt-seed", type=int, default=7,
                   help="reasoning-gym seed of the rollout prompts (the drafter trains on seed 1000)")
    p.add_argument("--dataset", default="basic_arithmetic",
                   help="reasoning-gym task of the rollout prompts; with the default instruction SmolLM2's answers at "
                        "T=1 are long-tailed (median ~40 tokens, some past 160)")
    p.add_argument("--instruction", default=" Give only the final answer.", help="appended to every question")
    p.add_argument("--engines", default=",".join(ENGINES[:4]),
                   help=f"comma separated subset of {','.join(ENGINES)}; model_only / history_only are adaptive with "
                        "only the model drafter / only history proposals (no drafter)")
    p.add_argument("--k", type=int, default=4, help="draft chain length of the 'always' engine")
    p.add_argument("--tail-fraction", type=float, default=0.25,
                   help="the tail starts when the active rows first drop to <= this fraction of the batch")
    p.add_argument("--adaptive-warmup-prompts", type=int, default=None,
                   help="prompts of the untimed warm-up rollout of the adaptive engine (x group size), "
                        "default num_prompts; 0 skips it")
    p.add_argument("--drafter", default=None, help="load this saved drafter instead of the cached warmed-up one")
    p.add_argument("--train-seconds", type=float, default=240,
                   help="drafter training budget in seconds if not cached (sampling excluded: it feeds the trainer "
                        "directly); 240 with --warmup-dataset gsm_symbolic shares bench_decode's cache")
    p.add_argument("--warmup-prompts", type=int, default=96, help="prompts answered for the drafter warm-up")
    p.add_argument("--warmup-dataset", default="rollout", choices=("rollout", "gsm_symbolic"),
                   help="task of the drafter warm-up: 'rollout' (default) answers other prompts of --dataset with "
                        "--instruction at the bench's temperatures up to --max-new-tokens; 'gsm_symbolic' reuses "
                        "bench_decode.py's drafter (step-by-step gsm_symbolic answers, 160 tokens, T=1 and greedy)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary of the warmed-up drafter")
    p.add_argument("--generate-once", action="store_true",
                   help="time model.generate in the first rep of the first temperature only (the slowest engine by "
                        "far); its ratios are then taken against the other engines' same rep")
    p.add_argument("--sweep-sizes", default="1,2,4,8,16,32,64",
                   help="batch sizes of the fixed-batch sweep (adaptive vs no-spec, see batch_sweep.py); '' skips it")
    p.add_argument("--sweep-tokens", type=int, default=24, help="tokens decoded per row in each sweep call")
    p.add_argument("--sweep-reps", type=int, default=3, help="interleaved sweep repetitions per batch size")
    p.add_argument("--sweep-prefix", type=int, default=64,
                   help="sweep rows continue after this many tokens of their own answer in the last timed rollout")
    p.add_argument("--profile-first", action="store_true",
                   help="time the adaptive engines' cost table before the first rollout (untimed), as engines did "
                        "before costs were learnt from the steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--name", default=None, help="results file name (default bench_rollout or bench_rollout_quick)")
    args = p.parse_args()
    args.num_prompts = args.num_prompts or (4 if args.quick else 8)
    args.max_new_tokens = args.max_new_tokens or (128 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 2)
    args.temperatures = ([float(t) for t in args.temperatures.split(",")] if args.temperatures
                         else [args.temperature])
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.sweep_sizes = [int(b) for b in args.sweep_sizes.split(",") if b.strip()]
    if args.sweep_sizes and not {"no_spec", "adaptive"} <= set(args.engines):
        args.sweep_sizes = []  # the sweep compares these two engines
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engines {unknown}; choose from {ENGINES}")
    if args.adaptive_warmup_prompts is None:
        args.adaptive_warmup_prompts = args.num_prompts
    return args


# ---------------------------------------------------------------------- running one rollout
def sampling_kwargs(temperature: float) -> dict:
    """The same settings for every engine; temperature 0 means greedy."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)


def run_engine(model, tok, engine, ids, mask, max_new_tokens, temperature, seed, device):
    """One rollout; returns (sequences, stats or None, wall seconds, peak device bytes or None)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if engine is None:
        torch.manual_seed(seed)
        seqs = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                              **sampling_kwargs(temperature))
        stats = None
    else:
        res = engine.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                              generator=torch.Generator().manual_seed(seed),  # CPU: same draws on any device
                              **sampling_kwargs(temperature))
        seqs, stats = res.sequences, res.stats
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    return seqs, stats, time.perf_counter() - start, peak


def speed_probe(model, ids, mask, repeats: int = 3) -> float:
    """Seconds of one fixed policy forward (the prefill of 16 prompts), fastest of ``repeats``.

    This CPU's speed drifts by up to 10-15% over minutes (two runs of the same engine on the same tokens, three
    minutes apart, differed by 10%). Probing before and after every rollout measures the machine's speed during it,
    so that step times compared across rollouts (the equal-batch ratios) can be put on the same clock.
    """
    rows = min(16, ids.shape[0])
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:rows], attention_mask=mask[:rows])
            if ids.device.type == "cuda":
                torch.cuda.synchronize(ids.device)
            best = min(best, time.perf_counter() - start)
    return best


def completion_lengths(seqs, prompt_len, tok) -> list[int]:
    return completion_mask(seqs, prompt_len, tok.pad_token_id, tok.eos_token_id).sum(dim=1).tolist()


def shape_check(seqs, ids, tok, max_new_tokens) -> dict:
    """Checks every engine must pass at any temperature (the 'shape class' of a rollout)."""
    batch, prompt_len = ids.shape
    comp = seqs[:, prompt_len:].cpu()
    lengths = completion_lengths(seqs, prompt_len, tok)
    eos = tok.eos_token_id
    ended = []
    padded = []
    for row, n in enumerate(lengths):
        ended.append(n == max_new_tokens or (n > 0 and int(comp[row, n - 1]) == eos))
        padded.append(bool((comp[row, n:] == tok.pad_token_id).all()))
    checks = {
        "batch": seqs.shape[0] == batch,
        "prompt_kept": bool(torch.equal(seqs[:, :prompt_len].cpu(), ids.cpu())),
        "width": 1 <= comp.shape[1] <= max_new_tokens and comp.shape[1] == max(lengths, default=0),
        "rows_end_on_eos_or_limit": all(ended),
        "right_padded": all(padded),
        "nonempty": min(lengths, default=0) >= 1,
    }
    checks["ok"] = all(checks.values())
    return checks


# ---------------------------------------------------------------------- reading the engine's stats
def _get(record, name, default=None):
    if isinstance(record, dict):
        return record.get(name, default)
    return getattr(record, name, default)


def bucket_summary(stats, batch: int, tail_rows: float) -> dict:
    """Per-bucket seconds/tokens/row-forwards/strategies and the tail of one rollout of our engine.

    From ``stats.trace`` when the engine has it (source "trace"), else from ``stats.buckets`` (source
    "buckets": no strategy names, and the tail only from whole buckets, see the module docstring).
    """
    buckets: dict[str, dict] = {}

    def slot(name):
        return buckets.setdefault(name, {"steps": 0, "seconds": 0.0, "emitted": 0, "row_forwards": 0,
                                         "strategies": Counter()})

    trace = getattr(stats, "trace", None)
    if trace:
        tail_seconds, tail_tokens, in_tail = 0.0, 0, False
        for rec in trace:
            size, seconds = int(_get(rec, "batch_size")), float(_get(rec, "seconds"))
            emitted = int(_get(rec, "emitted"))
            b = slot(bucket_name(size))
            b["steps"] += 1
            b["seconds"] += seconds
            b["emitted"] += emitted
            b["row_forwards"] += size
            b["strategies"][str(_get(rec, "strategy", "?"))] += 1
            in_tail = in_tail or size <= tail_rows
            if in_tail:
                tail_seconds += seconds
                tail_tokens += emitted
        tail = {"seconds": tail_seconds, "tokens": tail_tokens, "exact": True}
        source = "trace"
    else:
        tail = {"seconds": 0.0, "tokens": 0, "exact": True}
        for name, bs in (getattr(stats, "buckets", None) or {}).items():
            b = slot(name)
            b["steps"] += bs.steps
            b["seconds"] += bs.seconds
            b["emitted"] += bs.emitted_tokens
            b["row_forwards"] += bs.row_forwards
            if bs.steps - bs.speculative_steps:
                b["strategies"]["none"] += bs.steps - bs.speculative_steps
            if bs.speculative_steps:
                b["strategies"]["speculative"] += bs.speculative_steps
            low, high = next((lo, hi) for lo, hi in BUCKETS if bucket_name(lo) == name)
            if high <= tail_rows:
                tail["seconds"] += bs.seconds
                tail["tokens"] += bs.emitted_tokens
            elif low <= tail_rows and bs.steps:
                tail["exact"] = False  # this bucket straddles the threshold: left out, a lower bound
        source = "buckets"
    # The engine's own strategy counts are authoritative when present.
    strategies = getattr(stats, "strategies", None)
    if strategies:
        for name, counts in strategies.items():
            slot(name)["strategies"] = Counter({str(s): int(n) for s, n in counts.items()})
    for b in buckets.values():
        b["strategies"] = dict(b["strategies"])
    return {"source": source, "buckets": buckets, "tail": tail, "initial_batch": batch, "tail_rows": tail_rows}


def stats_dict(stats) -> dict:
    """The engine's counters without the per-step trace (kept small for the JSON)."""
    try:
        data = stats.to_dict()
    except Exception as exc:  # an engine mid-change must not lose the benchmark
        return {"error": f"stats.to_dict() failed: {exc!r}"}
    data.pop("trace", None)
    return data


def length_summary(lengths: list[int], max_new_tokens: int) -> dict:
    if not lengths:
        return {}
    ordered = sorted(lengths)
    p90 = ordered[min(len(ordered) - 1, max(0, int(round(0.9 * len(ordered))) - 1))]
    return {"count": len(ordered), "min": ordered[0], "median": statistics.median(ordered), "p90": p90,
            "max": ordered[-1], "mean": statistics.fmean(ordered),
            "truncated_fraction": sum(n >= max_new_tokens for n in ordered) / len(ordered)}


# ---------------------------------------------------------------------- main
def main():
    args = parse_args()
    device = torch.device(args.device)
    model, tok = load_smollm2()
    model.to(device)
    spec_engines = [e for e in args.engines if e in ("always", "adaptive", "model_only")]
    drafter, warm_info = None, None
    if spec_engines:
        if args.drafter:
            drafter, warm_info = Drafter.from_pretrained(args.drafter, target=model), {"path": args.drafter}
        else:
            if args.warmup_dataset == "gsm_symbolic":  # bench_decode.py's arguments, so its cache is reused
                task, cache_name = {}, f"bench-smollm2-v{args.draft_vocab}-p{args.warmup_prompts}"
                warm_tokens = 160
            else:
                dataset, warm_tokens = args.dataset, args.max_new_tokens
                task = {"dataset": dataset, "instruction": args.instruction,
                        "temperatures": tuple(args.temperatures)}
                temps = "-".join(f"{t:g}" for t in args.temperatures)
                instruction = hashlib.sha1(args.instruction.encode()).hexdigest()[:6]
                cache_name = (f"bench-smollm2-{dataset}-i{instruction}-t{temps}-n{warm_tokens}-v{args.draft_vocab}"
                              f"-p{args.warmup_prompts}")
            drafter, warm_info = warm_drafter(
                model, tok, prompts=args.warmup_prompts, new_tokens=warm_tokens, train_seconds=args.train_seconds,
                draft_vocab=args.draft_vocab, cache_name=f"{cache_name}-s{int(args.train_seconds)}", **task)
        drafter.to(device)

    engines = {}
    for name in args.engines:
        if name == "generate":
            engines[name] = None
        elif name == "no_spec":
            engines[name] = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
        elif name == "always":
            engines[name] = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always",
                                                                           num_speculative_tokens=args.k))
        elif name in ADAPTIVE:  # created once: it learns across generate calls
            engines[name] = SpeculativeGenerator(model, None if name == "history_only" else drafter,
                                                 TLTConfig(speculation="adaptive", cost_cache="off",
                                                           **ADAPTIVE[name]))

    if "adaptive" in engines:  # same model and device: the one-off cost profile is measured once, shared
        for name in ("model_only", "history_only"):  # (their strategies are a subset of adaptive's)
            if name in engines:
                engines[name].cost_profile = engines["adaptive"].cost_profile

    batch = args.num_prompts * args.group_size
    prompts = math_prompts(tok, args.num_prompts, seed=args.prompt_seed, dataset=args.dataset,
                           instruction=args.instruction)
    ids, mask = encode(tok, [p for p in prompts for _ in range(args.group_size)])  # GRPO groups, adjacent
    ids, mask = ids.to(device), mask.to(device)
    tail_rows = args.tail_fraction * batch
    TAIL_ROWS[0] = tail_rows

    # Untimed warm-ups: a tiny call per engine (first-call overheads), and a full-size rollout of the
    # adaptive engine on other prompts so it starts the timed reps with its online estimates, as in training.
    small_ids, small_mask = ids[:1], mask[:1]
    for engine in engines.values():
        run_engine(model, tok, engine, small_ids, small_mask, 4, args.temperatures[0], args.seed, device)
    adaptive_warmup = []
    learners = [name for name in engines if name in ADAPTIVE]
    if args.profile_first:  # the old one-off cost profile (untimed); by default costs are learnt from the steps
        for name in learners:
            engines[name].profile(batch, ids.shape[1] + min(args.max_new_tokens, 128))
            print(f"{name}: cost profile up to batch {batch} in {engines[name].cost_profile.seconds_spent:.1f}s "
                  "(untimed)", flush=True)
    if learners and args.adaptive_warmup_prompts > 0:
        warm_prompts = math_prompts(tok, args.adaptive_warmup_prompts, seed=args.prompt_seed + 1000,
                                    dataset=args.dataset, instruction=args.instruction)
        overlap = len(set(warm_prompts) & set(prompts))
        w_ids, w_mask = encode(tok, [p for p in warm_prompts for _ in range(args.group_size)])
        for name in learners:
            for temperature in args.temperatures:  # the selector keeps one estimate per sampling regime
                _, w_stats, w_seconds, _ = run_engine(model, tok, engines[name], w_ids.to(device),
                                                      w_mask.to(device), args.max_new_tokens, temperature,
                                                      args.seed + 10_000, device)
                adaptive_warmup.append({"engine": name, "prompts": args.adaptive_warmup_prompts,
                                        "sequences": w_ids.shape[0], "prompt_seed": args.prompt_seed + 1000,
                                        "overlap_with_rollout_prompts": overlap, "seconds": w_seconds,
                                        "temperature": temperature,
                                        "acceptance_length": getattr(w_stats, "acceptance_length", None)})
                print(f"{name} engine warmed up (untimed) at T={temperature}: one rollout of {w_ids.shape[0]} "
                      f"sequences on other prompts ({overlap} shared with the timed ones) in {w_seconds:.1f}s",
                      flush=True)
    else:
        print("adaptive engines NOT warmed up (absent or --adaptive-warmup-prompts 0)", flush=True)

    has_trace = False
    raw = []  # one record per (temperature, rep, engine)
    sweep = []  # one record per (temperature, batch size, rep, engine) of the fixed-batch sweep
    probe = speed_probe(model, ids, mask)
    for temperature in args.temperatures:
        for rep in range(args.reps):
            seed = args.seed + rep
            names = list(engines)
            if args.generate_once and (temperature != args.temperatures[0] or rep > 0):
                names = [n for n in names if n != "generate"]  # the slowest baseline, measured once
            names = names[rep % len(names):] + names[: rep % len(names)]  # rotate the order across reps
            outputs = {}
            for name in names:
                seqs, stats, seconds, peak = run_engine(model, tok, engines[name], ids, mask, args.max_new_tokens,
                                                        temperature, seed, device)
                probe_after = speed_probe(model, ids, mask)
                lengths = completion_lengths(seqs, ids.shape[1], tok)
                record = {"temperature": temperature, "rep": rep, "seed": seed, "engine": name,
                          "seconds": seconds, "tokens": sum(lengths), "lengths": lengths,
                          "probe_seconds": (probe + probe_after) / 2,
                          "peak_device_bytes": peak, "shape_check": shape_check(seqs, ids, tok, args.max_new_tokens)}
                if stats is not None:
                    has_trace = has_trace or bool(getattr(stats, "trace", None))
                    record["engine_seconds"] = stats.total_seconds
                    record["acceptance_length"] = stats.acceptance_length
                    record["peak_cache_bytes"] = getattr(stats, "peak_cache_bytes", None)
                    record["steps"] = bucket_summary(stats, batch, tail_rows)
                    record["trace"] = [[r.batch_size, r.strategy, r.emitted, r.seconds]
                                       for r in getattr(stats, "trace", [])]
                    record["stats"] = stats_dict(stats)
                    record["history_proposed"] = getattr(stats, "history_proposed", 0)
                    record["history_bytes"] = getattr(stats, "history_bytes", 0)
                outputs[name] = seqs
                raw.append(record)
                probe = probe_after
                print(f"T={temperature} rep {rep} {name}: {seconds:.2f}s, {sum(lengths)} tokens, "
                      f"shape ok: {record['shape_check']['ok']}", flush=True)
            if temperature == 0 and "generate" in outputs:
                for name, seqs in outputs.items():
                    same = seqs.shape == outputs["generate"].shape and torch.equal(seqs, outputs["generate"])
                    next(r for r in raw if r["temperature"] == temperature and r["rep"] == rep
                         and r["engine"] == name)["greedy_identical_to_generate"] = same
        if args.sweep_sizes and "no_spec" in outputs:
            sweep += batch_sweep(engines["no_spec"], engines["adaptive"], tok, ids, mask, outputs["no_spec"],
                                 temperature=temperature, sampling=sampling_kwargs(temperature),
                                 sizes=args.sweep_sizes, new_tokens=args.sweep_tokens, prefix=args.sweep_prefix,
                                 reps=args.sweep_reps, seed=args.seed + 100,
                                 log=lambda line: print(line, flush=True))

    if not has_trace:
        print("\nNOTE: the engine has no stats.trace yet (per-step batch size/strategy/seconds); per-bucket numbers "
              "come from stats.buckets, strategies are only 'none'/'speculative', and tail times are whole "
              "buckets at or below the threshold ('~' = lower bound).")

    summary, rows_total, rows_bucket, rows_len, rows_check = aggregate(args, raw, batch, tail_rows)

    print(f"\nSmolLM2-135M-Instruct {next(model.parameters()).dtype} on {device}, rollout {args.num_prompts} prompts x "
          f"{args.group_size} samples = {batch} sequences, max {args.max_new_tokens} new tokens, {args.reps} rep(s), "
          f"k={args.k}, tail = steps with <= {tail_rows:g} active rows; drafter {warm_info}")
    print("\nTotals (median over reps; speedup = baseline seconds / engine seconds):")
    table_total = print_table(["T", "engine", "rollout s", "tok/s", "vs generate", "vs no-spec", "tail s",
                               "tail tok/s", "tail vs no-spec", "accept len", "peak cache MB"], rows_total)
    print("\nPer active-batch bucket (seconds: mean per rep; ratios: tokens/s vs no-spec; tok/fwd: tokens per "
          "row-forward; adaptive's strategies: most used first, summed over reps):")
    table_bucket = print_table(["T", "bucket", "no-spec s", "always s", "adaptive s", "no-spec tok/s",
                                "always/no-spec", "adaptive/no-spec", "tok/fwd always", "tok/fwd adaptive",
                                "adaptive strategies"], rows_bucket)
    proposers, rows_prop = proposer_rows(raw)
    table_prop = None
    if rows_prop:
        print("\nProposers per rep (rep 0: the prompts' first visit, history = finished siblings and own context; "
              "later reps revisit the same prompts, as later epochs do, so earlier rollouts are in the history too):")
        table_prop = print_table(["T", "rep", "engine", "equal-batch speedup", "equal-batch tail speedup",
                                  "clock", *(f"same clock: {n}" for n in ("all", *EQUAL_BUCKETS, "tail")),
                                  "accept len", "vs no-spec", "tail vs no-spec",
                                  "history tokens proposed", "history MB"], rows_prop)
    sweep_results, table_sweep, lockstep_tail = None, None, {}
    if sweep:
        sweep_results, rows_sweep = sweep_summary(sweep)
        print(f"\nFixed-batch sweep: adaptive vs no-spec at each batch size, {args.sweep_tokens} tokens per row from "
              f"{args.sweep_prefix} tokens into the longest answers, {args.sweep_reps} interleaved reps "
              "(decode seconds no-spec / adaptive, >1: adaptive faster; headline: the engines stepped in lockstep, "
              "reps pooled, see batch_sweep.py):")
        table_sweep = print_table(SWEEP_HEADERS, rows_sweep)
        for temperature in args.temperatures:
            tail = lockstep_tail_speedup(raw, sweep_results, temperature, tail_rows)
            if tail is not None:
                lockstep_tail[str(temperature)] = tail
                print(f"T={temperature}: tail at lockstep speed (no-spec's tail steps, "
                      f"{tail['no_spec_tail_seconds']:.1f} s, re-timed at the sweep's ratio per batch size): "
                      f"adaptive {tail['speedup']:.3f}x no-spec")
    print("\nCompletion lengths (all reps pooled; EOS included):")
    table_len = print_table(["T", "engine", "n", "min", "median", "p90", "max", "mean", "hit max"], rows_len)
    print("\nCorrectness hints (sampling differs between engines at T>0; shapes and length distributions should "
          "agree; at T=0 outputs must equal model.generate's):")
    table_check = print_table(["T", "engine", "shape class ok", "failed checks", "greedy identical"], rows_check)

    path = write_results(args.name or ("bench_rollout_quick" if args.quick else "bench_rollout"), {
        "settings": {**vars(args), "batch": batch, "tail_rows": tail_rows, "device": str(device)},
        "drafter_warmup": warm_info, "adaptive_warmup": adaptive_warmup, "engine_has_trace": bool(has_trace),
        "summary": summary, "raw": raw, "proposers": proposers, "sweep": sweep_results, "sweep_raw": sweep,
        "lockstep_tail": lockstep_tail,
        "adaptive_state": {name: adaptive_state(engines[name], args.temperatures) for name in learners},
        "tables": {"totals": table_total, "buckets": table_bucket, "lengths": table_len, "checks": table_check,
                   "proposers": table_prop, "sweep": table_sweep},
    })
    print(f"\nwrote {path}")


def adaptive_state(engine, temperatures) -> dict | None:
    """The adaptive engine's cost profile and what each selector believes at the end (for the JSON)."""
    if engine is None:
        return None
    selectors = {str(t): engine.selector(t > 0, t if t > 0 else 1.0).summary() for t in temperatures}
    return {"cost_profile": engine.cost_profile.to_dict(), "selectors": json.loads(json.dumps(selectors))}


def ratio(a, b):
    """a / b, or None when either is missing or zero (e.g. a baseline without tail steps)."""
    return a / b if a and b else None


def plain_step_seconds(trace) -> dict[int, float]:
    """Mean step time of plain decoding by batch size, from a no-spec trace."""
    sums: dict[int, list] = {}
    for size, _, _, seconds in trace:
        sums.setdefault(size, []).append(seconds)
    return {size: statistics.mean(v) for size, v in sums.items()}


def _interpolate(table: dict[int, float], size: int) -> float:
    if size in table:
        return table[size]
    sizes = sorted(table)
    lower = max((b for b in sizes if b < size), default=sizes[0])
    upper = min((b for b in sizes if b > size), default=sizes[-1])
    if lower == upper:
        return table[lower] * size / lower if size > lower else table[lower]
    w = (size - lower) / (upper - lower)
    return (1 - w) * table[lower] + w * table[upper]


def equal_batch_speedups(trace, plain: dict[int, float], tail_rows: float, clock: float = 1.0) -> dict:
    """Speedup over plain decoding at equal batch sizes: tokens/s of the engine's steps divided by the tokens/s
    plain decoding reaches at the same sequence of batch sizes (no-spec's measured step time per batch size).

    Sampled completions differ between engines at T > 0, so wall times mix the engine's efficiency with how
    long the sampled rows happened to be; this ratio keeps only the efficiency. Per bucket, and for the tail.
    ``clock``: the machine's speed during the no-spec rollout relative to this one (ratio of speed probes);
    the engine's step seconds are multiplied by it, to compare both on no-spec's clock.
    """
    groups: dict[str, list] = {}
    for size, _, emitted, seconds in trace:
        for name in (bucket_name(size), "all") + (("tail",) if size <= tail_rows else ()):
            g = groups.setdefault(name, [0, 0.0, 0, 0.0])
            g[0] += emitted
            g[1] += seconds * clock
            g[2] += size
            g[3] += _interpolate(plain, size)
    return {name: (e / s) / (rows / ps) if s and ps else None for name, (e, s, rows, ps) in groups.items()}


def lockstep_tail_speedup(raw, sweep_results: dict, temperature: float, tail_rows: float) -> dict | None:
    """The tail's speedup with the drift taken out: no-spec's tail steps re-timed at the lockstep sweep's ratios.

    Whole-rollout and bucket ratios compare rollouts run minutes apart on a CPU whose speed drifts by 10-30%, and
    at T > 0 on different sampled lengths. Here no-spec's own tail mix (its seconds at each batch size <= tail_rows,
    pooled over reps) is the workload, and each batch size's share is divided by the sweep's adaptive/no-spec
    decode ratio at that size (the engines stepped in lockstep; linear between swept sizes, clamped outside).
    """
    ratios = {int(size): r["decode_speedup_lockstep"]
              for size, r in (sweep_results or {}).get(str(temperature), {}).items()
              if r.get("decode_speedup_lockstep")}
    seconds: dict[int, float] = defaultdict(float)
    for r in raw:
        if r["engine"] == "no_spec" and r["temperature"] == temperature:
            for size, _, _, step_seconds in r.get("trace") or []:
                if size <= tail_rows:
                    seconds[size] += step_seconds
    if not ratios or not seconds:
        return None
    sizes = sorted(ratios)

    def at(size: int) -> float:
        if size <= sizes[0] or size >= sizes[-1]:
            return ratios[sizes[0] if size <= sizes[0] else sizes[-1]]
        return _interpolate(ratios, size)

    plain = sum(seconds.values())
    adaptive = sum(t / at(size) for size, t in seconds.items())
    return {"speedup": plain / adaptive, "no_spec_tail_seconds": plain, "estimated_adaptive_seconds": adaptive,
            "seconds_by_batch_size": dict(sorted(seconds.items())), "sweep_ratios": ratios}


def proposer_rows(raw):
    """Per (temperature, rep): each adaptive engine's acceptance and its time ratios to no-spec of the same rep."""
    out, rows = [], []
    base = {(r["temperature"], r["rep"]): r for r in raw if r["engine"] == "no_spec"}
    for r in raw:
        if r["engine"] not in (*ADAPTIVE, "always") or (r["temperature"], r["rep"]) not in base:
            continue
        b = base[(r["temperature"], r["rep"])]
        plain = plain_step_seconds(b.get("trace") or [])
        clock = b["probe_seconds"] / r["probe_seconds"] if r.get("probe_seconds") and b.get("probe_seconds") else 1.0
        equal = equal_batch_speedups(r.get("trace") or [], plain, TAIL_ROWS[0]) if plain else {}
        equal_clock = equal_batch_speedups(r.get("trace") or [], plain, TAIL_ROWS[0], clock) if plain else {}
        item = {"temperature": r["temperature"], "rep": r["rep"], "engine": r["engine"],
                "equal_batch_speedup": equal, "equal_batch_speedup_same_clock": equal_clock, "clock": clock,
                "acceptance_length": r.get("acceptance_length"),
                "speedup_vs_no_spec": ratio(b["seconds"], r["seconds"]),
                "tail_speedup_vs_no_spec": ratio(b["steps"]["tail"]["seconds"], r["steps"]["tail"]["seconds"]),
                "history_proposed": r.get("history_proposed", 0), "history_bytes": r.get("history_bytes", 0)}
        out.append(item)
        rows.append([item["temperature"], item["rep"], item["engine"], cell(equal.get("all")), cell(equal.get("tail")),
                     cell(clock), *(cell(equal_clock.get(name)) for name in ("all", *EQUAL_BUCKETS, "tail")),
                     cell(item["acceptance_length"]),
                     cell(item["speedup_vs_no_spec"]), cell(item["tail_speedup_vs_no_spec"]), item["history_proposed"],
                     cell(item["history_bytes"] / 2**20)])
    return out, rows


def paired_ratio(baseline: list[dict], engine: list[dict]) -> float | None:
    """Median over the reps both ran of baseline seconds / engine seconds (``--generate-once`` times one rep)."""
    base = {r["rep"]: r["seconds"] for r in baseline}
    ratios = [base[r["rep"]] / r["seconds"] for r in engine if r["rep"] in base and r["seconds"]]
    return statistics.median(ratios) if ratios else None


def cell(x):
    return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def aggregate(args, raw, batch, tail_rows):
    """Medians and pooled per-bucket numbers per temperature and engine, and the printed rows."""
    summary, rows_total, rows_bucket, rows_len, rows_check = {}, [], [], [], []
    for temperature in args.temperatures:
        recs = defaultdict(list)
        for r in raw:
            if r["temperature"] == temperature:
                recs[r["engine"]].append(r)
        per_engine = {}
        for name, rs in recs.items():
            s = {"seconds": statistics.median(r["seconds"] for r in rs),
                 "tokens": statistics.median(r["tokens"] for r in rs),
                 "tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in rs),
                 "lengths": length_summary([n for r in rs for n in r["lengths"]], args.max_new_tokens)}
            if "steps" in rs[0]:
                s["tail_seconds"] = statistics.median(r["steps"]["tail"]["seconds"] for r in rs)
                s["tail_tokens"] = statistics.median(r["steps"]["tail"]["tokens"] for r in rs)
                s["tail_exact"] = all(r["steps"]["tail"]["exact"] for r in rs)
                s["acceptance_length"] = statistics.median(r["acceptance_length"] for r in rs)
                peaks = [r["peak_cache_bytes"] for r in rs if r.get("peak_cache_bytes") is not None]
                s["peak_cache_bytes"] = max(peaks) if peaks else None
                pooled = {}
                for r in rs:
                    for bname, b in r["steps"]["buckets"].items():
                        p = pooled.setdefault(bname, {"steps": 0, "seconds": 0.0, "emitted": 0, "row_forwards": 0,
                                                      "strategies": Counter()})
                        for key in ("steps", "seconds", "emitted", "row_forwards"):
                            p[key] += b[key]
                        p["strategies"].update(b["strategies"])
                for p in pooled.values():
                    p["seconds_per_rep"] = p["seconds"] / len(rs)
                    p["tokens_per_second"] = p["emitted"] / p["seconds"] if p["seconds"] else None
                    p["tokens_per_row_forward"] = p["emitted"] / p["row_forwards"] if p["row_forwards"] else None
                    p["strategies"] = dict(p["strategies"].most_common())
                s["buckets"] = pooled
            peaks = [r["peak_device_bytes"] for r in rs if r.get("peak_device_bytes") is not None]
            s["peak_device_bytes"] = max(peaks) if peaks else None
            s["shape_class_ok"] = all(r["shape_check"]["ok"] for r in rs)
            s["failed_checks"] = sorted({k for r in rs for k, v in r["shape_check"].items() if k != "ok" and not v})
            identical = [r["greedy_identical_to_generate"] for r in rs if "greedy_identical_to_generate" in r]
            s["greedy_identical_to_generate"] = all(identical) if identical else None
            per_engine[name] = s
        summary[str(temperature)] = per_engine

        gen, nos = per_engine.get("generate"), per_engine.get("no_spec")
        for name, s in per_engine.items():
            tail = s.get("tail_seconds")
            tail_cell = "-" if tail is None else ("" if s["tail_exact"] else "~") + f"{tail:.3g}"
            tail_tps = ratio(s.get("tail_tokens"), tail)
            s["speedup_vs_generate"] = paired_ratio(recs["generate"], recs[name]) if gen else None
            s["speedup_vs_no_spec"] = ratio(nos["seconds"], s["seconds"]) if nos else None
            s["tail_speedup_vs_no_spec"] = ratio(nos.get("tail_seconds"), tail) if nos else None
            peak = s.get("peak_cache_bytes")
            rows_total.append([temperature, name, s["seconds"], s["tokens_per_second"],
                               cell(s["speedup_vs_generate"]), cell(s["speedup_vs_no_spec"]), tail_cell,
                               cell(tail_tps), cell(s["tail_speedup_vs_no_spec"]), cell(s.get("acceptance_length")),
                               cell(peak / 2**20 if peak else None)])
            lens = s["lengths"]
            rows_len.append([temperature, name, lens["count"], lens["min"], lens["median"], lens["p90"], lens["max"],
                             lens["mean"], f"{lens['truncated_fraction']:.0%}"])
            rows_check.append([temperature, name, "yes" if s["shape_class_ok"] else "NO",
                               ",".join(s["failed_checks"]) or "-",
                               {None: "-", True: "yes", False: "NO"}[s["greedy_identical_to_generate"]]])

        for bname in BUCKET_ORDER:
            got = {name: (per_engine.get(name) or {}).get("buckets", {}).get(bname)
                   for name in ("no_spec", "always", "adaptive")}
            if not any(got.values()):
                continue
            base = got["no_spec"]
            tps = {name: (b or {}).get("tokens_per_second") for name, b in got.items()}
            strategies = (got["adaptive"] or {}).get("strategies") or {}
            rows_bucket.append([
                temperature, bname,
                *(cell((b or {}).get("seconds_per_rep")) for b in got.values()),
                cell(tps["no_spec"]),
                cell(ratio(tps["always"], tps["no_spec"])), cell(ratio(tps["adaptive"], tps["no_spec"])),
                cell((got["always"] or {}).get("tokens_per_row_forward")),
                cell((got["adaptive"] or {}).get("tokens_per_row_forward")),
                ", ".join(f"{k}:{v}" for k, v in strategies.items()) or "-",
            ])
            for name in ("always", "adaptive"):
                if got[name] is not None and base is not None:
                    got[name]["tokens_per_second_vs_no_spec"] = ratio(tps[name], tps["no_spec"])
    return summary, rows_total, rows_bucket, rows_len, rows_check


if __name__ == "__main__":
    main()
