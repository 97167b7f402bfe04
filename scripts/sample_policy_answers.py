"""Sample SmolLM2-135M-Instruct's own answers with plain vLLM (no speculation) into compressed shards in the repository.

    python scripts/sample_policy_answers.py --shards 4                 # 4 more shards of 512 conversations
    python scripts/sample_policy_answers.py --shards 1 --prompts-per-shard 16 --out /tmp/answers   # a smoke run

The prompts are the broad mix (``tlt_trainers.shipped.prompts.broad_prompt_mix``: every reasoning-gym task that
generates offline except the held-out families, five instructions, short and long chat requests, code requests) and
a second turn for a share of the chat and code conversations (a follow-up to the policy's own first answer). Answers
are greedy and sampled at 0.6, 0.8 and 1.0 in turn, up to ``--max-tokens``. Shard k draws its prompts with seed
1000 + k (evaluation uses seed 7 and the held-out families), so shards add up: rerun with a larger ``--shards`` to
append more, on any machine; the manifest records each shard's machine, vLLM, dtype, seconds and token counts, and
its ``command`` samples each run of shards the way it was sampled. ``--dtype bfloat16`` is the fast choice on a CPU
with native bfloat16 (AMX), float32 elsewhere; the float32 policy scores bfloat16 answers much as it scores its own
(benchmarks/bench_answer_dtype.py).
The drafter trains from the folder with ``python scripts/train_shipped_drafter.py train --data DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_OUT = ROOT / "data" / "smollm2-135m-instruct-answers"
FIRST_SEED = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the data folder (manifest.json and shard-NNNN.npz)")
    p.add_argument("--shards", type=int, default=1, help="shards the folder should hold when done (adds the missing)")
    p.add_argument("--prompts-per-shard", type=int, default=512, help="first-turn conversations per shard")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are left out (and counted)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-num-seqs", type=int, default=128, help="vLLM's concurrent requests")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE; "
                   "default: as set, else tlt_trainers.vllm's 2 GiB)")
    return p.parse_args(argv)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation's ids, ready for the assistant's answer (transformers 5 returns a BatchEncoding)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def conversations(tokenizer, seed: int, count: int, max_prompt_tokens: int) -> tuple[list[dict], int]:
    """The shard's first turns: ``{"messages", "source", "prompt_ids"}``; and how many were too long."""
    from tlt_trainers.shipped.prompts import broad_prompt_mix

    kept, dropped = [], 0
    for item in broad_prompt_mix(count, seed):
        messages = [{"role": "user", "content": item["text"]}]
        ids = chat_ids(tokenizer, messages)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append({"messages": messages, "source": item["source"], "prompt_ids": ids})
    return kept, dropped


