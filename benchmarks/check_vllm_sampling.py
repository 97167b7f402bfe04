"""Does vLLM sample from the policy's distribution when it speculates? A check, per speculation method.

    python benchmarks/check_vllm_sampling.py                    # plain, eagle (our drafter), ngram; on CPU or GPU
    python benchmarks/check_vllm_sampling.py --modes plain,eagle --samples 16

Lossless speculative decoding samples exactly what plain decoding samples. This check samples completions of the
same chat prompts at temperature 1.0 with each speculation method, then scores every sampled token with the policy
itself (a Hugging Face forward over prompt + completion). Two numbers per method:

- *mean policy log-prob of the sampled tokens*: a property of the sampling distribution. Exact methods agree with
  ``plain`` within noise (a few hundredths to a tenth of a nat at these sample sizes); a method that samples from
  elsewhere reads far lower;
- *mean abs(policy - vLLM) log-prob*: vLLM's reported log-probabilities against the policy's (NaN when vLLM reports
  NaN); about 1e-5 in fp32 for ``plain``.

The eagle mode serves a fresh, untrained drafter (``EagleDrafter.from_target``): a bad drafter may make decoding
slower, never different, so it is the sharpest test. Greedy outputs are compared too (token-identical to plain).
Runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); writes benchmarks/results/check_vllm_sampling.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9)]


def engine_kwargs(mode: str, hf_model, k: int) -> tuple[dict, object]:
    if mode == "plain":
        return {}, None
    if mode == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}}, None
    if mode == "eagle":
        from tlt_trainers import EagleDrafter
        from tlt_trainers.vllm import VLLMDrafterSync

        torch.manual_seed(0)
        sync = VLLMDrafterSync(EagleDrafter.from_target(hf_model), hf_model, num_speculative_tokens=k)
        return sync.engine_kwargs(), sync
    raise ValueError(f"unknown mode {mode!r}: plain, eagle or ngram")


def score(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]


def check(mode: str, path: str, hf_model, tok, args) -> dict:
    from vllm import LLM, SamplingParams

    kwargs, sync = engine_kwargs(mode, hf_model, args.k)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=512, seed=args.seed,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs", **kwargs)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for a, b in QUESTIONS]
    requests = [p for p in prompts for _ in range(args.samples)]
    sampled = llm.generate([{"prompt_token_ids": p} for p in requests],
                           SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0), use_tqdm=False)
    policy_lp, gaps, eos = [], [], 0
    for out, prompt in zip(sampled, requests):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        if not tokens:
            continue
        eos += tokens[-1] == tok.eos_token_id
        reported = torch.tensor([entry[t].logprob for entry, t in zip(completion.logprobs, tokens)])
        lp = score(hf_model, prompt, tokens)
        policy_lp += lp.tolist()
        gaps += (lp - reported).abs().tolist()
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=args.max_tokens,
                                                                                     temperature=0.0), use_tqdm=False)
    del llm
    if sync is not None:
        sync.close()
    return {"mode": mode, "sampled_tokens": len(policy_lp), "mean_policy_logprob": sum(policy_lp) / len(policy_lp),
            "mean_abs_logprob_gap": sum(gaps) / len(gaps), "ended_by_eos": eos / len(requests),
            "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="plain,eagle,ngram", help="comma-separated: plain, eagle, ngram")
    p.add_argument("--samples", type=int, default=8, help="completions per question (4 questions)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="check_vllm_sampling", help="results file name")
    args = p.parse_args()

    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt_trainers.pretrained import smollm2_hf_dir

    path = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = [check(mode.strip(), path, hf_model, tok, args) for mode in args.modes.split(",") if mode.strip()]
    plain = next((r for r in results if r["mode"] == "plain"), None)
    rows = []
    for r in results:
        same = "-" if plain is None or r is plain else ("yes" if r["greedy"] == plain["greedy"] else "no")
        rows.append([r["mode"], r["sampled_tokens"], f"{r['mean_policy_logprob']:.3f}",
                     f"{r['mean_abs_logprob_gap']:.2e}", f"{r['ended_by_eos']:.2f}", same])
    print(f"vLLM {vllm.__version__}, SmolLM2-135M-Instruct fp32, temperature 1.0, {args.samples} samples x "
          f"{len(QUESTIONS)} questions, up to {args.max_tokens} tokens:")
    table = print_table(["mode", "sampled tokens", "mean policy log-prob", "mean abs(policy - vLLM) log-prob",
                         "ended by EOS", "greedy identical to plain"], rows)
    write_results(args.name, {"command": "python benchmarks/check_vllm_sampling.py " + " ".join(sys.argv[1:]),
                              "vllm": vllm.__version__, "settings": vars(args), "results": results, "table": table})


if __name__ == "__main__":
    main()
