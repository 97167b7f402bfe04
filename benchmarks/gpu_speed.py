"""What a speculative step costs on a GPU, against plain decoding and model.generate: one prepared script.

    python benchmarks/gpu_speed.py                      # on a CUDA machine: about 3-5 minutes on one H200
    python benchmarks/gpu_speed.py --allow-cpu --tiny   # smoke test of this script on CPU (graphs' static path)

Needs nothing but torch and transformers: the policy is built on the machine (a random-weight Llama of about 0.5B
parameters in bf16, sharp enough that greedy ties are rare), with a fresh EAGLE-3 drafter (step costs: its
acceptance is near zero) and a fresh block drafter. History drafting gets a known high acceptance by replaying
prompts it has seen (a second call over the same prompts: the first call's rollouts propose).

For batch 1, 4 and 16, each arm runs a warm call (graphs captured) then a timed one: tokens per second of
``model.generate``, the engine without speculation, adaptive, and always ``chain:4``, ``tree:6x4:16``, ``block:4`` and
``history:8``; seconds per step against a plain step (the step-cost ratio the targets speak of); device-to-host reads
and eager ops per step (``StepProbe``, a short probed call after the timed one); graph captures in the timed call;
then every graph and kernel self-check of the process. Exactness: greedy rollouts in float32 equal to
``model.generate`` token for token; in bf16, the share of rows identical to it and where the first divergence
falls (a multi-token verify pass rounds differently from one-token decoding: see docs/gpu.md).

Writes benchmarks/results/gpu_speed.json (and $OUT/gpu_speed.json when $OUT is set); exits non-zero when float32
greedy differs from model.generate or a self-check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402
from gpu_exactness import first_divergences, sampled_law_check  # noqa: E402

from tlt_trainers import BlockDrafter, Eagle3Drafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.kernels.fused_verification import kernel_self_checks  # noqa: E402
from tlt_trainers.rollout.graphs import graph_self_checks  # noqa: E402
from tlt_trainers.rollout.step_probe import StepProbe  # noqa: E402

ARMS = ("generate", "plain", "adaptive", "chain:4", "tree:6x4:16", "block:4", "history:8")


def build_policy(device, dtype, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if tiny:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    else:  # about 0.5B parameters
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper next-token laws than the init's: greedy ties rare, sampling not uniform
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.to(device=device, dtype=dtype).eval(), sum(p.numel() for p in model.parameters())


def prompts(batch: int, vocab: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """Prompts whose second half repeats the first (history drafting learns the pattern)."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(1, vocab, (batch, length // 2), generator=gen)
    return torch.cat([half, half], dim=1).to(device)


def engine_for(arm, model, drafters) -> SpeculativeGenerator | None:
    if arm == "generate":
        return None
    if arm == "plain":
        return SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    if arm == "adaptive":
        return SpeculativeGenerator(model, drafters["eagle3"], TLTConfig(speculation="adaptive"))
    if arm.startswith("history"):
        return SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy=arm,
                                                           history_drafting=True))
    drafter = drafters["block" if arm.startswith("block") else "eagle3"]
    return SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=arm,
                                                          history_drafting=False))


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(arm, model, drafters, ids, new_tokens, device) -> dict:
    engine = engine_for(arm, model, drafters)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if engine is None:
        for _ in range(2):
            synchronize(device)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), min_new_tokens=new_tokens, **kwargs)
            synchronize(device)
            seconds = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return {"tokens_per_s": tokens / seconds, "seconds": seconds}
    engine.generate(ids, **kwargs)  # warm: graphs captured, history filled
    rollout = engine.start(ids, **kwargs)
    prepared = [rollout.graphs.shapes_prepared if rollout.graphs else 0,
                rollout.step_graphs.shapes_prepared if rollout.step_graphs else 0]
    synchronize(device)
    start = time.perf_counter()
    result = rollout.run()
    synchronize(device)
    seconds = time.perf_counter() - start
    stats = result.stats
    captures = (rollout.graphs.shapes_prepared if rollout.graphs else 0) - prepared[0] + \
        (rollout.step_graphs.shapes_prepared if rollout.step_graphs else 0) - prepared[1]
    probe = probe_steps(engine, ids, kwargs)
    return {"tokens_per_s": stats.generated_tokens / seconds, "seconds": seconds, "steps": stats.steps,
            "seconds_per_step": seconds / max(stats.steps, 1), "acceptance_length": stats.acceptance_length,
            "captures_in_timed_call": captures, "strategies": stats.strategies, **probe}