def generate(llm, rows: list[dict], first_temperature: int, max_tokens: int) -> list[list[int]]:
    """One answer per row (its ``prompt_ids``), the temperatures in turn from ``first_temperature``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_trainers.shipped.prompts import TEMPERATURES

    params = [SamplingParams(max_tokens=max_tokens,
                             temperature=TEMPERATURES[(first_temperature + i) % len(TEMPERATURES)])
              for i in range(len(rows))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=row["prompt_ids"]) for row in rows], params, use_tqdm=True)
    for row, param in zip(rows, params):
        row["temperature"] = param.temperature
    return [list(out.outputs[0].token_ids) for out in outputs]


def sample_shard(llm, tokenizer, index: int, args) -> tuple[list, dict]:
    from tlt_trainers.shipped.answers import Answer
    from tlt_trainers.shipped.prompts import SECOND_TURN_SHARE, follow_up

    seed = FIRST_SEED + index
    start = time.perf_counter()
    rows, dropped = conversations(tokenizer, seed, args.prompts_per_shard, args.max_prompt_tokens)
    prompt_seconds = time.perf_counter() - start
    start = time.perf_counter()
    answers = generate(llm, rows, index, args.max_tokens)
    results = [Answer(row["prompt_ids"], ids, row["temperature"], row["source"]) for row, ids in zip(rows, answers)]
    # Second turns: the follow-up to the policy's own (finished) first answer, for a share of chat and code
    second = []
    for i, (row, ids) in enumerate(zip(rows, answers)):
        finished = ids and ids[-1] == tokenizer.eos_token_id
        chosen = random.Random(seed * 1_000_003 + i).random() < SECOND_TURN_SHARE
        if row["source"].startswith(("chat", "code")) and finished and chosen:
            messages = row["messages"] + [{"role": "assistant", "content": tokenizer.decode(ids[:-1])},
                                          {"role": "user", "content": follow_up(seed, i)}]
            prompt = chat_ids(tokenizer, messages)
            if len(prompt) <= args.max_prompt_tokens + args.max_tokens:
                second.append({"prompt_ids": prompt, "source": row["source"] + "+turn2"})
    if second:
        for row, ids in zip(second, generate(llm, second, index + 1, args.max_tokens)):
            results.append(Answer(row["prompt_ids"], ids, row["temperature"], row["source"]))
    seconds = time.perf_counter() - start
    answer_tokens = sum(len(a.answer_ids) for a in results)
    info = {"seed": seed, "conversations": len(results), "first_turns": len(rows), "second_turns": len(second),
            "dropped_long_prompts": dropped, "answer_tokens": answer_tokens,
            "prompt_tokens": sum(len(a.prompt_ids) for a in results), "prompt_seconds": round(prompt_seconds, 1),
            "seconds": round(seconds, 1), "answer_tokens_per_second": round(answer_tokens / seconds, 1)}
    return results, info


def regeneration_command(shards: dict[str, dict], out) -> str:
    """The commands that sample ``shards`` again: one per run of consecutive shards sampled alike (dtype, answer
    length, prompts per shard), each asking for the shards up to its run's end (a rerun adds only the missing)."""
    runs: list[tuple[tuple, int]] = []
    for k, name in enumerate(sorted(shards)):
        info = shards[name]
        how = (info["dtype"], info["max_tokens"], info.get("prompts_per_shard", 512))
        if runs and runs[-1][0] == how:
            runs[-1] = (how, k + 1)
        else:
            runs.append((how, k + 1))
    return " && ".join(f"python scripts/sample_policy_answers.py --out {out} --shards {end} --prompts-per-shard "
                       f"{per_shard} --max-tokens {max_tokens} --dtype {dtype}"
                       for (dtype, max_tokens, per_shard), end in runs)


def main(argv=None) -> None:
    args = parse_args(argv)
    from tlt_trainers.vllm import in_process_cpu_environment

    if args.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    in_process_cpu_environment()
    import vllm
    from common import machine
    from vllm import LLM

    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.shipped.answers import MANIFEST, write_shard
    from tlt_trainers.shipped.prompts import HELD_OUT_TASKS, TEMPERATURES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {
        "policy": "HuggingFaceTB/SmolLM2-135M-Instruct", "format": "tlt_trainers/shipped/answers.py",
        "prompts": "tlt_trainers.shipped.prompts.broad_prompt_mix (seed 1000 + shard)",
        "held_out_tasks": HELD_OUT_TASKS, "temperatures": list(TEMPERATURES), "shards": {}}
    missing = [k for k in range(args.shards) if f"shard-{k:04d}.npz" not in manifest["shards"]]
    if not missing:
        print(f"{out} already holds {len(manifest['shards'])} shards (>= --shards {args.shards}): nothing to do")
        return
    _, tokenizer = load_smollm2()
    llm = LLM(str(smollm2_hf_dir()), dtype=args.dtype, enforce_eager=True, seed=0, distributed_executor_backend="uni",
              max_model_len=args.max_prompt_tokens + 2 * args.max_tokens + 64, max_num_seqs=args.max_num_seqs)
    where = machine()
    for k in missing:
        answers, info = sample_shard(llm, tokenizer, k, args)
        name = f"shard-{k:04d}.npz"
        write_shard(out / name, answers)
        info.update(dtype=args.dtype, max_tokens=args.max_tokens, prompts_per_shard=args.prompts_per_shard,
                    vllm=vllm.__version__, machine=where,
                    max_num_seqs=args.max_num_seqs, kv_cache_gib=float(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                    bytes=(out / name).stat().st_size)
        manifest["shards"][name] = info
        manifest["shards"] = dict(sorted(manifest["shards"].items()))
        totals = manifest["shards"].values()
        manifest["answer_tokens"] = sum(s["answer_tokens"] for s in totals)
        manifest["conversations"] = sum(s["conversations"] for s in totals)
        shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
        manifest["command"] = regeneration_command(manifest["shards"], shown)
        path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"{name}: {info['conversations']} conversations, {info['answer_tokens']} answer tokens in "
              f"{info['seconds']:.0f}s ({info['answer_tokens_per_second']:.0f} tokens/s); the folder holds "
              f"{manifest['answer_tokens']} answer tokens", flush=True)


if __name__ == "__main__":
    main()
