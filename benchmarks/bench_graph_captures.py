"""Graph shapes prepared per GRPO-like step, and graphs held, over successive generate() calls of one engine.

    python benchmarks/bench_graph_captures.py                    # tiny random Llama, default adaptive engine
    python benchmarks/bench_graph_captures.py --out bench_graph_captures_before

RL trainers call ``generate()`` once per training step on the same engine, and veRL changes ``max_new_tokens`` from
batch to batch; a sampling temperature may change too. Every CUDA graph the engine captures costs a capture (tens
of milliseconds and graph-pool memory on a GPU), so a step that changes only values should capture nothing new.
This runs the default adaptive engine (EAGLE drafter, rollout history) in ``cuda_graphs="static"`` (the static-buffer
path a capture records; on a CPU a "capture" is its first trace, counted the same way) over successive calls with
varying ``max_new_tokens`` and temperature, and reports per call the graph shapes prepared (policy-pass graphs and
whole-step graphs), the graphs held after it, and whether the engine kept its graph session. Model: a random Llama
built from a config (hidden 64, 2 layers, vocabulary 128), 8 prompts as 4 groups of 2; the drafter is untrained (the
selector's exploration decides which strategies run, so the counts are those of an engine choosing among all of
them).
"""

from __future__ import annotations

import argparse

import torch
from common import print_table, write_results
from transformers import AutoModelForCausalLM, LlamaConfig

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig

PAD, EOS = 0, 1


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096, pad_token_id=PAD,
                         eos_token_id=EOS, bos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # sharper next-token laws: drafts are sometimes accepted
    model.generation_config.pad_token_id = PAD
    return model


def group_prompts(groups: int, per_group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 16, (groups,), generator=gen).tolist()
    width = max(lengths)
    rows = []
    for length in lengths:
        prompt = torch.randint(3, 128, (length,), generator=gen)
        rows += [torch.cat([torch.full((width - length,), PAD), prompt])] * per_group
    ids = torch.stack(rows)
    return ids, (ids != PAD).long()


def held(rollout) -> int:
    """Graphs the engine's session holds (policy-pass graphs and whole-step graphs)."""
    return sum(len(getattr(r, name)) for r, name in ((rollout.graphs, "graphs"), (rollout.step_graphs, "entries"))
               if r is not None)


def keys(rollout) -> set:
    """The keys of the graphs held: ("pass", bucket, tokens per row[, KV span]) and ("step", bucket, ...)."""
    held = {("pass", *k) for k in (rollout.graphs.graphs if rollout.graphs is not None else {})}
    return held | {("step", *k[:-1]) for k in (rollout.step_graphs.entries if rollout.step_graphs is not None else {})}


def prepared(rollout) -> int:
    return sum(r.shapes_prepared for r in (rollout.graphs, rollout.step_graphs) if r is not None)


def staggered_eos(model, ids, mask, new_tokens: int) -> int:
    """A token that ends the rows of a greedy rollout at as many different steps as possible: a long tail, so that
    calls run at several batch buckets as rows finish."""
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=PAD,
                          eos_token_id=None)[:, ids.shape[1]:]

    def spread(token: int) -> int:
        hits = free == token
        return len(set(torch.where(hits.any(1), hits.to(torch.int64).argmax(1), new_tokens).tolist()))

    return max(range(3, model.config.vocab_size), key=spread)


ARMS = {  # name -> TLTConfig settings besides cuda_graphs
    "adaptive": {},
    "chain:4": {"speculation": "always", "strategy": "chain:4"},
    "tree:6x4:16": {"speculation": "always", "strategy": "tree:6x4:16"},
    "history:8": {"speculation": "always", "strategy": "history:8"},
}


def run_arm(name: str, settings: dict, model, drafter, new_tokens: list[int], temperatures: list[float],
            eos: int, min_speedup: float, exploration: float) -> list[dict]:
    """Successive calls of one engine; per call the shapes prepared, graphs held and whether the session stayed."""
    config = TLTConfig(cuda_graphs="static", cost_cache="off", min_speedup=min_speedup, exploration=exploration,
                       **settings)
    engine = SpeculativeGenerator(model, None if name.startswith("history") else drafter, config)
    rows, session = [], None
    for step, (n, temperature) in enumerate(zip(new_tokens, temperatures, strict=True)):
        ids, mask = group_prompts(4, 2, seed=step)
        rollout = engine.start(ids, attention_mask=mask, max_new_tokens=n, do_sample=True, temperature=temperature,
                               top_k=0, eos_token_id=eos, pad_token_id=PAD,
                               generator=torch.Generator().manual_seed(step))
        kept = session is not None and rollout.session is session
        session = rollout.session
        before, known = prepared(rollout), keys(rollout)
        result = rollout.run()
        rows.append({"arm": name, "step": step + 1, "max_new_tokens": n, "temperature": temperature,
                     "new_keys": sorted(repr(k) for k in keys(rollout) - known),
                     "shapes_prepared": prepared(rollout) - before, "graphs_held": held(rollout),
                     "session_kept": kept, "engine_steps": len(result.stats.trace),
                     "batch_sizes": sorted({r.batch_size for r in result.stats.trace}),
                     "strategies": sorted({r.strategy for r in result.stats.trace})})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", default="48,64,40", help="max_new_tokens of the successive calls")
    parser.add_argument("--temperatures", default="1.0,0.7,1.3", help="temperature of the successive calls")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"engines to run, of {', '.join(ARMS)}")
    parser.add_argument("--min-speedup", type=float, default=1.0,
                        help="TLTConfig.min_speedup of the adaptive arm (1: speculate at any expected gain)")
    parser.add_argument("--exploration", type=float, default=1.0, help="TLTConfig.exploration (the selector's)")
    parser.add_argument("--out", default="bench_graph_captures")
    args = parser.parse_args()
    new_tokens = [int(v) for v in args.new_tokens.split(",")]
    temperatures = [float(v) for v in args.temperatures.split(",")]
    model = tiny_llama()
    torch.manual_seed(1)
    drafter = EagleDrafter.from_target(model)
    ids, mask = group_prompts(4, 2, seed=0)
    eos = staggered_eos(model, ids, mask, max(new_tokens))
    rows = []
    for name in args.arms.split(","):
        rows += run_arm(name, ARMS[name], model, drafter, new_tokens, temperatures, eos, args.min_speedup,
                        args.exploration)
    print_table(["engine", "call", "max_new_tokens", "temperature", "shapes prepared", "graphs held",
                 "session kept", "batch sizes", "strategies"],
                [[r["arm"], r["step"], r["max_new_tokens"], r["temperature"], r["shapes_prepared"], r["graphs_held"],
                  r["session_kept"], ",".join(map(str, r["batch_sizes"])), " ".join(r["strategies"])] for r in rows])
    print("wrote", write_results(args.out, {"model": "random Llama, hidden 64, 2 layers, vocab 128",
                                            "batch": "4 groups x 2", "eos": eos, "rows": rows}))


if __name__ == "__main__":
    main()
