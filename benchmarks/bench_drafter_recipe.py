"""The EAGLE-3 drafter's training recipe, one change at a time: acceptance on held-out prompts per recipe row.

    python benchmarks/bench_drafter_recipe.py                                   # every row, the defaults below
    python benchmarks/bench_drafter_recipe.py --rows "current,tv 1" --steps 40  # two rows, a shorter budget
    python benchmarks/bench_drafter_recipe.py --init fresh --train-tokens 400000 --steps 3000   # from scratch (GPU)

Each row starts from the same drafter (``--init``: the shipped SmolLM2-135M-Instruct drafter, or a fresh one) and
trains ``--steps`` micro-steps of ``--micro-batch`` sequences on the same features: the policy's own answers of
``data/smollm2-135m-instruct-answers`` (a seeded share of ``--train-tokens`` answer tokens, mixed across its
shards), whose policy forward runs once and is cached under ``TLT_CACHE_DIR``. A row changes one thing against
the current recipe (the shipped drafter's: training-time test over 3 steps, lr 1e-3 constant, 4096 draft tokens,
no feature noise, cross-entropy to the policy's top-16 law, one decoder layer), at the same number of micro-steps;
its seconds are recorded, since some changes cost more per step, and so is what its drafter costs when drafting (a
draft pass and a chain step over a plain step, the engine's timed cost table). The "2 layers" row stacks a second
decoder layer on the starting drafter (``Eagle3Drafter.stacked``: it starts as a pass-through).

Every row is then measured as ``benchmarks/bench_drafters.py`` measures a drafter: TLT's engine drafting a chain of
``--k`` at every step (``speculation="always"``), batch 4, greedy and at temperature 1, on its held-out prompts
(``--prompt-set``: other reasoning-gym seeds and chat topics, or held-out task families), ``--new-tokens`` each:
acceptance length (tokens per policy forward) and first-draft acceptance. Beside it, offline on the policy's own
answers to those prompts (the first row's, exact since the engine is lossless): top-1 agreement per draft step and
the sampled-acceptance chance sum min(p, q) per step (``DrafterTrainer.evaluate``). The draft-vocabulary rows also
give the share of the policy's answer tokens each vocabulary covers. Writes benchmarks/results/<--out>.json with the
table and the machine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from common import cache_root, print_table, write_results  # noqa: E402

from tlt_trainers import Drafter, DrafterTrainer, Eagle3Drafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.drafter.buffer import BufferedSequence, FeatureBuffer  # noqa: E402
from tlt_trainers.drafter.trainer import cosine_lr  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402
from tlt_trainers.shipped.answers import answer_share, iter_answers, read_manifest  # noqa: E402
from tlt_trainers.shipped.prompts import PROMPT_SETS, evaluation_prompts  # noqa: E402

DATA = ROOT / "data" / "smollm2-135m-instruct-answers"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a drafter trains: the current recipe is the shipped drafter's (scripts/train_shipped_drafter.py)."""

    unroll_steps: int = 3  # training-time test: chained draft steps per position
    draft_vocab: int = 4096
    lr: float = 1e-3
    lr_schedule: str = "constant"  # or "cosine": from lr down to a tenth over the row's steps
    feature_noise: float = 0.0  # Gaussian, relative to each feature's RMS
    tv_weight: float = 0.0  # total-variation term beside the cross-entropy (DrafterTrainer.tv_weight)
    data_share: float = 1.0  # of the row's training answers
    layers: int = 1  # decoder layers; more are stacked on the starting drafter (Eagle3Drafter.stacked)
    train: bool = True  # False: the starting drafter, measured as it is


