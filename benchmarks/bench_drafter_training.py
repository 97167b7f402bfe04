"""Drafter training throughput: tokens trained per second by DrafterTrainer, per training setting, in lockstep.

    python benchmarks/bench_drafter_training.py                    # 24 micro-steps x 3 reps per setting
    python benchmarks/bench_drafter_training.py --steps 4 --reps 1 --prompts 16     # smoke
    python benchmarks/bench_drafter_training.py --settings "eagle3 float32 padded,eagle3 float32 packed" \
        --name bench_drafter_training_packed                        # packing alone, on a CPU without bf16

The buffers hold the real SmolLM2-135M-Instruct's own sampled answers (reasoning-gym gsm_symbolic, "Think step by
step", temperature 1.0, up to ``--max-new-tokens``), added with one no-grad policy forward: EAGLE-1 buffers keep the
final hidden states, EAGLE-3 buffers the three fused layers and the policy's top-16 next-token law (computed once
per sequence). Each setting gets its own DrafterTrainer over the same drafter initialisation of its architecture and
the same buffer; the settings take turns within every rep (order rotating), each running ``--steps`` micro-steps on
the same micro-batches, so their ratios come from the same minutes of this noisy CPU. "packed" lays each
micro-batch's sequences end to end instead of padding them to the longest (on a CPU its attention is a per-sequence
torch loop; on CUDA flash-attn's varlen kernel). Reported: trained tokens (real
positions in the micro-batches) per second, the median over reps, and the ratio to the first setting. Writes
benchmarks/results/<--name>.json (default bench_drafter_training).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import completion_mask, math_prompts, print_table, write_results  # noqa: E402

# name -> (architecture, DrafterTrainer keyword arguments; the trainer's defaults otherwise)
SETTINGS = {
    "eagle1 float32": ("eagle", {"precision": "float32"}),
    "eagle1 bf16": ("eagle", {"precision": "bfloat16"}),
    "eagle3 bf16 dense loss": ("eagle3", {"precision": "bfloat16", "loss_chunk_size": 0, "attention": "padded"}),
    "eagle3 bf16 chunked loss": ("eagle3", {"precision": "bfloat16", "attention": "padded"}),
    "eagle3 bf16 chunked loss packed": ("eagle3", {"precision": "bfloat16", "attention": "packed"}),
    # the same pair in float32, for CPUs without native bfloat16 (emulated bfloat16 is many times slower there)
    "eagle3 float32 padded": ("eagle3", {"precision": "float32", "attention": "padded"}),
    "eagle3 float32 packed": ("eagle3", {"precision": "float32", "attention": "packed"}),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--steps", type=int, default=24, help="micro-steps per setting per rep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--unroll-steps", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--name", default="bench_drafter_training", help="results file name under benchmarks/results")
    return p.parse_args()


def sample_answers(model, tok, prompts: list[str], max_new_tokens: int) -> tuple[list, int]:
    """(input_ids, attention_mask) batches of prompt + answer, and the answer tokens sampled."""
    from tlt_trainers import SpeculativeGenerator, TLTConfig

    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    tokens, batches = 0, []
    for offset in range(0, len(prompts), 32):
        enc = tok(prompts[offset: offset + 32], return_tensors="pt", padding=True)
        result = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(offset))
        mask = torch.cat([enc.attention_mask, completion_mask(result.sequences, enc.input_ids.shape[1],
                                                              tok.pad_token_id, tok.eos_token_id)], dim=1)
        batches.append((result.sequences, mask))
        tokens += int(mask[:, enc.input_ids.shape[1]:].sum())
    return batches, tokens


def main() -> None:
    args = parse_args()
    from tlt_trainers import Eagle3Drafter, EagleDrafter
    from tlt_trainers.drafter.trainer import DrafterTrainer
    from tlt_trainers.pretrained import load_smollm2

    model, tok = load_smollm2()
    names = [n for n in args.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"Unknown settings {unknown}; known: {list(SETTINGS)}")
    prompts = math_prompts(tok, args.prompts, seed=3, dataset="gsm_symbolic")
    start = time.perf_counter()
    batches, answer_tokens = sample_answers(model, tok, prompts, args.max_new_tokens)
    print(f"sampled {answer_tokens} answer tokens from {len(prompts)} prompts in {time.perf_counter() - start:.0f} s",
          flush=True)
    kinds = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter}
    drafters, buffers, trainers = {}, {}, {}
    for name in names:
        kind, kwargs = SETTINGS[name]
        if kind not in drafters:
            torch.manual_seed(0)
            drafters[kind] = kinds[kind].from_target(model, draft_vocab_size=args.draft_vocab or None)
        trainer = DrafterTrainer(copy.deepcopy(drafters[kind]), model, micro_batch_size=args.micro_batch_size,
                                 unroll_steps=args.unroll_steps, **kwargs)
        if kind not in buffers:  # one buffer per architecture, filled once
            for ids, mask in batches:
                trainer.add_sequences(ids, mask)
            buffers[kind] = trainer.buffer
        trainer.buffer = buffers[kind]
        trainer.rebuild_draft_vocab()  # the same draft vocabulary for every setting
        trainers[name] = trainer
    first = trainers[names[0]]
    raw = []
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            trainer = trainers[name]
            trainer.generator.manual_seed(rep)  # the same micro-batches for every setting in this rep
            result = trainer.train(max_steps=args.steps)
            raw.append({"rep": rep, "setting": name, "seconds": result["seconds"], "tokens": result["tokens"],
                        "steps": result["steps"], "loss": result["loss"], "top1": result["top1"]})
            print(f"rep {rep} {name}: {result['tokens'] / result['seconds']:.0f} tokens/s, loss {result['loss']:.3f}",
                  flush=True)
    rows = []
    base = {rep: next(r for r in raw if r["rep"] == rep and r["setting"] == names[0]) for rep in range(args.reps)}
    for name in names:
        mine = [r for r in raw if r["setting"] == name]
        rates = [r["tokens"] / r["seconds"] for r in mine]
        ratios = [(r["tokens"] / r["seconds"]) / (base[r["rep"]]["tokens"] / base[r["rep"]]["seconds"]) for r in mine]
        rows.append([name, f"{statistics.median(rates):.0f}", f"{min(rates):.0f}-{max(rates):.0f}",
                     f"{statistics.median(ratios):.3f}",
                     f"{statistics.median(r['seconds'] / r['steps'] for r in mine):.2f}",
                     f"{statistics.mean(r['loss'] for r in mine):.3f}"])
    print(f"SmolLM2-135M-Instruct drafter, draft vocabulary {args.draft_vocab}, micro-batch {args.micro_batch_size}, "
          f"unroll {args.unroll_steps}, {args.steps} micro-steps x {args.reps} reps, {len(first.buffer)} buffered "
          f"answers ({answer_tokens} answer tokens), torch threads {torch.get_num_threads()}:")
    table = print_table(["setting", "tokens/s (median)", "range", f"vs {names[0]}", "s/step", "mean loss"], rows)
    write_results(args.name, {"settings": vars(args), "raw": raw, "table": table,
                                             "trainer_settings": {n: SETTINGS[n] for n in names}})


if __name__ == "__main__":
    main()
