"""What a speculative step would cost a GPU in host round trips and eager launches, counted on the CPU.

    python benchmarks/bench_step_proxies.py                       # SmolLM2-135M-Instruct, shipped drafters
    python benchmarks/bench_step_proxies.py --out bench_step_proxies_before

A GPU step is fast when the host never waits inside it and the device replays it from graphs. A CPU has neither
cost, so it cannot time them, but it can count them (``tlt_trainers.rollout.step_probe.StepProbe``): per engine step,
the device-to-host reads (``item``/``int``/``bool``, ``nonzero``, ``tolist``, ...; mean and most), the aten ops
dispatched outside a graph replay (each one launch on a GPU; mean and median: the first step after the prefill and
steps where rows finish run eagerly) and those inside one, with ``cuda_graphs="static"`` (the static-buffer path a
capture records), plus the graphs captured (shapes prepared) in a first and a second ``generate()`` call
with the same shapes. Greedy and T=1, batch 1 and 4; plain decoding, ``chain:4`` and ``tree:6x4:16`` with the
shipped EAGLE-3 drafter, ``block:4`` with the shipped block drafter, ``history:8``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch
from common import print_table, write_results

from tlt_trainers import Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.pretrained import load_smollm2
from tlt_trainers.rollout.step_probe import StepProbe
from tlt_trainers.shipped import shipped_drafter_for
from tlt_trainers.shipped.prompts import EVAL_CHAT_TOPICS, prompt_mix

ARMS = (("plain", "eagle3", "none"), ("chain:4", "eagle3", "chain:4"), ("tree:6x4:16", "eagle3", "tree:6x4:16"),
        ("block:4", "block", "block:4"), ("history:8", None, "history:8"))


def probe_call(engine: SpeculativeGenerator, ids, mask, tok, new_tokens: int, do_sample: bool) -> dict:
    """One generate() call driven step by step under the probe: per-step counts and the graph shapes prepared."""
    gen = torch.Generator().manual_seed(0)
    rollout = engine.start(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=do_sample,
                           temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, generator=gen)
    steps = []
    def prepared() -> int:
        return sum(r.shapes_prepared for r in (rollout.graphs, getattr(rollout, "step_graphs", None))
                   if r is not None)

    prepared_before = prepared()
    with StepProbe() as probe:
        rollout.begin()
        probe.take()
        while True:
            more = rollout.step()
            steps.append(probe.take())
            if not more:
                break
    rollout.finish()
    return {"steps": steps, "captures": prepared() - prepared_before,
            "acceptance": rollout.stats.acceptance_length}


def summarize(steps) -> dict:
    reads = [s.host_reads for s in steps]
    return {"steps": len(steps), "host_reads_mean": statistics.fmean(reads), "host_reads_max": max(reads),
            "host_reads_median": statistics.median(reads),
            "eager_ops_mean": statistics.fmean(s.eager_ops for s in steps),
            "eager_ops_median": statistics.median(s.eager_ops for s in steps),
            "graph_ops_mean": statistics.fmean(s.graph_ops for s in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default="bench_step_proxies")
    args = p.parse_args()
    model, tok = load_smollm2()
    drafters = {kind: Drafter.from_pretrained(shipped_drafter_for(model, kind), target=model)
                for kind in ("eagle3", "block")}
    prompts = prompt_mix(tok, 8, seed=7, topics=EVAL_CHAT_TOPICS)
    rows, results = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        enc = tok(prompts[:batch], return_tensors="pt", padding=True)
        for do_sample in (False, True):
            for name, kind, strategy in ARMS:
                config = TLTConfig(speculation="never" if strategy == "none" else "always",
                                   strategy=None if strategy == "none" else strategy, cuda_graphs="static",
                                   history_drafting=kind is None, show_progress=False)
                engine = SpeculativeGenerator(model, drafters.get(kind), config)
                first = probe_call(engine, enc.input_ids, enc.attention_mask, tok, args.new_tokens, do_sample)
                second = probe_call(engine, enc.input_ids, enc.attention_mask, tok, args.new_tokens, do_sample)
                summary = summarize(second["steps"])
                reads = sum((s.reads_by_op for s in second["steps"]), start=Counter())
                eager = sum((s.eager_by_op for s in second["steps"]), start=Counter())
                result = {"arm": name, "batch": batch, "temperature": 1.0 if do_sample else 0.0, **summary,
                          "captures_first_call": first["captures"], "captures_second_call": second["captures"],
                          "acceptance_length": second["acceptance"],
                          "reads_by_op_per_step": {k: v / summary["steps"] for k, v in reads.most_common()},
                          "eager_ops_by_op_per_step": {k: v / summary["steps"] for k, v in eager.most_common(12)}}
                results.append(result)
                rows.append([name, batch, "T=1" if do_sample else "greedy", summary["host_reads_mean"],
                             summary["host_reads_max"], summary["eager_ops_mean"], summary["eager_ops_median"],
                             summary["graph_ops_mean"],
                             first["captures"], second["captures"], second["acceptance"]])
                print(f"{name} batch {batch} {'T=1' if do_sample else 'greedy'}: {dict(reads.most_common(6))}",
                      flush=True)
    table = print_table(["arm", "batch", "T", "host reads/step", "max", "eager ops/step", "median",
                         "graph ops/step",
                         "captures call 1", "captures call 2", "tokens/forward"], rows)
    path = write_results(args.out, {"new_tokens": args.new_tokens, "results": results, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