# Each row changes one field of the current recipe
ROWS: dict[str, Recipe] = {
    "start (not trained)": Recipe(train=False),
    "current": Recipe(),
    "data: a quarter": Recipe(data_share=0.25),
    "TTT depth 5": Recipe(unroll_steps=5),
    "TTT depth 7": Recipe(unroll_steps=7),
    "draft vocab 8192": Recipe(draft_vocab=8192),
    "draft vocab 16384": Recipe(draft_vocab=16384),
    "feature noise 0.1": Recipe(feature_noise=0.1),
    "lr cosine": Recipe(lr_schedule="cosine"),
    "tv 1": Recipe(tv_weight=1.0),
    "2 layers": Recipe(layers=2),
    "lr 3e-4": Recipe(lr=3e-4),
}
DEFAULT_ROWS = [name for name in ROWS if name != "lr 3e-4"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {list(ROWS)}")
    p.add_argument("--init", choices=["shipped", "fresh"], default="shipped")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--train-tokens", type=int, default=60_000, help="answer tokens of the training share")
    p.add_argument("--steps", type=int, default=60, help="micro-steps per row")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (batch 4), bench_drafters' set")
    p.add_argument("--prompt-set", default="seeds", choices=PROMPT_SETS, help="held out by seed and topic, or by "
                   "task family (evaluation_prompts)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="drafts per step (a chain)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_drafter_recipe")
    p.add_argument("--update", action="store_true", help="replace these rows in --out's results (same machine, same "
                   "settings, the same first row), keeping its other rows")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------------- data
def features(trainer: DrafterTrainer, rows: list[torch.Tensor], label: str) -> list[BufferedSequence]:
    """One no-grad policy forward over ``rows`` (64 at a time, sorted by length): the buffered sequences, their
    features kept in bfloat16 (half the memory; batches are built in the policy's dtype)."""
    trainer.buffer = FeatureBuffer(1 << 40, max_tokens=1024, feature_dtype=torch.bfloat16)
    start = time.perf_counter()

    def on_batch(done: int, total: int) -> None:
        print(f"{label} features: {done}/{total} sequences, {time.perf_counter() - start:.0f}s", flush=True)

    trainer.add_token_rows([r[:1025] for r in rows], on_batch=on_batch)
    return list(trainer.buffer.sequences)


def answer_features(model, made: list[tuple[torch.Tensor, int]]) -> list[BufferedSequence]:
    """Features of the policy's answers to held-out prompts (``(ids, prompt length)``), scored on the answer only:
    the targets of prompt positions are zeroed, which the drafter's loss and agreement skip."""
    trainer = DrafterTrainer(Eagle3Drafter.from_target(model, draft_vocab_size=4096), model)
    trainer.buffer = FeatureBuffer(1 << 40, max_tokens=1 << 20)
    for ids, prompt_len in made:
        trainer.add_sequences(ids[None])
        seq = trainer.buffer.sequences[-1]
        # a draft made at position t is token t + 2; the engine drafts from the second answer token on
        seq.target_probs[: prompt_len - 1] = 0
    return list(trainer.buffer.sequences)


def cached_features(model, rows: list[torch.Tensor], key: str) -> list[BufferedSequence]:
    path = cache_root() / "drafter-recipe" / f"{key}.pt"
    if path.is_file():
        return [BufferedSequence(**item) for item in torch.load(path)]
    drafter = Eagle3Drafter.from_target(model, draft_vocab_size=4096)
    sequences = features(DrafterTrainer(drafter, model), rows, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([dataclasses.asdict(s) for s in sequences], path)
    return sequences


def coverage(vocab: torch.Tensor, answers: list[torch.Tensor], vocab_size: int) -> float:
    """Share of ``answers``' tokens inside ``vocab`` (the tokens a drafter over it can draft)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    tokens = torch.cat(answers)
    return float(inside[tokens].float().mean())


# ---------------------------------------------------------------------------------------------------- drafters
def starting_drafter(model, init: str, vocab: torch.Tensor) -> Eagle3Drafter:
    if init == "shipped":
        return Drafter.from_pretrained(shipped_drafter_for(model, "eagle3"), target=model).float()
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, draft_vocab_size=len(vocab))
    drafter.set_draft_vocab(vocab)
    return drafter


def train_row(recipe: Recipe, drafter: Eagle3Drafter, model, sequences: list[BufferedSequence], args) -> dict:
    trainer = DrafterTrainer(drafter, model, lr=recipe.lr, unroll_steps=recipe.unroll_steps,
                             micro_batch_size=args.micro_batch, seed=args.seed, feature_noise=recipe.feature_noise,
                             tv_weight=recipe.tv_weight)
    trainer.buffer = FeatureBuffer(1 << 40, max_tokens=1024)
    count = max(1, round(len(sequences) * recipe.data_share))
    # a seeded share of the conversations (the cached ones are sorted by length: a slice would be the shortest)
    trainer.buffer.sequences.extend(random.Random(args.seed).sample(sequences, count) if count < len(sequences)
                                    else sequences)
    done, seconds, top1 = 0, 0.0, []
    while done < args.steps:
        if recipe.lr_schedule == "cosine":
            fraction = done / args.steps
            for group in trainer.optimizer.param_groups:
                group["lr"] = cosine_lr(recipe.lr, fraction)
        metrics = trainer.train(max_steps=min(10, args.steps - done))
        done += metrics["steps"]
        seconds += metrics["seconds"]
        top1.append(metrics["top1"])
        print(f"  {done}/{args.steps} steps, {seconds:.0f}s, top-1 {metrics['top1']:.3f}", flush=True)
    return {"train_seconds": seconds, "train_top1_last": top1[-1],
            "train_tokens": sum(len(s.tokens) - 1 for s in trainer.buffer.sequences)}


# ---------------------------------------------------------------------------------------------------- measuring
def engine_acceptance(model, tok, drafter, prompts: list[str], temperature: float, args) -> tuple[dict, list]:
    """TLT's engine drafting a chain of ``args.k`` at every step, batch 4: acceptance and the sequences made."""
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=args.k))
    forwards = emitted = drafted = first = 0
    made = []
    for start in range(0, len(prompts), 4):
        enc = tok(prompts[start : start + 4], return_tensors="pt", padding=True, padding_side="left")
        result = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=args.new_tokens,
                                 do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 generator=torch.Generator().manual_seed(start))
        s = result.stats
        forwards, emitted = forwards + s.row_forwards, emitted + s.generated_tokens_in_steps
        drafted, first = drafted + s.drafted_rows, first + s.first_accepted
        made += answered(result.sequences, enc.attention_mask, tok.pad_token_id)
    return {"acceptance_length": emitted / forwards, "first_draft_acceptance": first / drafted}, made


