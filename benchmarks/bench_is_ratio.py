"""Where TRL's importance-sampling ratio drift comes from, with the stock ``GRPOTrainer`` and its colocated vLLM.

    python benchmarks/bench_is_ratio.py                           # 3 steps, vLLM's dtype "auto" then "float32"
    python benchmarks/bench_is_ratio.py --steps 1 --max-completion-length 32     # smoke

The stock ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` on the real SmolLM2-135M-Instruct (fp32 weights,
trained in fp32 on a CPU: ``bf16=False``), temperature 1, once per vLLM ``dtype``: ``auto`` is what TRL builds
(it passes no ``dtype`` to ``vllm.LLM``, and vLLM's ``auto`` downcasts a float32 checkpoint to the platform's
preferred dtype, bfloat16 on CPUs and GPUs), ``float32`` is the same engine at the trainer's precision. The learning
rate (1e-5) and a reward that varies with the answer's length make every optimizer step change the policy, so steps
after the first also check that the weights synced to vLLM before it samples. On a CPU, TRL's engine gets only the
two fix-ups of :mod:`tlt_trainers.trl.vllm_colocate` (``uni`` executor, ``reload_weights``), no drafter.

For every rollout it keeps, token by token on the completion tokens TRL scores (``completion_mask``), vLLM's
returned log-probability of the sampled token (``sampling_per_token_logps``, ``logprobs_mode="processed_logprobs"``)
and the trainer's (``old_per_token_logps``, TRL's no-grad pass right after the rollout, same weights), and reports:
TRL's own ``sampling/importance_sampling_ratio/mean`` and ``sampling/sampling_logp_difference/*``, the largest summed
difference over one completion (TRL's default ``vllm_importance_sampling_mode="sequence_mask"`` applies
``exp(sum)`` per sequence and sets ratios above ``vllm_importance_sampling_clip_max=3`` to 0), the share of
completions masked that way, and the mean ratio TRL would report per token (``token_truncate``) from the same
numbers. Writes benchmarks/results/bench_is_ratio.json (per-token detail of the largest differences included).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9), (31, 5), (6, 14)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (x num_generations answers)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--dtypes", default="auto,float32", help="vLLM dtypes to run, comma separated")
    p.add_argument("--output-dir", default="runs/bench_is_ratio")
    p.add_argument("--name", default="bench_is_ratio", help="results file name")
    return p.parse_args()


def dataset(count: int):
    from datasets import Dataset

    pairs = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {b}? Explain briefly."}]
                                         for a, b in pairs]})


def shorter(completions, **kwargs):
    """Shorter answers score higher: rewards vary within every group, so every step moves the policy."""
    return [-len(c[0]["content"]) / 100.0 for c in completions]


def rollout_record(output: dict, trainer) -> dict:
    """Per-token comparison of vLLM's and the trainer's log-probs on the tokens TRL scores."""
    old, sampled = output["old_per_token_logps"].float(), output["sampling_per_token_logps"].float()
    mask = output["completion_mask"].bool()
    diff = (old - sampled).masked_fill(~mask, 0.0)  # log(trainer / vLLM), TRL's per_token_logps_diff
    flat = diff[mask].abs()
    seq = diff.sum(dim=1)
    clip_max = trainer.args.vllm_importance_sampling_clip_max
    token_ratio = torch.exp(diff[mask]).clamp(max=clip_max if clip_max is not None else math.inf)
    worst = []
    ids = output["completion_ids"]
    tokenizer = trainer.processing_class
    lengths = mask.sum(dim=1)
    eos = set(trainer.eos_token_ids) if getattr(trainer, "eos_token_ids", None) else {tokenizer.eos_token_id}
    for index in torch.topk(diff.abs().flatten(), k=min(5, int(mask.sum()))).indices.tolist():
        row, col = divmod(index, diff.shape[1])
        token = int(ids[row, col])
        worst.append({"row": row, "position": col, "length": int(lengths[row]), "token": tokenizer.decode([token]),
                      "eos": token in eos, "trainer_logp": float(old[row, col]),
                      "vllm_logp": float(sampled[row, col])})
    return {"tokens": int(mask.sum()), "completions": int(mask.shape[0]),
            "mean_length": float(lengths.float().mean()),
            "token_abs_diff_mean": float(flat.mean()), "token_abs_diff_max": float(flat.max()),
            "token_abs_diff_median": float(flat.median()),
            "share_tokens_diff_over_1e-3": float((flat > 1e-3).float().mean()),
            "seq_log_ratio_abs_max": float(seq.abs().max()),
            "seq_log_ratios": [round(float(v), 4) for v in seq],
            "seq_masked_share": float(((torch.exp(seq) > clip_max) if clip_max is not None
                                       else torch.zeros_like(seq, dtype=torch.bool)).float().mean()),
            "token_truncate_ratio_mean": float(token_ratio.mean()),
            "eos_abs_diff_mean": _eos_diff(diff, mask, ids, eos),
            "largest": worst}


def _eos_diff(diff, mask, ids, eos) -> float:
    is_eos = torch.isin(ids, torch.tensor(sorted(eos))) & mask
    return float(diff[is_eos].abs().mean()) if is_eos.any() else float("nan")


def build(path: str, dtype: str, args, train_dataset, tokenizer, records: list, logs: list):
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tlt_trainers.trl.vllm_colocate import tlt_vllm_generation

    class Logs(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "sampling/importance_sampling_ratio/mean" in logs:
                kept.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    kept = logs

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training:
                record = rollout_record(output, self)
                record["step"] = self.state.global_step + 1
                records.append(record)
            return output

    config = GRPOConfig(output_dir=f"{args.output_dir}/{dtype}", use_vllm=True, vllm_mode="colocate",
                        max_steps=args.steps, per_device_train_batch_size=args.prompts * args.num_generations,
                        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                        temperature=args.temperature, learning_rate=args.learning_rate, logging_steps=1,
                        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                        bf16=torch.cuda.is_available(), seed=0, vllm_max_model_length=512, disable_tqdm=True)
    kwargs = dict(model=path, reward_funcs=shorter, train_dataset=train_dataset, processing_class=tokenizer,
                  callbacks=[Logs()])
    overrides = {} if dtype == "auto" else {"dtype": dtype}
    if torch.cuda.is_available():
        from trl.generation import vllm_generation

        from tlt_trainers.trl.vllm_colocate import _llm_with

        with _llm_with(vllm_generation, overrides):
            return Recording(args=config, **kwargs)
    with tlt_vllm_generation():  # TRL's engine with the two CPU fix-ups (module docstring), no drafter
        trainer = Recording(args=config, **kwargs)
    trainer.vllm_generation.start(None, overrides)
    return trainer


def main() -> None:
    args = parse_args()
    import trl
    import vllm
    from transformers import AutoTokenizer

    from tlt_trainers.pretrained import smollm2_hf_dir

    path = str(smollm2_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_dataset = dataset(args.steps * args.prompts)
    runs, rows = [], []
    for dtype in args.dtypes.split(","):
        records, logs = [], []
        trainer = build(path, dtype, args, train_dataset, tokenizer, records, logs)
        engine_dtype = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        policy_dtype = str(trainer.model.dtype).removeprefix("torch.")
        trainer.train()
        runs.append({"vllm_dtype_arg": dtype, "vllm_dtype": engine_dtype, "policy_dtype": policy_dtype,
                     "importance_sampling_mode": trainer.args.vllm_importance_sampling_mode,
                     "clip_max": trainer.args.vllm_importance_sampling_clip_max, "rollouts": records, "logs": logs})
        for record, log in zip(records, logs):
            rows.append([f"{dtype} ({engine_dtype})", policy_dtype, record["step"], f"{record['mean_length']:.0f}",
                         f"{log['sampling/importance_sampling_ratio/mean']:.3f}",
                         f"{record['token_truncate_ratio_mean']:.4f}",
                         f"{log['sampling/sampling_logp_difference/mean']:.2e}",
                         f"{log['sampling/sampling_logp_difference/max']:.2e}",
                         f"{record['seq_log_ratio_abs_max']:.3f}", f"{record['seq_masked_share']:.2f}"])
        print(f"vLLM dtype {dtype}: engine {engine_dtype}, policy {policy_dtype}", flush=True)
        del trainer
        gc.collect()
    print(f"TRL {trl.__version__}, vLLM {vllm.__version__}, stock GRPOTrainer, SmolLM2-135M-Instruct, {args.prompts} "
          f"prompts x {args.num_generations} answers, up to {args.max_completion_length} tokens, temperature "
          f"{args.temperature}, lr {args.learning_rate}, {args.steps} steps per vLLM dtype:")
    table = print_table(["vLLM dtype", "policy dtype", "step", "completion tokens", "TRL IS ratio (mean)",
                         "per-token IS ratio (mean)", "|logp diff| mean", "|logp diff| max",
                         "max |seq log-ratio|", "seqs masked"], rows)
    write_results(args.name, {"trl": trl.__version__, "vllm": vllm.__version__, "settings": vars(args),
                              "runs": runs, "table": table})


if __name__ == "__main__":
    main()
