"""Fixed-batch sweep: the adaptive engine against no-speculation at each batch size, interleaved in one process.

A rollout's per-bucket ratios compare different samples taken minutes apart, on a CPU whose speed drifts by
10-15% over minutes. This sweep asks the question "is adaptive ever slower than plain decoding at batch size b?"
directly: for each b, the b rows of the timed rollout that ran longest continue from ``prefix`` tokens into their
own answers (a realistic mid-rollout context) for exactly ``new_tokens`` tokens (EOS ignored, so every row stays
active and the batch size is b at every step), with no-spec and adaptive timed back to back, alternating which goes
first, ``reps`` times with shared seeds. Decode seconds exclude the prefill (identical work in both).

The two engines run in *lockstep*: one step of one, one step of the other, each step timed on its own (choosing a
strategy included). This CPU's noise is one-sided and bursty (bursts of slowness of up to 2x lasting seconds;
identical 12-second calls back to back read 0.80-1.08x apart, and cells where adaptive decoded plain at every step
read 0.94-1.13x no-spec), so two calls timed one after the other cannot resolve 3%. In lockstep a burst falls on both
engines' steps alike. The headline pools the reps' decode seconds: no-spec's total over adaptive's. Pooling, not the
fastest rep, because adaptive's time also varies with what its drafts happen to get accepted: a best-of-reps ratio
picks its luckiest call (at batch 1, one call with a 9-token history acceptance read 2.4x while the other two read
0.74x). Beside it: each call's steps counted at their strategy's median step time (``typical_decode_seconds``, the
headline before lockstep), best-of-reps on the raw decode seconds, and the per-rep paired ratios.

The adaptive engine keeps what it learnt in the rollouts (costs, acceptance, history). Its history index is reset
to the rollouts' before every call, minus the replayed rows' own answers: a row continuing its own answer would
otherwise find its future in the history (64 matched tokens, a confident proposal) which no real rollout can. The
siblings' answers stay. So the sweep's own continuations neither help later calls nor leak into later rollouts.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter

import torch
from common import completion_mask

SWEEP_SIZES = (1, 2, 4, 8, 16, 32, 64)


def sweep_contexts(ids, mask, reference, tok, prefix: int) -> tuple[list[list[int]], list[tuple], list[int]]:
    """(contexts, history keys, completion lengths) per rollout row: the prompt plus the first ``prefix`` tokens
    of the row's completion in ``reference`` (stopping before its EOS); keys are the prompts, as in the rollout."""
    prompt_len = ids.shape[1]
    lengths = completion_mask(reference, prompt_len, tok.pad_token_id, tok.eos_token_id).sum(dim=1).tolist()
    contexts, keys = [], []
    for row, length in enumerate(lengths):
        prompt = ids[row][mask[row].bool()].tolist()
        completion = reference[row, prompt_len:].tolist()
        contexts.append(prompt + completion[: max(0, min(prefix, length - 1))])
        keys.append(tuple(prompt))
    return contexts, keys, lengths


