"""Bytes the rollout engine holds between generate() calls, kept (main before issue 52) and given back (now).

    python benchmarks/bench_engine_memory.py                      # SmolLM2-135M-Instruct, shipped EAGLE-3 drafter
    python benchmarks/bench_engine_memory.py --batches 8 --out bench_engine_memory_quick

``SpeculativeGenerator`` keeps a graph session across calls (``tlt_trainers.rollout.memory``): the policy's and the
drafter's KV caches, the rows' buffers (the features the drafter reads among them), the graphs' static inputs and,
on CUDA, their float32 logits outputs and memory pools. Measured part, on this CPU: SmolLM2-135M-Instruct (float32)
with the shipped EAGLE-3 drafter, ``chain:4`` and ``cuda_graphs="static"`` (the static-buffer path a capture
records: the same session, kept the same way, without capturing), at batch 8 and 64. Per batch, one ``generate()``
call, then a training step on the rollout (policy forward and backward over one micro-batch of its rows, the step's
memory live) twice: with the session kept (``keep_engine_memory=True``, and what every trainer did before this
change) and after :func:`~tlt_trainers.rollout.memory.give_back` (what TLTGRPOTrainer and veRL's servers now do after
each rollout). Reported: the session's bytes (distinct tensor storages it reaches, weights excluded) after
``generate()`` and during each step, by part, and whether the session object was still alive in the step (freed, not
merely unreferenced by the engine). The process's resident memory is not reported: the CPU allocator reuses freed
blocks for the step, so it does not show the difference (on CUDA, ``give_back`` reports the allocator's counters).

Computed part (not measured): the session's formula (``session_bytes_formula``) for policies shaped like
Qwen2.5-1.5B and Qwen2.5-7B in bfloat16 with an EAGLE-3 drafter of one layer, at 64 rows and 2048 / 4096 slots, pass
graphs captured at every batch bucket up to 64 for plain decoding and ``chain:4`` (1 and 5 tokens per row). The
graphs' private pools hold more than the lower bound given (their intermediates show only in CUDA's allocator).
"""

from __future__ import annotations

import argparse
import time
import weakref

import torch
from common import print_table, write_results

from tlt_trainers import Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.pretrained import load_smollm2
from tlt_trainers.rollout.memory import (
    SessionShape,
    gib,
    give_back,
    held_breakdown,
    session_bytes_formula,
)
from tlt_trainers.shipped import shipped_drafter_for
from tlt_trainers.shipped.prompts import EVAL_CHAT_TOPICS, prompt_mix

# Qwen2.5 configs (config.json of Qwen/Qwen2.5-1.5B-Instruct and Qwen/Qwen2.5-7B-Instruct)
GPU_SHAPES = {
    "Qwen2.5-1.5B": SessionShape(layers=28, kv_heads=2, head_dim=128, hidden=1536, vocab=151936),
    "Qwen2.5-7B": SessionShape(layers=28, kv_heads=4, head_dim=128, hidden=3584, vocab=152064),
}
GPU_ROWS = 64
GPU_CAPACITIES = (2048, 4096)
MIB = 2**20


def training_step(model, sequences: torch.Tensor, pad_id: int, rows: int, probe) -> dict:
    """A policy step on ``rows`` rows of the rollout: forward, loss, backward; ``probe()`` reads the memory while
    the step's activations and gradients are live (after the backward, where an optimizer step would follow)."""
    model.train()
    batch = sequences[:rows]
    mask = (batch != pad_id).long()
    out = model(input_ids=batch, attention_mask=mask, labels=batch.masked_fill(mask == 0, -100))
    out.loss.backward()
    seen = probe()
    model.zero_grad(set_to_none=True)
    model.eval()
    return seen


