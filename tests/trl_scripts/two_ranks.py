"""GRPO on two CPU processes with rank 1 made slower; run with ``torchrun --nproc_per_node 2 two_ranks.py OUT``.

Each rank writes ``OUT/rank{r}.json`` (its on_drafter_update calls, rank 0 also the logs) and, for the TLT trainer,
its drafter's weights and optimizer state, so a test can check that the drafters are identical across ranks.
``--trainer stock`` runs trl.GRPOTrainer with the same slowdown, for the step-time comparison. ``--vllm`` generates
with TRL's colocated vLLM engine (one per rank) on the real SmolLM2-135M-Instruct instead of the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer  # noqa: E402


def with_slow_rank(cls, slow_rank: int, seconds: float):
    """``cls`` whose rollout on ``slow_rank`` takes ``seconds`` longer (a long-tail response, simulated)."""

    class SlowRank(cls):
        def _generate_single_turn(self, *args, **kwargs):
            if self.accelerator.process_index == slow_rank:
                time.sleep(seconds)
            return super()._generate_single_turn(*args, **kwargs)

    return SlowRank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=["tlt", "stock"], default="tlt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculation", default="always")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--max-idle-seconds", type=float, default=120.0,
                        help="0: no idle-time training (the drafter trains after the rollout instead)")
    parser.add_argument("--vllm", action="store_true", help="TRL's colocated vLLM engine, real SmolLM2-135M")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)

    kwargs = grpo_kwargs(out / options.trainer, max_steps=options.steps, ddp_backend="gloo",
                         max_completion_length=options.max_completion_length)
    model, tokenizer = policy(), char_tokenizer()
    if options.vllm:
        from transformers import AutoTokenizer

        from tlt_trainers.pretrained import smollm2_hf_dir

        model = str(smollm2_hf_dir())
        tokenizer = AutoTokenizer.from_pretrained(model)
        kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, learning_rate=1e-6)
    if options.trainer == "tlt":
        extra = {"draft_vocab_size": 0} if options.vllm else {}
        cls, args = TLTGRPOTrainer, TLTGRPOConfig(**kwargs, **extra, speculation=options.speculation,
                                                  num_speculative_tokens=options.num_speculative_tokens,
                                                  drafter_max_idle_seconds=options.max_idle_seconds)
    else:
        cls, args = GRPOTrainer, GRPOConfig(**kwargs)
    recorder = Recorder()
    trainer = with_slow_rank(cls, 1, options.slow_seconds)(
        model=model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(32),
        processing_class=tokenizer, callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    rank = trainer.accelerator.process_index
    result = {"rank": rank, "world": trainer.accelerator.num_processes, "updates": recorder.updates,
              "logs": recorder.logs, "train_seconds": seconds, "pid": os.getpid()}
    if getattr(trainer, "drafter", None) is not None:
        state = {k: v.detach().cpu().contiguous() for k, v in trainer.drafter.state_dict().items()}
        save_file(state, str(out / f"drafter_rank{rank}.safetensors"))
        torch.save(trainer.drafter_trainer.optimizer.state_dict(), out / f"optimizer_rank{rank}.pt")
        result["drafter_step"] = trainer.drafter_trainer.step
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=float))
    if torch.distributed.is_initialized():  # a torchrun script ends its process group before it exits
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
