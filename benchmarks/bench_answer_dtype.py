"""Do bfloat16 answers serve a float32 policy's drafter as well as float32 answers? Sampled with plain vLLM both ways.

    python benchmarks/bench_answer_dtype.py                       # 48 prompts, 192 tokens, greedy and T=1
    python benchmarks/bench_answer_dtype.py --prompts 8 --max-tokens 32 --out /tmp/dtype   # a smoke run

A drafter learns from answers only through their contexts: ``train_shipped_drafter.py`` runs the float32 policy over
each answer and trains toward that policy's own next-token law at every position. So the dtype that sampled the
answers matters only through which contexts the drafter sees, and this benchmark measures exactly that, on the same
broad-mix prompts (``broad_prompt_mix`` seed 999, a seed no shard uses), sampled by plain vLLM (no speculation) in
float32 and in bfloat16, greedy and at T=1 (each request seeded):

- sampling speed: answer tokens per second of each dtype on this CPU;
- how far a bfloat16 answer follows the float32 one to the same prompt and seed: identical answers, tokens before
  the first difference;
- how typical each set is for the float32 policy: the share of answer tokens that are its argmax, and their mean
  negative log-likelihood under it (teacher-forced, one forward per conversation);
- what the drafter sees: the shipped EAGLE-3 drafter's offline acceptance on each set (``DrafterTrainer.evaluate``,
  chain of 4: from top-1 agreement greedy, from sum min(p, q) at T=1), targets from the float32 policy as in training.

Each dtype samples in its own process (one vLLM engine per process). Writes benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "scripts"))

DTYPES = ("float32", "bfloat16")
MODES = {"greedy": 0.0, "T1": 1.0}
PROMPT_SEED = 999  # shards use 1000 + k, evaluation seed 7


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="first-turn conversations of the broad mix")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--k", type=int, default=4, help="chain length of the offline acceptance estimate")
    p.add_argument("--out", default="bench_answer_dtype", help="results name under benchmarks/results/")
    p.add_argument("--sample", choices=DTYPES, help=argparse.SUPPRESS)  # the child process: sample in this dtype
    p.add_argument("--to", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- sampling
def sample(args) -> None:
    """Child process: sample the prompts in ``--sample``'s dtype with plain vLLM, greedy and at T=1; write JSON."""
    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    from sample_policy_answers import conversations
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    _, tokenizer = load_smollm2()
    rows, _ = conversations(tokenizer, PROMPT_SEED, args.prompts, max_prompt_tokens=768)
    llm = LLM(str(smollm2_hf_dir()), dtype=args.sample, enforce_eager=True, seed=0, distributed_executor_backend="uni",
              max_model_len=768 + args.max_tokens + 64)
    prompts = [TokensPrompt(prompt_token_ids=row["prompt_ids"]) for row in rows]
    out = {"prompt_ids": [row["prompt_ids"] for row in rows], "sources": [row["source"] for row in rows]}
    for mode, temperature in MODES.items():
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i) for i in range(len(rows))]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        out[mode] = [list(o.outputs[0].token_ids) for o in outputs]
        out[f"{mode}_seconds"] = seconds
    Path(args.to).write_text(json.dumps(out))


def sampled(dtype: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "answers.json"
        subprocess.run([sys.executable, __file__, "--sample", dtype, "--to", str(path), "--prompts", str(args.prompts),
                        "--max-tokens", str(args.max_tokens)], check=True)
        return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------- measures
def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def policy_view(model, prompt_ids: list[list[int]], answers: list[list[int]]) -> dict:
    """The float32 policy, teacher-forced on each answer: the share of answer tokens that are its argmax, and their
    mean negative log-likelihood."""
    import torch

    hits, nll, tokens = 0, 0.0, 0
    with torch.no_grad():
        for prompt, answer in zip(prompt_ids, answers):
            if not answer:
                continue
            ids = torch.tensor([prompt + answer])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            target = torch.tensor(answer)
            hits += int((logits.argmax(-1) == target).sum())
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            tokens += len(answer)
    return {"answer_tokens": tokens, "policy_argmax_share": hits / tokens, "policy_nll": nll / tokens}


def drafter_view(model, drafter, prompt_ids: list[list[int]], answers: list[list[int]], k: int) -> dict:
    """The shipped drafter's offline acceptance on the answers (chain of ``k``), the targets the float32 policy's."""
    import torch
    from bench_drafter_recipe import answer_features

    from tlt_trainers import DrafterTrainer

    made = [(torch.tensor(p + a), len(p)) for p, a in zip(prompt_ids, answers) if len(a) > 1]
    result = DrafterTrainer(drafter, model, unroll_steps=k).evaluate(answer_features(model, made))
    return {"offline_greedy": result["estimated_acceptance_length"],
            "offline_T1": result["estimated_sampled_acceptance_length"],
            "top1_by_step": result["top1_by_step"], "sampled_acceptance_by_step": result["sampled_acceptance_by_step"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.sample:
        sample(args)
        return
    import torch
    from common import print_table, write_results

    from tlt_trainers import Drafter
    from tlt_trainers.pretrained import load_smollm2
    from tlt_trainers.shipped import shipped_drafter_for

    sets = {dtype: sampled(dtype, args) for dtype in DTYPES}
    if sets["float32"]["prompt_ids"] != sets["bfloat16"]["prompt_ids"]:
        raise SystemExit("The two dtypes were given different prompts: the prompt mix is not deterministic.")
    model, _ = load_smollm2()
    model = model.float().eval()
    drafter = Drafter.from_pretrained(shipped_drafter_for(model, "eagle3"), target=model).float().eval()
    rows = []
    for dtype, data in sets.items():
        for mode in MODES:
            answers = data[mode]
            row = {"dtype": dtype, "mode": mode, "answers": len(answers),
                   "sampling_tokens_per_second": sum(map(len, answers)) / data[f"{mode}_seconds"]}
            if dtype != "float32":  # the same prompts and per-request seeds: how far the dtypes' answers agree
                reference = sets["float32"][mode]
                row["identical_to_float32"] = sum(a == b for a, b in zip(answers, reference)) / len(answers)
                row["mean_prefix_before_difference"] = sum(
                    common_prefix(a, b) for a, b in zip(answers, reference)) / len(answers)
            row |= policy_view(model, data["prompt_ids"], answers)
            with torch.no_grad():
                row |= drafter_view(model, drafter, data["prompt_ids"], answers, args.k)
            rows.append(row)
            print(f"[{dtype} {mode}] {row['answer_tokens']} tokens, argmax {row['policy_argmax_share']:.3f}, nll "
                  f"{row['policy_nll']:.3f}, drafter {row['offline_greedy']:.2f} / {row['offline_T1']:.2f}", flush=True)
    headers = ["set", "answer tokens", "tokens/s sampled", "identical to fp32's", "tokens before a difference",
               "fp32 argmax share", "fp32 NLL", "drafter offline greedy", "drafter offline T=1"]
    table = print_table(headers, [[f"{r['dtype']} {r['mode']}", r["answer_tokens"], r["sampling_tokens_per_second"],
                                   r.get("identical_to_float32", "-"),
                                   "-" if "mean_prefix_before_difference" not in r
                                   else round(r["mean_prefix_before_difference"], 1),
                                   r["policy_argmax_share"], r["policy_nll"], r["offline_greedy"], r["offline_T1"]]
                                  for r in rows])
    path = write_results(args.out, {"args": vars(args), "prompt_seed": PROMPT_SEED, "rows": rows, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
