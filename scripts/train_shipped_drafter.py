"""Train the drafter shipped for SmolLM2-135M-Instruct: the policy's own answers, an EAGLE-3 drafter, a model card.

    python scripts/train_shipped_drafter.py sample --prompts 2400      # the policy's answers, with vLLM (plain)
    python scripts/train_shipped_drafter.py train --minutes 40          # EAGLE-3 on them; writes the shipped folder
    python scripts/train_shipped_drafter.py train --architecture block --minutes 120   # a block drafter (DFlash)
    python scripts/train_shipped_drafter.py train --architecture block --minutes 60 --resume   # 60 minutes more
    python scripts/train_shipped_drafter.py finish                      # (again) bf16 weights and fingerprint
    python benchmarks/bench_drafters.py --kinds '' --prompts 8 --reps 2 --out NAME   # measure it (on each machine)
    python scripts/train_shipped_drafter.py card --results benchmarks/results/NAME.json ...   # the card, from those

Data: the embedded policy's sampled answers (temperatures 0.6, 0.8, 1.0, and greedy) to reasoning-gym questions of
20 tasks with two instructions ("think step by step", "only the final answer"), plus general chat requests built
from templates; held-out prompts (other seeds) are for evaluation (benchmarks/bench_drafters.py). The answers are
sampled once and cached (``TLT_CACHE_DIR``/shipped-drafter/answers.pt); training takes the policy's features and
top-k next-token law from one no-grad forward per sequence, then trains for a wall-clock budget. A block drafter
trains into the cache (``TLT_CACHE_DIR``/shipped-drafter/block) unless ``--out`` says otherwise: it ships (a folder
under ``tlt_trainers/shipped/``) only once ``benchmarks/bench_drafters.py`` shows it beating the EAGLE-3 one. The
trainer's checkpoint is saved at every report (``--out``/checkpoint), and ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SHIPPED = ROOT / "tlt_trainers" / "shipped" / "smollm2-135m-instruct-eagle3"
POLICY = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    from common import cache_root

    path = cache_root() / "shipped-drafter"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sample(args) -> None:
    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    from vllm import LLM, SamplingParams

    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.shipped.prompts import TEMPERATURES, prompt_mix

    _, tokenizer = load_smollm2()
    prompts = prompt_mix(tokenizer, args.prompts, seed=args.seed)
    llm = LLM(str(smollm2_hf_dir()), dtype="float32", enforce_eager=True, max_model_len=1024, seed=args.seed,
              distributed_executor_backend="uni", max_num_seqs=128)
    temperatures = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(len(prompts))]
    # One engine seed (vLLM's CPU sampler refuses per-request seeds)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=t) for t in temperatures]
    sequences, start, answer_tokens = [], time.perf_counter(), 0
    for out, temperature in zip(llm.generate(prompts, params), temperatures):
        completion = list(out.outputs[0].token_ids)
        answer_tokens += len(completion)
        sequences.append({"tokens": torch.tensor(list(out.prompt_token_ids) + completion, dtype=torch.int32),
                          "prompt_len": len(out.prompt_token_ids), "temperature": temperature})
    seconds = time.perf_counter() - start
    path = cache_dir() / "answers.pt"
    torch.save({"sequences": sequences, "prompts": args.prompts, "seed": args.seed, "max_tokens": args.max_tokens,
                "answer_tokens": answer_tokens, "seconds": seconds}, path)
    print(f"{len(sequences)} answers, {answer_tokens} answer tokens in {seconds:.0f}s -> {path}")


def load_answers(directory: str | None, answer_tokens: int | None = None, seed: int = 0) -> dict:
    """``{"sequences", "answer_tokens", "command"}``: the answers of a repository data folder, or the sample
    command's cache (``directory`` None); ``answer_tokens``: a seeded share of whole answers, mixed across shards,
    of at least that many answer tokens (the policy forward over all of them is the long part on a CPU)."""
    if directory is None:
        data = torch.load(cache_dir() / "answers.pt")
        return {**data, "command": f"python scripts/train_shipped_drafter.py sample --prompts {data['prompts']}"}
    from tlt_trainers.shipped.answers import answer_share, iter_answers, read_manifest

    answers = list(iter_answers(directory))
    if answer_tokens is not None:
        answers = answer_share(answers, answer_tokens, seed)
    sequences = [{"tokens": torch.tensor(list(a.prompt_ids) + list(a.answer_ids), dtype=torch.int32),
                  "prompt_len": len(a.prompt_ids), "temperature": a.temperature} for a in answers]
    return {"sequences": sequences, "answer_tokens": sum(len(s["tokens"]) - s["prompt_len"] for s in sequences),
            "command": read_manifest(directory)["command"]}


def new_drafter(args, model):
    from tlt_trainers import BlockDrafter, Eagle3Drafter

    if args.architecture == "block":
        return BlockDrafter.from_target(model, block_size=args.block_size, num_hidden_layers=args.layers,
                                        draft_vocab_size=args.draft_vocab)
    return Eagle3Drafter.from_target(model, draft_vocab_size=args.draft_vocab, num_hidden_layers=args.layers)


def output_dir(args) -> Path:
    if args.out:
        return Path(args.out)
    return cache_dir() / "block" if args.architecture == "block" else SHIPPED


def recipe_flags(args) -> str:
    """The flags beyond --architecture and --minutes that made this drafter (for its reproduce command)."""
    flags = f" --lr {args.lr:g}" + (f" --lr-schedule {args.lr_schedule}" if args.lr_schedule != "constant" else "")
    if args.schedule_minutes:
        flags += f" --schedule-minutes {args.schedule_minutes:g}"
    flags += "".join(f" --{name.replace('_', '-')} {getattr(args, name):g}"
                     for name, default in (("draft_vocab", 4096), ("unroll_steps", 3), ("feature_noise", 0.0),
                                           ("tv_weight", 0.0)) if getattr(args, name) != default)
    if args.answer_tokens is not None:
        flags += f" --answer-tokens {args.answer_tokens}"
    if args.feature_dtype != "float32":
        flags += f" --feature-dtype {args.feature_dtype}"
    if args.init:
        flags += f" --init {args.init}"
    if args.architecture == "block":
        flags += f" --block-size {args.block_size} --layers {args.layers} --block-anchors {args.block_anchors}"
    elif args.layers != 1:
        flags += f" --layers {args.layers}"
    return flags


def train(args) -> None:
    from tlt_trainers import DrafterTrainer
    from tlt_trainers.drafter.buffer import FeatureBuffer
    from tlt_trainers.drafter.feature_cache import FeatureCache
    from tlt_trainers.drafter.trainer import cosine_lr, native_bf16
    from tlt_trainers.pretrained import load_smollm2
    from tlt_trainers.shipped.prompts import TEMPERATURES

    model, tokenizer = load_smollm2()
    device = torch.device(args.device)
    model.to(device)  # the drafter is made on (or loaded to) the policy's device
    data = load_answers(args.data, args.answer_tokens, args.seed)
    sequences = data["sequences"]
    if args.minutes <= 0:
        raise SystemExit("--minutes must be > 0.")
    args.out = str(output_dir(args))
    if args.layers is None:
        args.layers = 2 if args.architecture == "block" else 1
    torch.manual_seed(args.seed)
    if args.init:  # continue from a saved drafter's weights (a fresh optimizer; --resume keeps the optimizer too)
        from tlt_trainers import Drafter

        drafter = Drafter.from_pretrained(args.init, target=model)
        if args.architecture == "eagle3" and args.layers > drafter.config.num_hidden_layers:
            drafter = drafter.stacked(args.layers)
    else:
        drafter = new_drafter(args, model)
    counts = FeatureBuffer.counting(seq["tokens"] for seq in sequences)
    if args.init and drafter.config.uses_draft_vocab and drafter.draft_vocab_size != args.draft_vocab:
        # the trained drafter over the most frequent tokens of this data, its learned head rows kept
        drafter = drafter.with_draft_vocab(counts.most_frequent(args.draft_vocab, drafter.config.vocab_size))
    trainer = DrafterTrainer(drafter, model, lr=args.lr, unroll_steps=args.unroll_steps,
                             micro_batch_size=args.micro_batch_size, buffer_bytes=64 << 30,
                             max_tokens_per_sequence=1024, show_progress=False, seed=args.seed,
                             block_anchors=args.block_anchors, feature_noise=args.feature_noise,
                             tv_weight=args.tv_weight)
    if args.feature_dtype != "float32":  # the features held for training in half the memory (the cache keeps float32)
        trainer.buffer = FeatureBuffer(trainer.buffer.max_bytes, trainer.buffer.max_tokens,
                                       feature_dtype=getattr(torch, args.feature_dtype))
    checkpoint = Path(args.out, "checkpoint")
    previous = {}
    if args.resume:
        if not (checkpoint / "trainer_state.json").is_file():
            raise SystemExit(f"--resume: no checkpoint at {checkpoint}; train without --resume first.")
        trainer.load_checkpoint(checkpoint)
        previous = json.loads(Path(args.out, "training.json").read_text())
        print(f"resumed at step {trainer.step} ({previous['train_seconds'] / 60:.1f} min trained)", flush=True)
    elif args.init:
        previous = json.loads(Path(args.init, "training.json").read_text())
        print(f"from {args.init} ({previous['train_seconds'] / 60:.1f} min trained)", flush=True)
    else:
        drafter.set_draft_vocab(counts.most_frequent(drafter.draft_vocab_size, drafter.config.vocab_size))
    # what the --init drafter was trained on, kept through --resume (the card says it; the command reproduces it)
    init_from = previous.get("init_from") if args.resume else (
        {k: previous[k] for k in ("answers", "answer_tokens", "train_seconds", "tokens_trained", "command",
                                  "init_from") if k in previous} if args.init else None)
    start = time.perf_counter()
    autocast = native_bf16(device)  # bfloat16 where native: 2x faster, features within bf16 rounding

    def progress(done: int, total: int) -> None:
        print(f"features {done}/{total} new sequences, {time.perf_counter() - start:.0f}s", flush=True)

    rows = [seq["tokens"] for seq in sequences]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        if args.feature_cache == "none":
            feature_cache = {"cached": 0, "computed": trainer.add_token_rows(rows, on_batch=progress)}
        else:  # each conversation's features computed once, for any later run on the same data
            from common import cache_root

            cache = FeatureCache.for_trainer(args.feature_cache or cache_root() / "drafter-features", trainer,
                                             autocast=autocast)
            feature_cache = cache.fill(trainer, rows, on_batch=progress)
            print(f"features: {feature_cache['cached']} conversations read from {cache.directory}, "
                  f"{feature_cache['computed']} computed", flush=True)
    feature_seconds = time.perf_counter() - start
    history, trained, tokens = list(previous.get("history", [])), 0.0, 0
    before, tokens_before = previous.get("train_seconds", 0.0), previous.get("tokens_trained", 0)
    # the cosine's span: this run's minutes, or --schedule-minutes counted across --resume'd runs
    span = (args.schedule_minutes or args.minutes) * 60
    done_before = before if args.schedule_minutes and args.resume else 0.0
    while trained < args.minutes * 60:
        if args.lr_schedule == "cosine":  # from --lr down to a tenth of it over the span
            fraction = min((done_before + trained) / span, 1.0)
            for group in trainer.optimizer.param_groups:
                group["lr"] = cosine_lr(args.lr, fraction)
        metrics = trainer.train(max_seconds=min(args.report_every, args.minutes * 60 - trained))
        trained += metrics["seconds"]
        tokens += metrics["tokens"]
        history.append({k: metrics[k] for k in ("steps", "tokens", "seconds", "loss", "top1", "top1_by_step")})
        print(f"{trained / 60:.1f} min, step {trainer.step}: loss {metrics['loss']:.3f} top-1 by step "
              f"{[round(a, 3) for a in metrics['top1_by_step']]} ({metrics['tokens'] / metrics['seconds']:.0f} "
              f"tokens/s, lr {trainer.optimizer.param_groups[0]['lr']:.2g})", flush=True)
        trainer.save_checkpoint(checkpoint)
        drafter.save_pretrained(args.out)
        info = {"answers": len(sequences), "answer_tokens": data["answer_tokens"],
                "temperatures": list(TEMPERATURES), "architecture": args.architecture,
                "feature_seconds": feature_seconds, "feature_cache": feature_cache,
                "train_seconds": before + trained,
                "steps": trainer.step + (previous.get("steps", 0) if args.init else 0),
                "tokens_trained": tokens_before + tokens, "lr": args.lr, "lr_schedule": args.lr_schedule,
                "schedule_minutes": args.schedule_minutes,
                "unroll_steps": args.unroll_steps, "micro_batch_size": args.micro_batch_size,
                "draft_vocab": drafter.draft_vocab_size if drafter.config.uses_draft_vocab else None,
                "feature_noise": args.feature_noise, "tv_weight": args.tv_weight,
                "feature_dtype": args.feature_dtype,
                "init": args.init, "init_from": init_from, "history": history,
                "command": "{} && python scripts/train_shipped_drafter.py train --architecture {}{} --minutes "
                           "{:g}".format(data["command"], args.architecture,
                                         recipe_flags(args) + (f" --data {args.data}" if args.data else ""),
                                         args.minutes)}
        Path(args.out, "training.json").write_text(json.dumps(info, indent=2) + "\n")
    if args.architecture == "eagle3" or args.ship:
        finish(drafter, model, tokenizer, info, args)
    else:  # not picked for the policy until it ships (no fingerprint): measure it first
        print(f"saved {args.out} (not shipped); measure it with python benchmarks/bench_drafters.py --block-drafter "
              f"{args.out}, then ship it with: python scripts/train_shipped_drafter.py finish --out DIR")


RESULTS = ROOT / "benchmarks" / "results"
# The newest measurement of the shipped drafters on each machine they were measured on (same command, same held-out
# prompts): the speed-up is the machine's, and its sign differs between these two CPUs
SHIPPED_ROW = "eagle3 shipped"
BLOCK_ROW = "block shipped"
# Each shipped drafter's card: (result file, the rows that measured it) per table. The EAGLE-3 drafter's is its engine
# measurement on held-out task families, taken before it shipped beside the drafter it replaced (row "eagle3
# trained": the same bfloat16 weights; it was chosen offline, bench_drafters_offline_2m.json); the block drafter's the
# newest on each machine it was measured on.
CARD_RESULTS = {
    "eagle3": ((RESULTS / "bench_drafters_eagle3_2m_families.json", "eagle3 trained"),),
    "block": ((RESULTS / "bench_drafters_issue45.json", BLOCK_ROW), (RESULTS / "bench_drafters_block.json", BLOCK_ROW)),
}


def card_measurement(results_path: Path, row_name: str = SHIPPED_ROW) -> dict:
    """One machine's measurement of a shipped drafter, for its card: ``{"machine", "source", "acceptance"}``, from a
    result file of ``benchmarks/bench_drafters.py`` (which records the command and the machine)."""
    results = json.loads(Path(results_path).read_text())
    rows, speedups = {}, {}
    for row in results["rows"]:
        if row["drafter"] != row_name:
            continue
        setting = "greedy" if row["temperature"] == 0 else f"temperature {row['temperature']:g}"
        rows[f"{setting}, chain of {row.get('k', results['args']['k'])}, batch {row['batch']}"] = {
            "acceptance_length": row["acceptance_length"], "tokens/s vs plain": row["speedup"]}
        speedups[setting, row["batch"]] = row["speedup"]
    if not rows:
        raise ValueError(f"{results_path} has no '{row_name}' rows; run benchmarks/bench_drafters.py first.")
    machine = results["machine"]
    path = Path(results_path).resolve()
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    prompt_set = results["args"].get("prompt_set")  # files older than --prompt-set held out by seed
    held_out = {"seeds": ", prompts held out by seed", "families": ", prompts of held-out task families"}.get(
        prompt_set, "")
    return {"machine": f"{machine['cpu']}, {machine['cpus']} CPUs{held_out}", "results": str(rel),
            "source": f"Measured by `{results['command']}` on held-out prompts, {machine['date']}."
                      + trained_folder_said(results["command"]),
            "acceptance": rows, "speedups": speedups}


def trained_folder_said(command: str) -> str:
    """A card's words for a measured command that named a trained drafter's folder on the machine it ran on: a reader
    has no such folder, and the weights it held are the ones shipped (row ``eagle3 trained`` / ``block trained``)."""
    flags = command.split()
    folders = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag in ("--eagle3-drafter", "--block-drafter")]
    return "".join(f" `{folder}` was the trained drafter's folder on that machine; these are its weights, so without "
                   f"the flag the same command measures them as shipped." for folder in folders)


def where_it_pays(measurements: list[dict]) -> str:
    """Where the drafter beats plain decoding on each machine, in words (the figures are in the tables)."""
    parts = []
    for m in measurements:
        verdicts = {}
        for (setting, batch), speedup in m["speedups"].items():
            verdicts.setdefault("faster" if speedup > 1 else "slower", {}).setdefault(batch, []).append(setting)
        said = [f"{verdict} at " + " and ".join(f"batch {batch} ({', '.join(settings)})"
                                               for batch, settings in sorted(verdicts[verdict].items()))
                for verdict in ("faster", "slower") if verdict in verdicts]
        parts.append(f"on {m['machine']} it is {', '.join(said)}")
    return ("Tokens/s vs plain: the drafter's speed against plain decoding of the same prompts on the same machine "
            "(above 1: it pays). Acceptance is the drafter's; whether it pays is the machine's: "
            + "; ".join(parts) + ".")


def training_data(info: dict) -> str:
    """What a drafter was trained on, in words, from its training.json (and what its --init drafter was)."""
    def one(record: dict) -> str:
        if "--data " in record["command"]:
            return (f"{record['answers']} answers of the policy ({record['answer_tokens']} answer tokens) to a broad "
                    "prompt mix (reasoning-gym tasks but ten held-out families, instructions, multi-turn and long "
                    "chat, code; data/smollm2-135m-instruct-answers), temperatures 0.6/0.8/1.0 and greedy")
        return (f"{record['answers']} answers of the policy ({record['answer_tokens']} answer tokens) to "
                "reasoning-gym questions (20 tasks) and chat requests, temperatures 0.6/0.8/1.0 and greedy")

    text, earlier = one(info), info.get("init_from")
    while earlier:
        text += f"; continued from a drafter trained on {one(earlier)}"
        earlier = earlier.get("init_from")
    return text


def reproduce_commands(info: dict) -> list[str]:
    """The commands that made a drafter, first to last (an --init drafter's own first)."""
    earlier = info.get("init_from")
    return (reproduce_commands(earlier) if earlier else []) + [info["command"]]


def write_card(drafter, info: dict, out: str | Path, results_paths=None, row_name: str | None = None) -> Path:
    """The shipped folder's README.md: its acceptance in each of ``results_paths`` (:func:`card_measurement`;
    ``row_name``: the result rows to read, default the shipped drafter's). Without ``results_paths``, the files and
    rows of ``CARD_RESULTS`` for the drafter's kind."""
    from tlt_trainers.drafter.model_card import write_model_card

    block = drafter.drafts_blocks
    if results_paths is None:
        sources = CARD_RESULTS["block" if block else "eagle3"]
    else:
        sources = [(path, row_name or (BLOCK_ROW if block else SHIPPED_ROW)) for path in results_paths]
    measurements = [card_measurement(path, row) for path, row in sources]
    training = {"data": training_data(info), "steps": info["steps"], "tokens trained": info["tokens_trained"],
                "minutes": round(info["train_seconds"] / 60),  # whole minutes: a setting-like count, not a figure
                **({} if block else {"unroll (training-time test)": info["unroll_steps"]}),
                "reproduce": " then ".join(f"`{command}`" for command in reproduce_commands(info))}
    return write_model_card(drafter, out, policy_name=POLICY, num_speculative_tokens=drafter.max_drafts if block else 4,
                            training=training, license="apache-2.0", acceptance_source=where_it_pays(measurements),
                            measurements=measurements)


def finish(drafter, model, tokenizer, info: dict, args) -> None:
    """The fingerprint that lets trainers pick this drafter, the weights in bfloat16; then measure it with
    ``python benchmarks/bench_drafters.py`` and write its card with ``... card``."""
    from tlt_trainers.shipped import FINGERPRINT, policy_fingerprint

    drafter.config.target_name_or_path = POLICY
    # Shipped in bfloat16 (half the bytes in the wheel); measured as it ships: rounded, then back in the policy's dtype
    dtype = model.get_output_embeddings().weight.dtype
    Path(args.out, FINGERPRINT).write_text(json.dumps(policy_fingerprint(model), indent=2) + "\n")
    drafter.to(torch.bfloat16).save_pretrained(args.out)
    drafter.to(dtype)
    print(f"saved {args.out}; now: python benchmarks/bench_drafters.py --kinds '' --prompts 8 --reps 2 --out NAME "
          "&& python scripts/train_shipped_drafter.py card --out DIR --results benchmarks/results/NAME.json ...")


def finish_saved(args) -> None:
    """Redo :func:`finish` for the drafter already trained into ``--out`` (its training.json kept)."""
    from tlt_trainers import Drafter
    from tlt_trainers.pretrained import load_smollm2

    model, tokenizer = load_smollm2()
    drafter = Drafter.from_pretrained(args.out, target=model)
    finish(drafter, model, tokenizer, json.loads(Path(args.out, "training.json").read_text()), args)


def card(args) -> None:
    """Rewrite ``--out``/README.md from the bench_drafters result files (no measurement here)."""
    from tlt_trainers import Drafter

    drafter = Drafter.from_pretrained(args.out)
    path = write_card(drafter, json.loads(Path(args.out, "training.json").read_text()), args.out,
                      [Path(p) for p in args.results] if args.results else None, args.row)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="sample the policy's answers with vLLM and cache them")
    p.add_argument("--prompts", type=int, default=2400)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train", help="train the EAGLE-3 (or block) drafter on the cached answers")
    p.add_argument("--architecture", choices=["eagle3", "block"], default="eagle3")
    p.add_argument("--block-size", type=int, default=8, help="block drafter: tokens per block (block_size-1 drafts)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 1 for EAGLE-3, 2 for the block "
                   "drafter); with --init, an EAGLE-3 drafter of fewer layers gets new ones stacked on it "
                   "(Eagle3Drafter.stacked: they start as a pass-through)")
    p.add_argument("--block-anchors", type=int, default=32, help="block drafter: blocks per sequence and step")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--init", default=None, help="start from this saved drafter's weights (and its training.json)")
    p.add_argument("--ship", action="store_true", help="block drafter: write the policy fingerprint (then trainers "
                   "pick it for SmolLM2-135M-Instruct) and bfloat16 weights at the end")
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="cosine: from --lr down to a tenth of it over this run's --minutes (or --schedule-minutes)")
    p.add_argument("--schedule-minutes", type=float, default=None, help="cosine: the schedule's span in training "
                   "minutes, counted across the runs that --resume each other (a training spread over sittings)")
    p.add_argument("--unroll-steps", type=int, default=3, help="training-time test: chained draft steps")
    p.add_argument("--feature-noise", type=float, default=0.0, help="Gaussian noise on the policy's features, "
                   "relative to their RMS (DrafterTrainer.feature_noise)")
    p.add_argument("--feature-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the dtype the policy's features are held in while training: bfloat16 holds twice the data "
                        "in memory (about 3.5 KB a token against 7 KB), rounded as a bfloat16 policy's would be")
    p.add_argument("--tv-weight", type=float, default=0.0, help="EAGLE-3: weight of the total-variation term, 1 - a "
                   "sampled draft's acceptance chance (DrafterTrainer.tv_weight)")
    p.add_argument("--device", default="cpu", help="where the policy's forward and the training run (cuda: minutes "
                   "for what takes a CPU hours)")
    p.add_argument("--answer-tokens", type=int, default=None, help="train on a seeded share of --data of this many "
                   "answer tokens (default: all of it)")
    p.add_argument("--feature-cache", default=None, help="where each conversation's features are kept once computed "
                   "(a later run, --resume or another recipe on the same data reads them: about 7 KB a token in "
                   "float32); default: drafter-features under TLT_CACHE_DIR; 'none': compute them every run")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--report-every", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: the shipped folder (EAGLE-3), the cache (block)")
    p.add_argument("--data", default=None, help="a folder of sampled answers in the repository (scripts/"
                   "sample_policy_answers.py, e.g. data/smollm2-135m-instruct-answers); default: the cached "
                   "answers of the sample command")
    p = sub.add_parser("finish", help="round the trained drafter to bfloat16 and save it with its fingerprint")
    p.add_argument("--out", default=str(SHIPPED))
    p = sub.add_parser("card", help="write the model card from bench_drafters result files, one per machine")
    p.add_argument("--out", default=str(SHIPPED))
    p.add_argument("--results", nargs="+", default=None,
                   help="bench_drafters result files (benchmarks/results/*.json), one table per file (default: "
                        "CARD_RESULTS, the files and rows that measured the shipped drafter of --out's kind)")
    p.add_argument("--row", default=None, help="the result rows measuring this drafter (default: 'eagle3 shipped' "
                   "or 'block shipped'; 'eagle3 trained' for bench_drafters.py --eagle3-drafter)")
    args = parser.parse_args()
    {"sample": sample, "train": train, "finish": finish_saved, "card": card}[args.command](args)


if __name__ == "__main__":
    main()