def left_pad(contexts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, context in enumerate(contexts):
        ids[i, width - len(context):] = torch.tensor(context)
        mask[i, width - len(context):] = 1
    return ids.to(device), mask.to(device)


def _lockstep(engines: dict, ids, mask, keys, new_tokens, sampling: dict, seed: int, pad_token_id: int) -> dict:
    """Run the engines' rollouts of the same rows one step each in turn; per engine (wall seconds, decode seconds,
    stats). Decode seconds are the engine's own steps, timed one by one (choosing a strategy included), so a burst
    of slowness on this CPU falls on both engines' steps alike instead of on one engine's whole call."""
    sync = ids.device.type == "cuda"

    def clock() -> float:
        if sync:
            torch.cuda.synchronize(ids.device)
        return time.perf_counter()

    rollouts, wall, decode = {}, {}, {}
    for name, engine in engines.items():
        start = clock()
        rollouts[name] = engine.start(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[],
                                      pad_token_id=pad_token_id, generator=torch.Generator().manual_seed(seed),
                                      history_keys=keys, **sampling)
        rollouts[name].begin()
        wall[name], decode[name] = clock() - start, 0.0
    active = list(engines)
    while active:
        for name in list(active):
            start = clock()
            if not rollouts[name].step():
                active.remove(name)
            decode[name] += clock() - start
    out = {}
    for name, rollout in rollouts.items():
        start = clock()
        stats = rollout.finish().stats
        out[name] = (wall[name] + decode[name] + clock() - start, decode[name], stats)
    return out


def batch_sweep(no_spec, adaptive, tok, ids, mask, reference, *, temperature: float, sampling: dict,
                sizes=SWEEP_SIZES, new_tokens: int = 24, prefix: int = 64, reps: int = 3, seed: int = 100,
                log=print) -> list[dict]:
    """One record per (batch size, rep, engine); see the module docstring."""
    contexts, keys, lengths = sweep_contexts(ids, mask, reference, tok, prefix)
    order = sorted(range(len(contexts)), key=lambda r: -lengths[r])  # the tail's rows are the longest answers
    snapshot = copy.deepcopy(adaptive.rollout_history) if adaptive.rollout_history is not None else None
    records = []
    for size in [s for s in sizes if s <= len(contexts)]:
        rows = order[:size]
        s_ids, s_mask = left_pad([contexts[r] for r in rows], tok.pad_token_id, ids.device)
        s_keys = [keys[r] for r in rows]
        replay_history, discarded = None, 0
        if snapshot is not None:
            replay_history = copy.deepcopy(snapshot)
            discarded = sum(replay_history.discard(keys[r], contexts[r]) for r in rows)
        for rep in range(reps):
            names = ("no_spec", "adaptive") if rep % 2 == 0 else ("adaptive", "no_spec")  # who steps first
            if replay_history is not None:
                adaptive.rollout_history = copy.deepcopy(replay_history)
            timed = _lockstep({name: no_spec if name == "no_spec" else adaptive for name in names}, s_ids, s_mask,
                              s_keys, new_tokens, sampling, seed + rep, tok.pad_token_id)
            for name in names:
                seconds, decode, stats = timed[name]
                chosen = count_strategies(stats.strategies.values())
                records.append({"temperature": temperature, "batch": size, "rep": rep, "engine": name,
                                "seconds": seconds, "decode_seconds": decode,
                                "tokens": stats.generated_tokens, "steps": stats.steps,
                                "acceptance_length": stats.acceptance_length, "strategies": dict(chosen),
                                "own_answers_discarded": discarded if name == "adaptive" else 0,
                                "median_step_seconds": statistics.median(r.seconds for r in stats.trace)
                                if stats.trace else None,
                                "typical_decode_seconds": typical_decode_seconds(stats, decode),
                                "outside_step_seconds": outside_step_seconds(stats, decode),
                                "trace": [[r.strategy, r.emitted, r.seconds] for r in stats.trace]})
        mine = [r for r in records if r["batch"] == size]
        log(f"T={temperature} sweep batch {size}: adaptive/no-spec decode speed: typical steps "
            f"{pooled_ratio(mine):.3f}, best-of-{reps} {best_of_reps_ratio(mine):.3f}, "
            f"per rep {', '.join(f'{x:.3f}' for x in sweep_ratios(mine))}")
    if snapshot is not None:
        adaptive.rollout_history = snapshot
    return records


def count_strategies(counts) -> Counter:
    """Steps per strategy, summed over per-bucket (or per-record) {strategy: steps} mappings."""
    total = Counter()
    for per_strategy in counts:
        total.update(per_strategy)
    return total


def sweep_ratios(records: list[dict], key: str = "decode_seconds") -> list[float]:
    """Per rep: no-spec seconds / adaptive seconds (>1: adaptive faster)."""
    by_rep = {}
    for r in records:
        by_rep.setdefault(r["rep"], {})[r["engine"]] = r[key]
    return [v["no_spec"] / v["adaptive"] for _, v in sorted(by_rep.items()) if "no_spec" in v and "adaptive" in v]


def outside_step_seconds(stats, decode_seconds: float | None = None) -> float:
    """Decode seconds spent between steps (choosing a strategy, history proposals): not in any step's trace.
    ``decode_seconds``: the call's decode time when measured outside the engine (lockstep); default its own clock."""
    if decode_seconds is None:
        decode_seconds = stats.total_seconds - stats.prefill_seconds
    return max(decode_seconds - sum(step.seconds for step in stats.trace), 0.0)


def typical_decode_seconds(stats, decode_seconds: float | None = None) -> float:
    """Decode seconds at the machine's typical speed: each strategy's steps counted at that strategy's median step
    time, plus the measured time spent outside steps (choosing, history proposals), which stays visible.

    A burst of slowness hits a few steps of a call; the median step of each strategy does not see it, so this
    compares what the engines chose to do rather than when the CPU stalled.
    """
    by_strategy: dict[str, list[float]] = {}
    for step in stats.trace:
        by_strategy.setdefault(step.strategy, []).append(step.seconds)
    typical = sum(len(times) * statistics.median(times) for times in by_strategy.values())
    return typical + outside_step_seconds(stats, decode_seconds)


def pooled_ratio(records: list[dict], key: str = "typical_decode_seconds") -> float:
    """No-spec's total over the reps / adaptive's (>1: adaptive faster)."""
    total = {name: sum(r[key] for r in records if r["engine"] == name) for name in ("no_spec", "adaptive")}
    return total["no_spec"] / total["adaptive"]


def best_of_reps_ratio(records: list[dict], key: str = "decode_seconds") -> float:
    """No-spec's fastest rep / adaptive's fastest rep (>1: adaptive faster); see the module docstring."""
    fastest = {name: min(r[key] for r in records if r["engine"] == name) for name in ("no_spec", "adaptive")}
    return fastest["no_spec"] / fastest["adaptive"]


def sweep_summary(records: list[dict]) -> tuple[dict, list[list]]:
    """Per (temperature, batch): the pooled typical-step ratio (the headline), the best-of-reps ratio, the per-rep
    ratios' median and range, adaptive's strategies and acceptance."""
    summary, rows = {}, []
    for temperature in sorted({r["temperature"] for r in records}, reverse=True):
        for size in sorted({r["batch"] for r in records if r["temperature"] == temperature}):
            mine = [r for r in records if r["temperature"] == temperature and r["batch"] == size]
            decode, wall = sweep_ratios(mine), sweep_ratios(mine, "seconds")
            adaptive = [r for r in mine if r["engine"] == "adaptive"]
            plain = [r for r in mine if r["engine"] == "no_spec"]
            chosen = count_strategies(r["strategies"] for r in adaptive)
            total = sum(chosen.values()) or 1
            entry = {
                "decode_speedup_lockstep": pooled_ratio(mine, "decode_seconds"),
                "decode_speedup_typical": pooled_ratio(mine),
                "decode_speedup_best_of_reps": best_of_reps_ratio(mine),
                "decode_speedup_median": statistics.median(decode), "decode_speedup_min": min(decode),
                "decode_speedup_max": max(decode), "decode_speedups": decode,
                "wall_speedup_median": statistics.median(wall),
                "no_spec_step_seconds": statistics.median(r["decode_seconds"] / max(r["steps"], 1) for r in plain),
                "acceptance_length": statistics.mean(r["acceptance_length"] for r in adaptive),
                "strategies": dict(chosen.most_common()),
            }
            summary.setdefault(str(temperature), {})[str(size)] = entry
            top = ", ".join(f"{k} {v / total:.0%}" for k, v in chosen.most_common(3))
            rows.append([temperature, size, f"{entry['decode_speedup_lockstep']:.3f}",
                         f"{entry['decode_speedup_typical']:.3f}",
                         f"{entry['decode_speedup_best_of_reps']:.3f}",
                         f"{entry['decode_speedup_median']:.3f}",
                         f"{entry['decode_speedup_min']:.3f}-{entry['decode_speedup_max']:.3f}",
                         f"{entry['wall_speedup_median']:.3f}", f"{entry['no_spec_step_seconds'] * 1000:.0f}",
                         f"{entry['acceptance_length']:.2f}", top])
    return summary, rows


SWEEP_HEADERS = ["T", "batch", "adaptive/no-spec (lockstep, reps pooled)", "typical steps", "best of reps",
                 "per rep: median", "per rep: range", "wall ratio", "no-spec ms/step", "accept len",
                 "adaptive strategies"]
