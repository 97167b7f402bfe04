"""vLLM without speculation against vLLM drafting at every step and vLLM with TLT's adaptive schedule.

    python benchmarks/bench_vllm.py                                   # shipped EAGLE-3 drafter, greedy, 1/4/16/64
    python benchmarks/bench_vllm.py --drafter-kind fresh --temperature 1.0
    python benchmarks/bench_vllm.py --workload long-tail --temperature 1.0     # one GRPO-like rollout
    python benchmarks/bench_vllm.py --batch-sizes 1,4 --reps 1 --max-tokens 16 # smoke

Three engines live in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager, fp32, SmolLM2-135M-Instruct):

* ``plain``: vLLM without a speculative config (the baseline);
* ``always``: vLLM drafting ``--k`` tokens with the drafter at every step;
* ``adaptive``: the same drafter under ``speculation="adaptive"``
  (:func:`tlt_trainers.vllm.config.speculation_schedule`: TLT's scheduler inside vLLM's chooses each step's draft
  length per batch bucket from the engine's measured step costs and the drafter's live acceptance). It keeps what
  it learned across reps, as an engine does across an RL run's rollouts; its first rep pays for the exploration.

Drafters (``--drafter-kind``): ``shipped`` (the EAGLE-3 drafter shipped for SmolLM2), ``fresh`` (an untrained
``Eagle3Drafter.from_target``), or ``--drafter PATH`` (any saved drafter, e.g. one warmed by ``tlt warmup-drafter``).
For every rep and batch size the engines run the same prompts (reasoning-gym arithmetic questions, chat-formatted)
one after the other, the order rotating; the table reports tokens per second over plain's in the same rep (>1:
faster), the median and range over reps, the acceptance length (1 + accepted / drafts: vLLM's counters for
``always``; the drafts the adaptive scheduler saw for ``adaptive``), the share of adaptive's steps that drafted, and
whether greedy outputs equal plain's. ``--workload long-tail`` replaces the fixed batches with one rollout whose
answers stop at their own end of sequence, so the running batch shrinks to the few long answers (the tail TLT
targets). Writes benchmarks/results/bench_vllm_<kind>_t<temperature>[_long_tail].json, with the adaptive schedule's
decisions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import math_prompts, print_table, write_results  # noqa: E402

MODES = ("plain", "always", "adaptive")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--drafter-kind", default="shipped", choices=("shipped", "fresh"))
    p.add_argument("--drafter", default=None, help="a saved drafter (EAGLE-1 or EAGLE-3) instead of --drafter-kind")
    p.add_argument("--dataset", default="basic_arithmetic")
    p.add_argument("--workload", default="batches", choices=("batches", "long-tail"))
    p.add_argument("--rows", type=int, default=32, help="long-tail: answers in the rollout")
    p.add_argument("--name", default=None, help="results file name (default from the settings)")
    return p.parse_args()


def load_drafter(model, args):
    from tlt_trainers.drafter.base import Drafter
    from tlt_trainers.drafter.eagle3 import Eagle3Drafter
    from tlt_trainers.shipped import shipped_drafter_for

    if args.drafter:  # either architecture: Drafter.from_pretrained reads it from the saved config
        return Drafter.from_pretrained(args.drafter, target=model), args.drafter
    if args.drafter_kind == "fresh":
        torch.manual_seed(0)
        return Eagle3Drafter.from_target(model), "Eagle3Drafter.from_target (untrained)"
    path = shipped_drafter_for(model)
    return Eagle3Drafter.from_pretrained(path, target=model), str(path)


def main() -> None:
    args = parse_args()
    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import vllm
    from vllm import LLM, SamplingParams

    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.vllm import VLLMDrafterSync, spec_decode_counters
    from tlt_trainers.vllm.config import speculation_schedule
    from tlt_trainers.vllm.schedule import engine_scheduler

    model, tok = load_smollm2()
    path = str(smollm2_hf_dir())
    long_tail = args.workload == "long-tail"
    if long_tail:  # answers that end where they end: most within ~200 tokens, a few run to the cap
        if args.max_tokens == 64:
            args.max_tokens = 512
        prompts = math_prompts(tok, args.rows, seed=11, dataset=args.dataset, instruction=" Think step by step.")
        sizes = [args.rows]
    else:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        prompts = math_prompts(tok, max(sizes), seed=11, dataset=args.dataset,
                               instruction=" Give only the final answer.")
    engine_args = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                       distributed_executor_backend="uni", max_num_seqs=max(sizes))
    drafter, source = load_drafter(model, args)
    engines, syncs = {"plain": LLM(path, **engine_args)}, []
    # "always" last: vLLM's spec-decode counters live in the process-wide Prometheus registry, where the engine built
    # last replaces the other's; adaptive's acceptance comes from its scheduler
    for mode in ("adaptive", "always"):
        sync = VLLMDrafterSync(drafter, model, num_speculative_tokens=args.k,
                               full_vocab_head=drafter.config.uses_draft_vocab)
        spec, extra = speculation_schedule(mode, args.k)
        engines[mode] = sync.create_llm(path, **engine_args, speculative_config=sync.speculative_config(**spec),
                                        **extra)
        syncs.append(sync)
    adaptive = engine_scheduler(engines["adaptive"])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=not long_tail,
                            seed=None if args.temperature == 0 else 0)

    raw = []
    for rep in range(args.reps):
        for size in sizes:
            order = list(MODES[rep % 3:] + MODES[:rep % 3])
            outputs = {}
            for mode in order:
                llm = engines[mode]
                before = spec_decode_counters(llm) if mode == "always" else None
                state = adaptive.tlt_speculation_state() if mode == "adaptive" else None
                start = time.perf_counter()
                result = llm.generate(prompts[:size], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                outputs[mode] = [list(o.outputs[0].token_ids) for o in result]
                record = {"rep": rep, "batch_size": size, "engine": mode, "seconds": seconds,
                          "tokens": sum(map(len, outputs[mode])), "lengths": sorted(map(len, outputs[mode])),
                          "acceptance_length": 1.0, "speculative_step_fraction": float(mode == "always")}
                if before is not None:
                    record["acceptance_length"] = (spec_decode_counters(llm) - before).acceptance_length
                if state is not None:
                    after = adaptive.tlt_speculation_state()
                    steps = after["steps"] - state["steps"]
                    record["speculative_step_fraction"] = (after["speculative_steps"] - state["speculative_steps"]) \
                        / max(steps, 1)
                    record["acceptance_length"] = after["expected_tokens"]
                    record["schedule"] = after["schedule"]
                raw.append(record)
            for record in raw[-len(MODES):]:
                record["same_as_plain"] = outputs[record["engine"]] == outputs["plain"]

    rows, summary = [], []
    for size in sizes:
        ratios = {}
        for mode in MODES:
            mine = [r for r in raw if r["batch_size"] == size and r["engine"] == mode]
            base = [r for r in raw if r["batch_size"] == size and r["engine"] == "plain"]
            ratios[mode] = [(m["tokens"] / m["seconds"]) / (b["tokens"] / b["seconds"]) for m, b in zip(mine, base)]
            plain_tps = statistics.median(b["tokens"] / b["seconds"] for b in base)
            same = all(m["same_as_plain"] for m in mine)
            rows.append([size, mode, f"{plain_tps:.1f}", f"{statistics.median(ratios[mode]):.3f}",
                         f"{min(ratios[mode]):.3f}-{max(ratios[mode]):.3f}",
                         f"{statistics.median(m['acceptance_length'] for m in mine):.2f}",
                         f"{statistics.median(m['speculative_step_fraction'] for m in mine):.2f}",
                         ("yes" if same else "no") if args.temperature == 0 else "-"])
        best = max(statistics.median(ratios["plain"]), statistics.median(ratios["always"]))
        summary.append({"batch_size": size, "adaptive_vs_plain": statistics.median(ratios["adaptive"]),
                        "adaptive_vs_best": statistics.median(ratios["adaptive"]) / best,
                        "always_vs_plain": statistics.median(ratios["always"])})
    if long_tail:
        lengths = raw[0]["lengths"]
        shape = (f"one rollout of {args.rows} answers ending at their EOS (up to {args.max_tokens} tokens; median "
                 f"{statistics.median(lengths):.0f}, longest {lengths[-1]})")
    else:
        shape = f"{args.max_tokens} new tokens per row"
    print(f"vLLM {vllm.__version__}, SmolLM2-135M-Instruct fp32, drafter: {source}, k={args.k}, {shape}, "
          f"temperature {args.temperature}, {args.reps} reps; tokens/s vs plain in the same rep:")
    table = print_table(["batch", "engine", "plain tok/s", "vs plain (median)", "range", "acceptance length",
                         "drafting steps", "greedy identical"], rows)
    for row in summary:
        print(f"batch {row['batch_size']}: adaptive {row['adaptive_vs_plain']:.3f}x plain, "
              f"{row['adaptive_vs_best']:.3f}x the better of plain and always")
    state = adaptive.tlt_speculation_state()
    for sync in syncs:
        sync.close()
    command = "python benchmarks/bench_vllm.py " + " ".join(sys.argv[1:])
    kind = "custom" if args.drafter else args.drafter_kind
    name = args.name or "_".join(["bench_vllm", kind, f"t{args.temperature:g}"] + (["long_tail"] if long_tail else []))
    write_results(name, {"command": command, "vllm": vllm.__version__, "settings": vars(args),
                         "drafter": source, "raw": raw, "summary": summary, "table": table,
                         "adaptive_state": state})


if __name__ == "__main__":
    main()