def answered(sequences: torch.Tensor, attention_mask: torch.Tensor,
             pad_token_id: int) -> list[tuple[torch.Tensor, int]]:
    """Each row of a left-padded batch's ``sequences`` as ``(prompt + answer ids, prompt length)``, padding dropped."""
    width = attention_mask.shape[1]
    made = []
    for row, mask in zip(sequences, attention_mask):
        completion = row[width:]
        prompt = row[:width][mask.bool()]
        made.append((torch.cat([prompt, completion[completion != pad_token_id]]), len(prompt)))
    return made


def step_costs(model, drafter, args, context: int = 256) -> dict:
    """What the row's drafter costs: one draft pass, and a whole chain-of-``args.k`` step, over a plain step, at
    batch 1 and 4 (the engine's own timed cost table, fastest of three passes, ``context`` tokens cached)."""
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=args.k))
    profile = engine.profile(4, context)
    chain = engine.strategies[0]
    return {f"batch {b}": {"draft_pass_vs_plain": profile.drafter_seconds(b, 1) / profile.forward_seconds(b, 1),
                           "chain_step_vs_plain": profile.step_seconds(chain, b) / profile.forward_seconds(b, 1)}
            for b in (1, 4)}


def offline(trainer: DrafterTrainer, sequences: list[BufferedSequence]) -> dict:
    result = trainer.evaluate(sequences)
    return {"top1_by_step": result["top1_by_step"],
            "sampled_acceptance_by_step": result["sampled_acceptance_by_step"],
            "estimated_greedy": result["estimated_acceptance_length"],
            "estimated_sampled": result["estimated_sampled_acceptance_length"]}


SETTINGS = ("init", "data", "train_tokens", "steps", "micro_batch", "prompts", "prompt_set", "new_tokens", "k",
            "seed")


def previous_rows(args) -> tuple[list[dict], list[str]]:
    """``--update``: the rows of ``--out``'s results and the commands that made them, if they were measured on this
    CPU with these settings (rows of another machine or budget do not compare)."""
    from common import RESULTS, cpu_name

    path = RESULTS / f"{args.out}.json"
    if not path.is_file():
        return [], []
    old = json.loads(path.read_text())
    measured = {"prompt_set": "seeds"} | old["args"]  # results from before --prompt-set measured on "seeds"
    differ = [k for k in SETTINGS if measured.get(k) != getattr(args, k)]
    if old["machine"]["cpu"] != cpu_name() or differ:
        raise SystemExit(f"--update: {path} was measured on {old['machine']['cpu']} with other settings ({differ}); "
                         "measure all rows here, under another --out.")
    return old["rows"], old.get("commands") or [old["command"]]


