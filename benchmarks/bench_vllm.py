"""vLLM without speculation against vLLM serving our drafter (fresh and warmed), at fixed batch sizes.

    python benchmarks/bench_vllm.py                         # warmed drafter; greedy, batch 1, 4, 16, 64; 2 reps
    python benchmarks/bench_vllm.py --drafter-kind fresh    # an untrained drafter instead
    python benchmarks/bench_vllm.py --batch-sizes 1,4 --reps 1 --max-tokens 16     # smoke
    python benchmarks/bench_vllm.py --temperature 1.0       # on a GPU (vLLM's CPU backend does not sample
                                                            # exactly when it speculates: check_vllm_sampling.py)
    python benchmarks/bench_vllm.py --workload long-tail    # one GRPO-like rollout: 32 step-by-step answers
                                                            # that end where they end (up to 512 tokens)
    python benchmarks/bench_vllm.py --workload long-tail --max-speculative-batch-size 4   # drafts only while
                                                            # at most 4 requests run (TLT's cut-off in vLLM)

Two engines live in this process at once (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager, fp32): ``plain`` (no
speculation, the baseline) and one serving a drafter through ``tlt_trainers.vllm.VLLMDrafterSync`` with ``--k``
speculative tokens: ``warmed`` (the drafter ``bench_rollout.py`` warmed up and cached, or ``--drafter PATH``;
exported with its full head, since vLLM's EAGLE-1 has no draft vocabulary) or ``fresh`` (an untrained
``EagleDrafter.from_target``). One speculating engine per process: vLLM's counters live in a process-wide
registry, and a second speculating engine's counts do not reach it. For every rep and batch size the engines run
the same prompts (reasoning-gym arithmetic questions, chat-formatted) one after the other, the order rotating;
the table reports tokens per second over plain's in the same rep (>1: faster), the median over reps, and vLLM's
acceptance length (1 + accepted / drafts). Greedy outputs are checked against plain's. ``--workload long-tail``
replaces the fixed batches with one rollout whose answers stop at their own end of sequence, so the running batch
shrinks to the few long answers (the tail TLT targets); ``--max-speculative-batch-size`` gives the drafter engine
TLT's batch-size cut-off (:func:`tlt_trainers.vllm.batch_size_schedule`). Writes
benchmarks/results/bench_vllm_<kind>[_long_tail][_cutN].json.
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

WARMED = "bench-smollm2-basic_arithmetic-iee2caa-t1-n256-v4096-p96-s240-w2"  # bench_rollout.py's default cache


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the only exact setting on vLLM's CPU)")
    p.add_argument("--drafter-kind", default="warmed", choices=("warmed", "fresh"))
    p.add_argument("--drafter", default=None, help="a saved EagleDrafter for 'warmed' (default: the cached warm-up)")
    p.add_argument("--dataset", default="basic_arithmetic")
    p.add_argument("--workload", default="batches", choices=("batches", "long-tail"))
    p.add_argument("--rows", type=int, default=32, help="long-tail: answers in the rollout")
    p.add_argument("--max-speculative-batch-size", type=int, default=None,
                   help="draft only while at most this many requests run (default: always)")
    p.add_argument("--name", default=None, help="results file name (default from the settings)")
    return p.parse_args()


def warmed_drafter(model, path: str | None):
    from tlt_trainers import EagleDrafter
    from tlt_trainers.pretrained import cache_root

    folder = Path(path) if path else cache_root() / "drafters" / WARMED
    if not (folder / "config.json").is_file():
        return None, None
    return EagleDrafter.from_pretrained(folder, target=model), str(folder)


def main() -> None:
    args = parse_args()
    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    import vllm
    from vllm import LLM, SamplingParams

    from tlt_trainers import EagleDrafter
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.vllm import VLLMDrafterSync, batch_size_schedule, spec_decode_counters

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
    torch.manual_seed(0)
    if args.drafter_kind == "fresh":
        drafters = {"fresh": (EagleDrafter.from_target(model), "EagleDrafter.from_target (untrained)")}
    else:
        warmed, source = warmed_drafter(model, args.drafter)
        if warmed is None:
            raise SystemExit("No warmed drafter cached: run benchmarks/bench_rollout.py once (it warms and caches "
                             "one), pass --drafter PATH, or use --drafter-kind fresh.")
        drafters = {"warmed": (warmed, source)}
    schedule = batch_size_schedule(args.k, args.max_speculative_batch_size, max_batch_size=max(sizes))
    extra = {"num_speculative_tokens_per_batch_size": schedule} if schedule is not None else {}
    engines, syncs = {"plain": LLM(path, **engine_args)}, []
    for name, (drafter, _) in drafters.items():
        sync = VLLMDrafterSync(drafter, model, num_speculative_tokens=args.k,
                               full_vocab_head=drafter.config.uses_draft_vocab)
        engines[name] = sync.create_llm(path, **engine_args, speculative_config=sync.speculative_config(**extra))
        syncs.append(sync)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=not long_tail)

    raw = []
    names = list(engines)
    for rep in range(args.reps):
        for size in sizes:
            order = names[rep % len(names):] + names[: rep % len(names)]
            outputs = {}
            for name in order:
                llm = engines[name]
                before = spec_decode_counters(llm) if name != "plain" else None
                start = time.perf_counter()
                result = llm.generate(prompts[:size], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in result)
                outputs[name] = [list(o.outputs[0].token_ids) for o in result]
                counts = (spec_decode_counters(llm) - before) if before is not None else None
                raw.append({"rep": rep, "batch_size": size, "engine": name, "seconds": seconds, "tokens": tokens,
                            "acceptance_length": counts.acceptance_length if counts else 1.0,
                            "drafts": counts.num_drafts if counts else 0,
                            "lengths": sorted(len(ids) for ids in outputs[name])})
            for record in raw[-len(names):]:
                record["same_as_plain"] = outputs[record["engine"]] == outputs["plain"]

    rows = []
    for size in sizes:
        for name in names:
            ratios, accept, same = [], [], True
            for rep in range(args.reps):
                mine = next(r for r in raw if r["rep"] == rep and r["batch_size"] == size and r["engine"] == name)
                base = next(r for r in raw if r["rep"] == rep and r["batch_size"] == size and r["engine"] == "plain")
                ratios.append((mine["tokens"] / mine["seconds"]) / (base["tokens"] / base["seconds"]))
                accept.append(mine["acceptance_length"])
                same &= mine["same_as_plain"]
            plain_tps = statistics.median(r["tokens"] / r["seconds"] for r in raw
                                          if r["batch_size"] == size and r["engine"] == "plain")
            rows.append([size, name, f"{plain_tps:.1f}", f"{statistics.median(ratios):.3f}",
                         f"{min(ratios):.3f}-{max(ratios):.3f}", f"{statistics.median(accept):.2f}",
                         ("yes" if same else "no") if args.temperature == 0 else "-"])
    cut = (f", drafting only at <= {args.max_speculative_batch_size} running requests"
           if args.max_speculative_batch_size else "")
    if long_tail:
        lengths = raw[0]["lengths"]
        shape = (f"one rollout of {args.rows} answers ending at their EOS (up to {args.max_tokens} tokens; median "
                 f"{statistics.median(lengths):.0f}, longest {lengths[-1]})")
    else:
        shape = f"{args.max_tokens} new tokens per row"
    print(f"vLLM {vllm.__version__}, SmolLM2-135M-Instruct fp32, k={args.k}{cut}, {shape}, "
          f"temperature {args.temperature}, {args.reps} reps; tokens/s vs plain in the same rep:")
    table = print_table(["batch", "engine", "plain tok/s", "vs plain (median)", "range", "acceptance length",
                         "greedy identical"], rows)
    for sync in syncs:
        sync.close()
    command = "python benchmarks/bench_vllm.py " + " ".join(sys.argv[1:])
    name = args.name or "_".join(["bench_vllm", args.drafter_kind] + (["long_tail"] if long_tail else [])
                                 + ([f"cut{args.max_speculative_batch_size}"] if schedule is not None else []))
    write_results(name, {"command": command,
                              "vllm": vllm.__version__, "settings": vars(args),
                              "drafters": {name: source for name, (_, source) in drafters.items()},
                              "raw": raw, "table": table})


if __name__ == "__main__":
    main()
