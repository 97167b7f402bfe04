"""EAGLE-1, EAGLE-3 and block drafters for SmolLM2-135M-Instruct: fresh, after a 10-CPU-minute warm-up, and trained.

    python benchmarks/bench_drafters.py                   # needs the cached answers of scripts/train_shipped_drafter.py
    python benchmarks/bench_drafters.py --kinds eagle3,block --block-drafter DIR   # EAGLE-3 vs a block drafter
    python benchmarks/bench_drafters.py --kinds '' --shipped eagle3 --eagle3-drafter DIR   # a new EAGLE-3 drafter

On held-out prompts (``--prompt-set seeds``: other reasoning-gym seeds and chat topics than training; ``families``:
reasoning-gym task families and chat topics no shipped data holds), greedy and at temperature 1.0,
batch 1 and 4, TLT's engine with a 4-token chain every step (``speculation="always"``; a block drafter drafts its
whole block, ``block:K`` with K = block_size - 1): acceptance length (tokens per policy forward), first-draft
acceptance, and speculative/plain tokens per second, plain decoding measured in the same loop (engines alternate in
order between repetitions).

Acceptance here is what a user's engine sees, but over a few hundred verify steps; the repetitions inside one process
agree to the last digit, yet the same drafter measured in another process can differ by several hundredths (a
matmul's last bits move one step boundary, and every later step moves with it). To tell two drafters of one lineage
apart, score them offline on the same positions: ``benchmarks/bench_drafters_offline.py``.

The warm-ups train from scratch on the policy's cached answers (the shipped drafter's data) for ``--warmup-minutes``
of one CPU core each (``torch.set_num_threads(1)``, the two architectures side by side in two processes), after one
feature pass over ``--warmup-answers`` answers; they are cached under ``TLT_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch
from common import cache_root, write_results

from tlt_trainers import (
    BlockDrafter,
    Drafter,
    DrafterTrainer,
    Eagle3Drafter,
    EagleDrafter,
    SpeculativeGenerator,
    TLTConfig,
)
from tlt_trainers.drafter.buffer import FeatureBuffer
from tlt_trainers.drafter.trainer import native_bf16
from tlt_trainers.pretrained import load_smollm2
from tlt_trainers.shipped import shipped_drafter_for
from tlt_trainers.shipped.prompts import PROMPT_SETS, evaluation_prompts

ANSWERS = "shipped-drafter/answers.pt"
KINDS = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter, "block": BlockDrafter}
ROW_NAMES = {"eagle": "eagle1", "eagle3": "eagle3", "block": "block"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per setting (batch 4: 2x as many)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (a chain)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup-minutes", type=float, default=10.0)
    p.add_argument("--warmup-answers", type=int, default=400)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--kinds", default="eagle,eagle3", help=f"drafters fresh and warmed up, of {sorted(KINDS)}")
    p.add_argument("--block-drafter", default=None, help="a trained block drafter (scripts/train_shipped_drafter.py "
                   "train --architecture block) measured beside the shipped EAGLE-3 one")
    p.add_argument("--eagle3-drafter", default=None, help="a trained EAGLE-3 drafter (scripts/train_shipped_drafter.py "
                   "train --out DIR) measured beside the shipped one: before and after a new training")
    p.add_argument("--shipped", default="eagle3,block", help="the shipped drafters measured, of eagle3 and block "
                   "('' for none)")
    p.add_argument("--prompt-set", default="seeds", choices=PROMPT_SETS, help="held out by seed and topic (the "
                   "20-task mix), or by task family (the broad mix's held-out families): evaluation_prompts")
    p.add_argument("--out", default="bench_drafters")
    return p.parse_args()


def answers() -> list[dict]:
    path = cache_root() / ANSWERS
    if not path.is_file():
        raise SystemExit(f"No cached answers at {path}: run `python scripts/train_shipped_drafter.py sample` first.")
    return torch.load(path)["sequences"]


def draft_vocab(model, sequences, size: int) -> torch.Tensor:
    counts = FeatureBuffer.counting(seq["tokens"] for seq in sequences)
    return counts.most_frequent(size, model.get_output_embeddings().weight.shape[0])


def fresh(kind: str, model, vocab: torch.Tensor) -> Drafter:
    torch.manual_seed(0)
    drafter = KINDS[kind].from_target(model, draft_vocab_size=len(vocab))
    drafter.set_draft_vocab(vocab)
    return drafter


def warm_up(kind: str, minutes: float, count: int, size: int, out: str) -> None:
    """One warm-up from scratch on one CPU core (run in its own process)."""
    torch.set_num_threads(1)
    model, _ = load_smollm2()
    sequences = answers()[:count]
    drafter = fresh(kind, model, draft_vocab(model, sequences, size))
    trainer = DrafterTrainer(drafter, model, lr=1e-3, unroll_steps=3, buffer_bytes=16 << 30, seed=0)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16(torch.device("cpu"))):
        trainer.add_token_rows([s["tokens"] for s in sequences], batch_rows=32, sort_by_length=False)
    feature_seconds = time.perf_counter() - start
    metrics = trainer.train(max_seconds=minutes * 60)
    drafter.save_pretrained(out)
    info = {"feature_seconds": feature_seconds, "answers": len(sequences),
            **{k: metrics[k] for k in ("steps", "tokens", "seconds", "loss", "top1", "top1_by_step")}}
    Path(out, "warmup.json").write_text(json.dumps(info, indent=2) + "\n")


def warmed(kinds: list[str], args) -> dict[str, Path]:
    folders = {k: cache_root() / "drafters" / f"bench-drafters-{k}-{args.warmup_minutes:g}min-{args.warmup_answers}"
               for k in kinds}
    todo = [k for k, f in folders.items() if not (f / "warmup.json").is_file()]
    if todo:
        print(f"warming up {todo} for {args.warmup_minutes:g} minutes on one core each")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=warm_up, args=(k, args.warmup_minutes, args.warmup_answers, args.draft_vocab,
                                                   str(folders[k]))) for k in todo]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a warm-up failed (exit {p.exitcode})")
    return folders


def run(engine: SpeculativeGenerator, tok, prompts: list[str], batch: int, temperature: float, args) -> dict:
    generated = forwards = emitted = drafted_rows = first = 0
    seconds = 0.0
    for start in range(0, len(prompts), batch):
        enc = tok(prompts[start : start + batch], return_tensors="pt", padding=True, padding_side="left")
        result = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=args.new_tokens,
                                 do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 generator=torch.Generator().manual_seed(start))
        s = result.stats
        generated += s.generated_tokens
        seconds += s.total_seconds
        forwards += s.row_forwards
        emitted += s.generated_tokens_in_steps
        drafted_rows += s.drafted_rows
        first += s.first_accepted
    return {"tokens_per_second": generated / seconds, "generated_tokens": generated, "seconds": seconds,
            "acceptance_length": emitted / forwards if forwards else float("nan"),
            "first_draft_acceptance": first / drafted_rows if drafted_rows else float("nan")}


def main() -> None:
    args = parse_args()
    model, tok = load_smollm2()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds {unknown}: choose from {sorted(KINDS)}")
    drafters: dict[str, tuple[Drafter, str]] = {}
    folders = {}
    if kinds:  # fresh and warmed-up drafters need the policy's cached answers; the shipped ones do not
        vocab = draft_vocab(model, answers()[: args.warmup_answers], args.draft_vocab)
        folders = warmed(kinds, args)
        drafters = {f"{ROW_NAMES[k]} fresh": (fresh(k, model, vocab), f"{KINDS[k].__name__}.from_target, draft "
                                                                      "vocabulary from the answers") for k in kinds}
    for kind, folder in folders.items():
        drafters[f"{ROW_NAMES[kind]} {args.warmup_minutes:g}-min"] = (Drafter.from_pretrained(folder, target=model),
                                                                       str(folder))
    shipped_kinds = [k.strip() for k in args.shipped.split(",") if k.strip()]
    if set(shipped_kinds) - {"eagle3", "block"}:
        raise SystemExit(f"--shipped {args.shipped!r}: choose from eagle3 and block")
    for architecture in shipped_kinds:
        shipped = shipped_drafter_for(model, architecture)
        if shipped is not None:
            drafters[f"{architecture} shipped"] = (Drafter.from_pretrained(shipped, target=model), str(shipped))
    if args.block_drafter:
        drafters["block trained"] = (Drafter.from_pretrained(args.block_drafter, target=model), args.block_drafter)
    if args.eagle3_drafter:
        drafters["eagle3 trained"] = (Drafter.from_pretrained(args.eagle3_drafter, target=model), args.eagle3_drafter)
    if not drafters:
        raise SystemExit("No drafter to measure: name --kinds, --shipped, --block-drafter or --eagle3-drafter.")

    def chain(drafter: Drafter) -> int:
        return drafter.max_drafts if drafter.drafts_blocks else args.k

    engines = {"plain": SpeculativeGenerator(model, None, TLTConfig(speculation="never"))}
    engines |= {name: SpeculativeGenerator(model, d, TLTConfig(speculation="always", num_speculative_tokens=chain(d)))
                for name, (d, _) in drafters.items()}
    prompts = evaluation_prompts(tok, 2 * args.prompts, args.prompt_set)

    raw: dict[str, list[dict]] = {}
    names = list(engines)
    with torch.no_grad():
        for rep in range(args.reps):
            for temperature in (0.0, 1.0):
                for batch in (1, 4):
                    chosen = prompts[: args.prompts] if batch == 1 else prompts
                    order = names[rep % len(names):] + names[: rep % len(names)]
                    for name in order:
                        key = f"{name}|t{temperature:g}|b{batch}"
                        raw.setdefault(key, []).append(run(engines[name], tok, chosen, batch, temperature, args))
                        print(key, {k: round(v, 3) for k, v in raw[key][-1].items()}, flush=True)

    rows = []
    for name in names[1:]:
        for temperature in (0.0, 1.0):
            for batch in (1, 4):
                runs = raw[f"{name}|t{temperature:g}|b{batch}"]
                plain = raw[f"plain|t{temperature:g}|b{batch}"]
                ratios = [r["tokens_per_second"] / p["tokens_per_second"] for r, p in zip(runs, plain)]
                rows.append({
                    "drafter": name, "k": chain(drafters[name][0]), "temperature": temperature, "batch": batch,
                    "acceptance_length": statistics.mean(r["acceptance_length"] for r in runs),
                    "first_draft_acceptance": statistics.mean(r["first_draft_acceptance"] for r in runs),
                    "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                })
    header = ("| drafter | drafts | T | batch | acceptance length | first-draft acceptance | spec/plain tokens/s "
              "(range) |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['k']} | {r['temperature']:g} | {r['batch']} | "
                     f"{r['acceptance_length']:.2f} | "
                     f"{r['first_draft_acceptance']:.2f} | {r['speedup']:.2f} ({r['speedup_min']:.2f}-"
                     f"{r['speedup_max']:.2f}) |")
    print("\n".join(lines))
    warmups = {k: json.loads((f / "warmup.json").read_text()) for k, f in folders.items()}
    write_results(args.out, {
        "args": vars(args),
        "drafters": {name: source for name, (_, source) in drafters.items()}, "warmups": warmups,
        "rows": rows, "raw": raw, "table": "\n".join(lines),
    })


if __name__ == "__main__":
    main()