def main() -> None:
    args = parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"--rows {unknown}: choose from {list(ROWS)}")
    model, tok = load_smollm2()
    vocab_size = model.get_output_embeddings().weight.shape[0]
    answers = list(iter_answers(args.data))
    rows = [torch.tensor(list(a.prompt_ids) + list(a.answer_ids), dtype=torch.long)
            for a in answer_share(answers, args.train_tokens, args.seed)]
    # draft vocabularies: the most frequent tokens of all the answers (the shipped drafter's own: of its data)
    counts = FeatureBuffer.counting(list(a.prompt_ids) + list(a.answer_ids) for a in answers)
    # the share depends on the whole folder (its shuffle): a folder with more shards makes another share
    sequences = cached_features(model, rows, f"train-{args.train_tokens}-seed{args.seed}-of{len(answers)}")
    print(f"training share: {len(sequences)} conversations, {args.train_tokens}+ answer tokens", flush=True)
    prompts = evaluation_prompts(tok, args.prompts, args.prompt_set)
    start_vocab = starting_drafter(model, args.init, counts.most_frequent(4096, vocab_size))
    held_out: dict[float, list[BufferedSequence]] = {}
    results, commands = [], []
    if args.update:
        results, commands = previous_rows(args)
        if results and names[0] != results[0]["row"]:
            raise SystemExit(f"--update: measure {results[0]['row']!r} first, as the first run did: its answers to "
                             "the held-out prompts are what every row is scored on offline.")
    commands.append("python " + shlex.join(sys.argv))
    for name in names:
        recipe = ROWS[name]
        vocab = counts.most_frequent(recipe.draft_vocab, vocab_size)
        drafter = copy.deepcopy(start_vocab)
        if recipe.draft_vocab != drafter.draft_vocab_size:
            drafter = drafter.with_draft_vocab(vocab)
        if recipe.layers > drafter.config.num_hidden_layers:  # the new layers start as a pass-through
            drafter = drafter.stacked(recipe.layers)
        print(f"[{name}] {recipe}", flush=True)
        row = {"row": name, "recipe": dataclasses.asdict(recipe), "steps": args.steps if recipe.train else 0}
        if recipe.train:
            row |= train_row(recipe, drafter, model, sequences, args)
        drafter.eval()
        with torch.no_grad():
            for temperature in (0.0, 1.0):
                measured, made = engine_acceptance(model, tok, drafter, prompts, temperature, args)
                if temperature not in held_out:  # the policy's own answers to the held-out prompts
                    held_out[temperature] = answer_features(model, made)
                evaluator = DrafterTrainer(drafter, model, unroll_steps=args.k, micro_batch_size=args.micro_batch)
                label = "greedy" if temperature == 0 else f"T{temperature:g}"
                row[label] = measured | offline(evaluator, held_out[temperature])
            row["step_cost"] = step_costs(model, drafter, args)
        answer_ids = [s.tokens[(s.target_probs.sum(-1) == 0).sum() + 1 :] for seqs in held_out.values() for s in seqs]
        row["vocab_coverage_held_out"] = coverage(drafter.d2t, answer_ids, vocab_size)
        results = [r for r in results if r["row"] != name] + [row]
        results.sort(key=lambda r: list(ROWS).index(r["row"]))
        write_results(args.out, {"args": vars(args), "rows": results, "partial": True, "commands": commands})
        greedy, sampled = row["greedy"], row["T1"]
        print(f"[{name}] greedy {greedy['acceptance_length']:.2f} (first {greedy['first_draft_acceptance']:.2f}, "
              f"offline {greedy['estimated_greedy']:.2f}), T=1 {sampled['acceptance_length']:.2f} (first "
              f"{sampled['first_draft_acceptance']:.2f}, offline {sampled['estimated_sampled']:.2f})", flush=True)
    headers = ["row", "greedy: accepted/verify", "greedy: first draft", "T=1: accepted/verify", "T=1: first draft",
               "offline greedy", "offline T=1", "train s", "vocab coverage", "draft pass / plain step (b1)"]
    table = print_table(headers, [[r["row"], r["greedy"]["acceptance_length"], r["greedy"]["first_draft_acceptance"],
                                   r["T1"]["acceptance_length"], r["T1"]["first_draft_acceptance"],
                                   r["greedy"]["estimated_greedy"], r["T1"]["estimated_sampled"],
                                   round(r.get("train_seconds", 0.0)), r["vocab_coverage_held_out"],
                                   r["step_cost"]["batch 1"]["draft_pass_vs_plain"] if "step_cost" in r else "-"]
                                  for r in results])
    path = write_results(args.out, {"args": vars(args), "data": read_manifest(args.data)["command"],
                                    "rows": results, "table": table, "partial": False, "commands": commands})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