def probe_steps(engine, ids, kwargs) -> dict:
    """Host reads and eager ops per step of a short call (under a dispatch mode: not timed)."""
    rollout = engine.start(ids, **{**kwargs, "max_new_tokens": min(kwargs["max_new_tokens"], 24)})
    reads, eager = [], []
    with StepProbe() as probe:
        rollout.begin()
        probe.take()
        while True:
            more = rollout.step()
            counts = probe.take()
            reads.append(counts.host_reads)
            eager.append(counts.eager_ops)
            if not more:
                break
    rollout.finish()
    return {"host_reads_per_step": statistics.fmean(reads), "eager_ops_per_step": statistics.fmean(eager)}


def exactness(device, tiny: bool, new_tokens: int) -> dict:
    """Greedy in float32: equal to model.generate token for token; in bf16: the share of identical rows and the
    first divergences, and the sampled law against model.generate (gpu_exactness.py)."""
    model32 = build_policy(device, torch.float32, tiny)[0]
    ids = prompts(8, model32.config.vocab_size, 16, device, seed=3)
    out: dict = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = model32 if dtype == torch.float32 else build_policy(device, dtype, tiny)[0]
        drafter = Eagle3Drafter.from_target(model).to(device=device, dtype=dtype)
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        row = {}
        for strategy in ("none", "chain:4", "tree:6x4:16"):
            ours = engine_for("plain" if strategy == "none" else strategy, model, {"eagle3": drafter}).generate(
                ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0).sequences
            row[strategy] = first_divergences(ours, reference, ids.shape[1])
        out[name] = row
        if dtype == torch.bfloat16:
            out["bfloat16_law"] = sampled_law_check(model, engine_for("chain:4", model, {"eagle3": drafter}),
                                                    model32, device, samples=64 if tiny else 256)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU with the graphs' static path (smoke test)")
    p.add_argument("--tiny", action="store_true", help="a tiny policy and few tokens (smoke test)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny 12)")
    p.add_argument("--out", default="gpu_speed")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("skipped: no CUDA")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    new_tokens = args.new_tokens or (12 if args.tiny else 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "new_tokens": new_tokens, "errors": {}}
    model, params = build_policy(device, dtype, args.tiny)
    results["policy"] = {"parameters": params, "dtype": str(dtype), "config": model.config.to_dict()["hidden_size"]}
    drafters = {"eagle3": Eagle3Drafter.from_target(model).to(device=device, dtype=dtype),
                "block": BlockDrafter.from_target(model, block_size=8).to(device=device, dtype=dtype)}
    rows, table = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        ids = prompts(batch, model.config.vocab_size, 64 if not args.tiny else 16, device, seed=batch)
        measured = {}
        for arm in ARMS:
            try:
                measured[arm] = run_arm(arm, model, drafters, ids, new_tokens, device)
            except Exception as error:  # noqa: BLE001 - one arm's failure is reported, the others still run
                results["errors"][f"{arm}@{batch}"] = traceback.format_exc()
                print(f"{arm} at batch {batch}: {type(error).__name__}: {error}", flush=True)
        plain = measured.get("plain", {})
        for arm, m in measured.items():
            ratio = (m["seconds_per_step"] / plain["seconds_per_step"]
                     if "seconds_per_step" in m and plain.get("seconds_per_step") else None)
            speed = m["tokens_per_s"] / plain["tokens_per_s"] if plain else None
            rows.append({"batch": batch, "arm": arm, **m, "step_cost_vs_plain": ratio, "speed_vs_plain": speed})
            table.append([batch, arm, m["tokens_per_s"], speed, ratio, m.get("acceptance_length"),
                          m.get("host_reads_per_step"), m.get("eager_ops_per_step"), m.get("captures_in_timed_call")])
            print(f"batch {batch} {arm}: {m['tokens_per_s']:.1f} tokens/s", flush=True)
    results["arms"] = rows
    results["table"] = print_table(["batch", "arm", "tokens/s", "vs plain", "step cost vs plain", "tokens/forward",
                                    "host reads/step", "eager ops/step", "captures (2nd call)"], table)
    try:
        results["exactness"] = exactness(device, args.tiny, 32 if not args.tiny else 8)
    except Exception:  # noqa: BLE001
        results["errors"]["exactness"] = traceback.format_exc()
    results["graph_self_checks"] = graph_self_checks()
    results["kernel_self_checks"] = kernel_self_checks()
    path = write_results(args.out, results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{args.out}.json").write_text(path.read_text())
    print(json.dumps(results.get("exactness", {}), indent=1))
    exact = results.get("exactness", {})
    fp32_exact = bool(exact) and all(r["identical_rows"] == r["rows"] for r in exact["float32"].values())
    law_holds = bool(exact) and exact["bfloat16_law"]["ks_pvalue"] > 1e-3
    checks_ok = all(c["agrees"] for c in results["graph_self_checks"] + results["kernel_self_checks"])
    print(f"wrote {path}; float32 greedy exact: {fp32_exact}; bf16 sampled law holds: {law_holds}; self-checks "
          f"agree: {checks_ok}; errors: {sorted(results['errors'])}")
    return 0 if fp32_exact and law_holds and checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
