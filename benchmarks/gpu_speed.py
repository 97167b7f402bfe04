"""What a speculative step costs on a GPU against a plain step: arms that fit a time budget, JSON after each arm.

    python benchmarks/gpu_speed.py --budget 220          # on a CUDA machine (benchmarks/gpu_session.sh runs it)
    python benchmarks/gpu_speed.py --cpu-smoke           # this script's own smoke run on CPU: tiny shapes, seconds

An arm is (policy, dtype, batch, sampling): policies shaped like SmolLM2-135M (Llama, 30 layers of 576, 49k
vocabulary) and like Qwen2.5-0.5B (Qwen2, 24 layers of 896, 152k vocabulary), built on the machine from a config
with random weights (no download; the LM head sharpened so greedy ties are rare); bfloat16 and float32; batch 1 and
8; greedy and temperature 1 (top-k 0, top-p 1). The drafter is a fresh EAGLE-3 drafter shaped like the shipped one
(one layer, a 4096-token draft vocabulary): its acceptance is near zero on a random policy, so what an arm shows is
what a step costs, not a speedup. ``--cpu-smoke`` runs two tiny policies (Llama and Qwen2) on the CPU with the
graphs' static path (``cuda_graphs="static"``: the code a capture records, run without capturing).

Per arm, for each strategy (``plain``: speculation off; ``chain:4``; ``tree:6x4:16``; ``adaptive``: the default
engine), a warm call (graphs captured, Triton kernels compiled and self-checked) then a timed call of the same
prompts, each with a new engine: tokens/s; seconds per step (median and mean over the timed call's steps, the
prefill excluded) and the step-cost ratio to a plain step (median against median); tokens per policy forward; graph
replays per step (whole steps replayed by the engine's step graphs, and policy passes replayed by its graph runner,
for the steps that ran eagerly), captures in the warm and in the timed call (the timed call should capture nothing),
steps that ran eagerly; memory (``torch.cuda.memory_allocated`` before the engine, after ``generate()`` with the
engine alive, after ``release_graphs()`` and after the engine is dropped; ``max_memory_allocated`` over the timed
call; the KV cache's peak bytes from the engine's stats); rows identical to plain decoding's (greedy). Stock
``model.generate`` is timed once per arm as the baseline.

Written after EACH arm (``$OUT/gpu_speed.json``, or ``--out-dir``; and one JSON line per arm appended to
``gpu_speed_arms.jsonl``, emptied first), so a run cut short keeps what finished. The budget (``--budget`` seconds
from the start, or ``--deadline`` as a Unix time) is checked by the script: an arm whose estimated time (the slower
of the last two arms of the same policy; for a policy not yet run, twice the slower of the last two arms) does not
fit is skipped and said so, and no strategy starts after the deadline. Arms run bfloat16 first (every policy,
sampling and batch), then float32 greedy, then float32 at T=1; those last are optional: skipped for the budget, they
do not make the run incomplete.

Exit status:
    0   every arm measured, no fallback, no TLT warning, every self-check agreed
    1   an arm fell back to eager (a graph self-check failed: ``GraphRunner.disabled``, ``StepGraphs.failed``,
        a failed entry in ``graph_self_checks()``, or no graph session on CUDA), a TLT warning was logged (a logger
        under ``tlt_trainers``), a Triton kernel self-check failed, a strategy raised, or float32 greedy rows
        differ from plain decoding's (or plain decoding's from ``model.generate``'s)
    3   nothing failed, but the budget ran out before every required arm was measured
    77  no CUDA device (and no ``--cpu-smoke``): nothing measured
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

# This checkout's package, whatever else is installed (an editable install of another checkout, or none: the GPU
# machine runs a copy of the working tree)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXIT_OK, EXIT_FAILED, EXIT_INCOMPLETE, EXIT_NO_CUDA = 0, 1, 3, 77
NOTHING_MEASURED = "no CUDA device: nothing measured"

STRATEGIES = ("plain", "chain:4", "tree:6x4:16", "adaptive")
SAMPLINGS = {"greedy": {"do_sample": False}, "T=1": {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}}
DTYPES = ("bfloat16", "float32")
BATCHES = (1, 8)

# (model type, config) of the policies; built with random weights on the machine
POLICIES = {
    "smollm2-135m-shaped": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          tie_word_embeddings=True, max_position_embeddings=8192,
                                          rms_norm_eps=1e-5)),
    "qwen2.5-0.5b-shaped": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                          tie_word_embeddings=True, max_position_embeddings=32768,
                                          rms_norm_eps=1e-6)),
}
TINY_POLICIES = {
    "tiny-llama": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
    "tiny-qwen2": ("qwen2", dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
}
DRAFT_VOCAB = 4096  # the shipped SmolLM2 drafter's draft vocabulary
LOGIT_SHARPENING = 8.0

START = time.time()


class BudgetExhausted(Exception):
    pass


class TLTWarnings(logging.Handler):
    """Keeps every warning (or worse) logged under ``tlt_trainers`` (the package's loggers; fallbacks announce
    themselves there with messages starting "TLT:")."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