def measure(model, drafter, tok, batch: int, new_tokens: int, step_rows: int) -> dict:
    prompts = prompt_mix(tok, batch, seed=7, topics=EVAL_CHAT_TOPICS)
    enc = tok(prompts, return_tensors="pt", padding=True)
    config = TLTConfig(speculation="always", strategy="chain:4", cuda_graphs="static", show_progress=False)
    engine = SpeculativeGenerator(model, drafter, config)
    start = time.perf_counter()
    result = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_k=0, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    session = engine._graph_session
    capacity, bucket = session.capacity, session.max_batch
    after_generate = held_breakdown(engine)
    alive = weakref.ref(session)
    del session

    def probe() -> dict:
        return {"held": engine.held_bytes(), "session_alive": alive() is not None}

    kept = training_step(model, result.sequences, tok.pad_token_id, step_rows, probe)
    release = give_back(engine)
    given_back = training_step(model, result.sequences, tok.pad_token_id, step_rows, probe)
    return {"batch": batch, "prompt_tokens": enc.input_ids.shape[1], "new_tokens": new_tokens,
            "capacity": capacity, "rows": bucket, "generate_seconds": seconds,
            "after_generate": after_generate, "held_after_generate": sum(after_generate.values()),
            "kept_step": kept, "given_back_step": given_back,
            "release": {"held_bytes": release.held_bytes, "session_freed": release.session_freed,
                        "collected": release.collected}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,64")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--step-rows", type=int, default=2, help="rows of the rollout in the emulated training step")
    p.add_argument("--out", default="bench_engine_memory")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = load_smollm2()
    drafter = Drafter.from_pretrained(shipped_drafter_for(model, "eagle3"), target=model)

    measured, rows = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        m = measure(model, drafter, tok, batch, args.new_tokens, args.step_rows)
        measured.append(m)
        parts = m["after_generate"]
        for arm, step in (("kept (before)", m["kept_step"]), ("given back (after)", m["given_back_step"])):
            rows.append([batch, arm, f"{m['held_after_generate'] / MIB:.1f}", f"{step['held'] / MIB:.1f}",
                         "yes" if step["session_alive"] else "no",
                         f"{parts.get('policy KV cache', 0) / MIB:.1f}",
                         f"{parts.get('drafter KV cache', 0) / MIB:.1f}",
                         f"{parts.get(next(k for k in parts if k.startswith('rows')), 0) / MIB:.1f}",
                         f"{m['generate_seconds']:.1f}"])
        print(f"batch {batch}: {m['after_generate']}", flush=True)
    table = print_table(["batch", "engine memory", "MiB held after generate()", "MiB held during the step",
                         "session alive in the step", "policy KV MiB", "drafter KV MiB",
                         "rows' buffers MiB", "generate s"], rows)

    computed, gpu_rows = [], []
    for name, shape in GPU_SHAPES.items():
        for capacity in GPU_CAPACITIES:
            c = session_bytes_formula(shape, rows=GPU_ROWS, capacity=capacity)
            computed.append({"model": name, "rows": GPU_ROWS, "capacity": capacity, "dtype": "bfloat16",
                             "parts": c.parts, "tensors": c.tensors})
            gpu_rows.append([name, GPU_ROWS, capacity, gib(c.policy_kv), gib(c.drafter_kv), gib(c.features),
                             gib(c.logits_outputs), gib(c.features_outputs + c.masks), gib(c.tensors),
                             gib(c.pool_lower_bound), "0"])
    print()
    gpu_table = print_table(["GPU shape (computed, bf16)", "rows", "slots", "policy KV GiB", "drafter KV GiB",
                             "features GiB", "logits outputs GiB", "other outputs+masks GiB",
                             "held kept (before) GiB", "+ pools >= GiB", "held given back (after) GiB"], gpu_rows)
    both = (f"{table}\n\nComputed, not measured: the session's formula at GPU shapes (bfloat16, EAGLE-3 drafter, "
            f"{GPU_ROWS} rows, pass graphs at every bucket for 1 and 5 tokens per row):\n\n{gpu_table}")
    path = write_results(args.out, {"new_tokens": args.new_tokens, "step_rows": args.step_rows,
                                    "measured": measured, "computed_gpu": computed, "table": both})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