# ---------------------------------------------------------------------------------------------------- building
def build_policy(name: str, spec: tuple, device, dtype):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kind, fields = spec
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind](**fields, pad_token_id=0, bos_token_id=1,
                                                                 eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds for 0.5B parameters on a GPU
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # sharper next-token laws than the init's: greedy ties rare, sampling not uniform
        model.get_output_embeddings().weight.mul_(LOGIT_SHARPENING)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every row runs max_new_tokens: equal work for every strategy
    model = model.to(dtype=dtype).eval()
    return model, sum(p.numel() for p in model.parameters())


def build_drafters(model, device, dtype, strategies) -> dict:
    """The EAGLE-3 drafter (shaped like the shipped one), and a block drafter where a ``block:K`` strategy is asked
    for (not by default)."""
    import torch

    from tlt_trainers import BlockDrafter, Eagle3Drafter

    torch.manual_seed(1)
    vocab = model.config.vocab_size
    drafters = {"eagle3": Eagle3Drafter.from_target(model, draft_vocab_size=min(DRAFT_VOCAB, vocab // 4))}
    if any(s.startswith("block") for s in strategies):
        drafters["block"] = BlockDrafter.from_target(model, block_size=8)
    return {name: d.to(device=device, dtype=dtype) for name, d in drafters.items()}


def prompts(batch: int, vocab: int, length: int, device, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).to(device)


def engine_for(strategy: str, model, drafters: dict, graphs: str):
    """``plain`` (speculation off), ``adaptive`` (the default engine: history drafting on, nothing measured before
    this arm), ``history:K`` (rollout history only), ``block:K`` (the block drafter), or an EAGLE-3 chain or tree
    at every step."""
    from tlt_trainers import SpeculativeGenerator, TLTConfig

    if strategy == "plain":
        return SpeculativeGenerator(model, None, TLTConfig(speculation="never", cuda_graphs=graphs))
    if strategy == "adaptive":
        return SpeculativeGenerator(model, drafters["eagle3"], TLTConfig(speculation="adaptive", cuda_graphs=graphs,
                                                                         cost_cache="off"))
    history = strategy.startswith("history")
    drafter = None if history else drafters["block" if strategy.startswith("block") else "eagle3"]
    return SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy,
                                                          history_drafting=history, cuda_graphs=graphs))


# ---------------------------------------------------------------------------------------------------- measuring
def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device) -> int | None:
    """Bytes held by tensors on the device after a collection (None off CUDA: nothing to measure there)."""
    import torch

    if device.type != "cuda":
        return None
    gc.collect()  # dropped Python objects (engines, rollouts) give their device memory back first
    return torch.cuda.memory_allocated(device)


def graph_counters(rollout) -> dict:
    """What the rollout's graph runners have counted (they live in the engine's graph session, across calls)."""
    runner, steps = getattr(rollout, "graphs", None), getattr(rollout, "step_graphs", None)
    return {"session": runner is not None or steps is not None,
            "pass_replays": getattr(runner, "replays", 0), "pass_captures": getattr(runner, "captures", 0),
            "step_replays": getattr(steps, "replays", 0), "step_captures": getattr(steps, "captures", 0),
            "shapes": getattr(runner, "shapes_prepared", 0) + getattr(steps, "shapes_prepared", 0),
            "pass_disabled": getattr(runner, "disabled", None),
            "step_disabled": "; ".join(f"{key[:4]}: {why}" for key, why in getattr(steps, "failed", {}).items())
            or None}


def fallbacks(calls: dict[str, dict], graphs: str, checks_before: int) -> list[str]:
    """Why this strategy ran (partly) eagerly where graphs should have run it, from the counters of each call (and
    the graph self-checks since ``checks_before``): [] when it did not."""
    from tlt_trainers.rollout.graphs import graph_self_checks

    reasons = []
    for call, counters in calls.items():
        if graphs == "auto" and not counters["session"]:
            reasons.append(f"{call}: no graph session: CUDA graphs are off for this model in this process (a "
                           "self-check failed earlier)")
        for key, what in (("pass_disabled", "policy-pass graphs"), ("step_disabled", "step graphs")):
            if counters[key]:
                reasons.append(f"{call}: {what} fell back to eager: {counters[key]}")
    for check in graph_self_checks()[checks_before:]:
        if not check["agrees"]:
            reasons.append(f"graph self-check failed (bucket {check['bucket']}, {check['tokens_per_row']} tokens "
                           f"per row): {check['reason']}")
    return reasons


def measure_strategy(strategy, model, drafters, ids, sampling, new_tokens, device, graphs, seed) -> dict:
    """A warm call then a timed call of a new engine; the engine is dropped before returning."""
    import torch

    from tlt_trainers.rollout.graphs import graph_self_checks

    checks_before = len(graph_self_checks())
    before = allocated(device)
    engine = engine_for(strategy, model, drafters, graphs)
    kwargs = dict(max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, **SAMPLINGS[sampling])

    def start(engine):
        generator = torch.Generator(device=device).manual_seed(seed) if kwargs["do_sample"] else None
        return engine.start(ids, generator=generator, **kwargs)

    warm = start(engine)
    warm_start = time.perf_counter()
    warm.run()
    synchronize(device)
    warm_seconds = time.perf_counter() - warm_start
    warm_counters = graph_counters(warm)
    rollout = start(engine)
    c0 = graph_counters(rollout)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    begin = time.perf_counter()
    result = rollout.run()
    synchronize(device)
    seconds = time.perf_counter() - begin
    c1 = graph_counters(rollout)
    after = allocated(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    stats = result.stats
    del warm, rollout
    engine.release_graphs()
    released = allocated(device)
    del engine
    dropped = allocated(device)
    step_seconds = [record.seconds for record in stats.trace] or [seconds]
    steps = max(stats.steps, 1)
    step_replays = c1["step_replays"] - c0["step_replays"]
    pass_replays = c1["pass_replays"] - c0["pass_replays"]
    timed_captures = c1["pass_captures"] + c1["step_captures"] - c0["pass_captures"] - c0["step_captures"]
    # The warm call's: its engine started without a session, so its session's counts are the warm call's
    warm_captures = warm_counters["pass_captures"] + warm_counters["step_captures"]
    # Graph shapes set up: captures on a GPU, their first trace with cuda_graphs="static" (the CPU smoke)
    timed_shapes = c1["shapes"] - c0["shapes"]

    def delta(value):
        return None if value is None or before is None else value - before

    return {
        "tokens_per_s": stats.generated_tokens / seconds,
        "seconds": seconds,
        "warm_call_seconds": warm_seconds,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.steps,
        "step_seconds_median": statistics.median(step_seconds),
        "step_seconds_mean": statistics.fmean(step_seconds),
        "acceptance_length": stats.acceptance_length,  # tokens per row and policy forward
        "strategies_chosen": stats.strategies,
        "replays": {"step_graphs": step_replays, "policy_passes": pass_replays},
        "replays_per_step": (step_replays + pass_replays) / steps,
        "steps_replayed_whole": step_replays,
        "eager_steps": max(stats.steps - step_replays, 0),
        "captures": {"warm_call": warm_captures, "timed_call": timed_captures},
        "shapes_prepared": {"warm_call": warm_counters["shapes"], "timed_call": timed_shapes},
        "memory": {
            "allocated_before_engine": before,
            "allocated_after_generate": after,
            "max_allocated": peak,
            "held_by_engine_after_generate": delta(after),
            "peak_over_before_engine": delta(peak),
            "held_after_release_graphs": delta(released),
            "held_after_engine_dropped": delta(dropped),
            "peak_cache_bytes": stats.peak_cache_bytes,
        },
        "fallback": fallbacks({"warm call": warm_counters, "timed call": c1}, graphs, checks_before) or None,
        "sequences": result.sequences,  # compared with plain's, then dropped
    }


def time_generate(model, ids, sampling, new_tokens, device, seed) -> dict:
    import torch

    kwargs = dict(SAMPLINGS[sampling], max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    torch.manual_seed(seed)
    synchronize(device)
    begin = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    synchronize(device)
    seconds = time.perf_counter() - begin
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds,
            "step_seconds_mean": seconds / max(out.shape[1] - ids.shape[1], 1), "sequences": out}


def identical_rows(ours, reference) -> int:
    width = min(ours.shape[1], reference.shape[1])
    return int((ours[:, :width] == reference[:, :width]).all(dim=1).sum())


def run_arm(arm: dict, model, drafters, args, device, graphs, deadline) -> dict:
    ids = prompts(arm["batch"], model.config.vocab_size, args.prompt_len, device, seed=arm["batch"])
    seed = 1000 + arm["batch"]
    record = {"strategies": {}, "errors": {}}
    if not args.no_generate:
        try:
            record["generate"] = time_generate(model, ids, arm["sampling"], args.new_tokens, device, seed)
        except Exception:  # noqa: BLE001 - reported; the engine's strategies still run
            record["errors"]["generate"] = traceback.format_exc()
    for strategy in args.strategies:
        if deadline is not None and time.time() > deadline:
            raise BudgetExhausted(f"budget spent before {strategy}")
        try:
            record["strategies"][strategy] = measure_strategy(strategy, model, drafters, ids, arm["sampling"],
                                                              args.new_tokens, device, graphs, seed)
        except Exception as error:  # noqa: BLE001 - one strategy's failure is reported, the others still run
            record["errors"][strategy] = traceback.format_exc()
            print(f"  {strategy}: {type(error).__name__}: {error}", flush=True)
    plain = record["strategies"].get("plain")
    reference = plain["sequences"] if plain else None
    if "generate" in record and plain and arm["sampling"] == "greedy":
        record["plain_identical_rows_vs_generate"] = identical_rows(reference, record["generate"]["sequences"])
    for m in record["strategies"].values():
        m["step_cost_vs_plain"] = m["step_seconds_median"] / plain["step_seconds_median"] if plain else None
        m["step_cost_vs_plain_mean"] = m["step_seconds_mean"] / plain["step_seconds_mean"] if plain else None
        m["speed_vs_plain"] = m["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        if "generate" in record:
            m["speed_vs_generate"] = m["tokens_per_s"] / record["generate"]["tokens_per_s"]
        if reference is not None and arm["sampling"] == "greedy":
            m["identical_rows_vs_plain"] = identical_rows(m["sequences"], reference)
    for m in [*record["strategies"].values(), record.get("generate", {})]:
        m.pop("sequences", None)
    return record


def arm_problems(arm: dict) -> list[str]:
    """Why this arm fails the session (empty: it passed)."""
    problems = [f"{name} raised: {text.strip().splitlines()[-1]}" for name, text in arm.get("errors", {}).items()]
    for name, m in arm.get("strategies", {}).items():
        problems += [f"{name}: {reason}" for reason in m.get("fallback") or []]
        if arm["dtype"] == "float32" and arm["sampling"] == "greedy" and m.get("identical_rows_vs_plain") is not None \
                and m["identical_rows_vs_plain"] != arm["batch"]:
            problems.append(f"{name}: float32 greedy rows differ from plain decoding's "
                            f"({m['identical_rows_vs_plain']}/{arm['batch']} identical)")
    generate_rows = arm.get("plain_identical_rows_vs_generate")
    if arm["dtype"] == "float32" and generate_rows is not None and generate_rows != arm["batch"]:
        problems.append(f"plain: float32 greedy rows differ from model.generate's ({generate_rows}/{arm['batch']} "
                        "identical)")
    problems += [f"TLT warning: {w}" for w in arm.get("tlt_warnings", [])]
    return problems


# ---------------------------------------------------------------------------------------------------- output
def table(arms: list[dict]) -> str:
    headers = ["policy", "dtype", "batch", "sampling", "strategy", "tokens/s", "vs plain", "step cost vs plain",
               "tokens/forward", "replays/step", "eager steps", "captures warm/timed", "held MiB", "peak MiB", "status"]
    rows = []
    for arm in arms:
        if arm.get("status") == "skipped":
            rows.append([arm["policy"], arm["dtype"], arm["batch"], arm["sampling"], "-", "", "", "", "", "", "", "",
                         "", "", f"skipped: {arm.get('reason', '')}"])
            continue
        for name, m in arm.get("strategies", {}).items():
            mem = m["memory"]
            mib = [None if v is None else v / 2**20 for v in (mem["held_by_engine_after_generate"],
                                                              mem["max_allocated"])]
            rows.append([arm["policy"], arm["dtype"], arm["batch"], arm["sampling"], name, m["tokens_per_s"],
                         m["speed_vs_plain"], m["step_cost_vs_plain"], m["acceptance_length"], m["replays_per_step"],
                         m["eager_steps"], f"{m['captures']['warm_call']}/{m['captures']['timed_call']}",
                         "-" if mib[0] is None else mib[0], "-" if mib[1] is None else mib[1],
                         "FALLBACK" if m.get("fallback") else arm["status"]])
        for name in arm.get("errors", {}):
            rows.append([arm["policy"], arm["dtype"], arm["batch"], arm["sampling"], name, "", "", "", "", "", "", "",
                         "", "", "ERROR"])
    if not rows:
        return "(no arm measured)"
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    """Atomically: a kill while writing leaves the previous arm's file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def header(device) -> dict:
    import platform

    import torch
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        triton_version = None
    return {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cuda": torch.version.cuda, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton_version, "python": platform.python_version(), "cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------------- main
def arm_plan(policies: list[str], dtypes: list[str], batches: list[int], samplings: list[str]) -> list[dict]:
    """The arms in the order they run: bfloat16 (every policy, sampling and batch), then float32 greedy, then float32
    at T=1. Float32 at T=1 adds least (the step costs of float32 show greedy; the law is tested in bf16), so those
    arms are optional: run when the budget leaves time, and their skipping is said but does not make the run
    incomplete."""
    def arms(dtype, sampling_set, required):
        return [{"policy": policy, "dtype": dtype, "batch": batch, "sampling": sampling, "required": required}
                for policy in policies for sampling in sampling_set for batch in batches]

    plan = []
    for dtype in dtypes:
        if dtype == "float32" and len(samplings) > 1:
            plan += arms(dtype, [s for s in samplings if s == "greedy"], True)
            plan += arms(dtype, [s for s in samplings if s != "greedy"], False)
        else:
            plan += arms(dtype, samplings, True)
    return plan


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny policies on the CPU with the graphs' static path (this script's own smoke run)")
    p.add_argument("--policies", default=None, help=f"comma-separated, of {list(POLICIES)} (smoke: "
                   f"{list(TINY_POLICIES)}); default all")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--sampling", default=",".join(SAMPLINGS), help=f"comma-separated, of {list(SAMPLINGS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated: plain, adaptive, chain:K, tree:DxW:N, block:K, history:K (plain is run "
                        "first: the others' ratios are to it)")
    p.add_argument("--new-tokens", type=int, default=None, help="per row and call (default 32; smoke 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 (smoke 8)")
    p.add_argument("--no-generate", action="store_true", help="do not time model.generate")
    p.add_argument("--budget", type=float, default=None, help="seconds from this script's start for the arms")
    p.add_argument("--deadline", type=float, default=None, help="Unix time by which the arms must be done")
    p.add_argument("--out-dir", default=None, help="default $OUT, else benchmarks/results")
    p.add_argument("--name", default=None, help="file name stem (default gpu_speed; smoke gpu_speed_cpu_smoke)")
    args = p.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    if "plain" in args.strategies:  # first: the others' ratios are to it
        args.strategies.remove("plain")
        args.strategies.insert(0, "plain")
    args.new_tokens = args.new_tokens or (8 if args.cpu_smoke else 32)
    args.prompt_len = args.prompt_len or (8 if args.cpu_smoke else 32)
    args.name = args.name or ("gpu_speed_cpu_smoke" if args.cpu_smoke else "gpu_speed")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path, lines = out_dir / f"{args.name}.json", out_dir / f"{args.name}_arms.jsonl"

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(f"gpu_speed: {NOTHING_MEASURED} (--cpu-smoke runs this script's tiny smoke on the CPU)", flush=True)
        write_json(path, {"measured": False, "reason": NOTHING_MEASURED, "exit": EXIT_NO_CUDA})
        return EXIT_NO_CUDA

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warned = TLTWarnings()
    logging.getLogger("tlt_trainers").addHandler(warned)
    try:
        return run(args, path, lines, warned)
    finally:
        logging.getLogger("tlt_trainers").removeHandler(warned)


def run(args, path: Path, lines: Path, warned: TLTWarnings) -> int:
    import torch

    from tlt_trainers.kernels.fused_verification import kernel_self_checks
    from tlt_trainers.rollout.graphs import graph_self_checks

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:  # tiny models gain nothing from intra-op threads, and spinning threads crawl on busy cores
        torch.set_num_threads(1)
    graphs = "static" if args.cpu_smoke else "auto"
    catalogue = TINY_POLICIES if args.cpu_smoke else POLICIES
    policies = args.policies.split(",") if args.policies else list(catalogue)
    unknown = [p for p in policies if p not in catalogue]
    if unknown:
        sys.exit(f"unknown policies {unknown}; choose from {list(catalogue)}")
    deadline = args.deadline if args.deadline is not None else (START + args.budget if args.budget else None)
    plan = arm_plan(policies, args.dtypes.split(","), [int(b) for b in args.batches.split(",")],
                    args.sampling.split(","))
    results = {**header(device), "measured": True, "smoke": args.cpu_smoke, "new_tokens": args.new_tokens,
               "prompt_len": args.prompt_len, "strategies": args.strategies, "graphs": graphs,
               "deadline_in_s": None if deadline is None else round(deadline - time.time(), 1),
               "policies": {}, "arms": [], "status": "running"}
    print(f"gpu_speed: {len(plan)} arms x {len(args.strategies)} strategies on {results['device']}, "
          f"{args.new_tokens} new tokens per row; budget "
          f"{'none' if deadline is None else f'{deadline - time.time():.0f} s'}; writing {path}", flush=True)
    write_json(path, results)
    lines.write_text("")  # this run's arms only
    durations: dict[str, list[float]] = {}
    durations_in_order: list[float] = []
    built: tuple = (None, None, None)  # (key, model, drafter): one policy in memory at a time
    for arm in plan:
        key = (arm["policy"], arm["dtype"])
        # The slower of the last two arms of this policy (the first arm of a dtype also builds the model, compiles
        # kernels); for a policy not yet run, twice the slowest of the last two arms
        mine, latest = durations.get(arm["policy"], [])[-2:], durations_in_order[-2:]
        estimate = max(mine) if mine else (2 * max(latest) if latest else 0.0)
        if deadline is not None and time.time() + estimate > deadline:
            arm.update(status="skipped", reason=f"budget: about {estimate:.0f} s needed, "
                                                f"{max(deadline - time.time(), 0):.0f} s left")
        else:
            begin = time.perf_counter()
            warned.records.clear()
            try:
                if built[0] != key:
                    built = (None, None, None)
                    if device.type == "cuda":
                        gc.collect()
                        torch.cuda.empty_cache()
                    dtype = getattr(torch, arm["dtype"])
                    model, params = build_policy(arm["policy"], catalogue[arm["policy"]], device, dtype)
                    built = (key, model, build_drafters(model, device, dtype, args.strategies))
                    results["policies"][arm["policy"]] = {"parameters": params,
                                                          "config": model.config.to_diff_dict()}
                arm.update(run_arm(arm, built[1], built[2], args, device, graphs, deadline))
                arm["status"] = "ok"
            except BudgetExhausted as stop:
                arm.update(status="incomplete", reason=f"budget: {stop}")
            except Exception:  # noqa: BLE001 - the arm is reported failed, the next one still runs
                arm.setdefault("errors", {})["arm"] = traceback.format_exc()
                arm["status"] = "failed"
            arm["tlt_warnings"] = list(warned.records)
            arm["seconds"] = time.perf_counter() - begin
            durations.setdefault(arm["policy"], []).append(arm["seconds"])
            durations_in_order.append(arm["seconds"])
            arm["problems"] = arm_problems(arm)
            if arm["problems"] and arm["status"] == "ok":
                arm["status"] = "FAILED"
        results["arms"].append(arm)
        results["elapsed_s"] = time.time() - START
        write_json(path, results)
        with lines.open("a") as handle:
            handle.write(json.dumps(arm, default=str) + "\n")
        brief = ", ".join(f"{n} {m['tokens_per_s']:.1f} tok/s x{m['step_cost_vs_plain'] or 0:.2f} step"
                          for n, m in arm.get("strategies", {}).items())
        print(f"[{time.time() - START:5.0f} s] {arm['policy']} {arm['dtype']} batch {arm['batch']} "
              f"{arm['sampling']}: {arm['status']} {arm.get('reason', '')} {brief}", flush=True)
        for problem in arm.get("problems", []):
            print(f"    PROBLEM: {problem}", flush=True)

    results["graph_self_checks"] = graph_self_checks()
    results["kernel_self_checks"] = kernel_self_checks()
    failed_checks = [c for c in results["graph_self_checks"] + results["kernel_self_checks"] if not c["agrees"]]
    failed = [a for a in results["arms"] if a.get("problems") or a["status"] == "failed"]
    skipped = [a for a in results["arms"] if a["status"] in ("skipped", "incomplete")]
    required_skipped = [a for a in skipped if a["required"]]
    results["table"] = table(results["arms"])
    code = EXIT_FAILED if failed or failed_checks else EXIT_INCOMPLETE if required_skipped else EXIT_OK
    results.update(status={EXIT_OK: "ok", EXIT_FAILED: "FAILED", EXIT_INCOMPLETE: "INCOMPLETE"}[code], exit=code,
                   elapsed_s=time.time() - START)
    write_json(path, results)
    print(results["table"])
    for check in failed_checks:
        print(f"SELF-CHECK FAILED: {check}", flush=True)
    print(f"gpu_speed: {results['status']}: {len(results['arms']) - len(skipped)}/{len(plan)} arms measured, "
          f"{len(failed)} with problems, {len(skipped)} skipped or cut by the budget ({len(required_skipped)} "
          f"required), {len(failed_checks)} failed "
          f"self-checks; {results['elapsed_s']:.0f} s; wrote {path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
