"""GRPO on two CPU processes where rank 1 is killed (SIGKILL) during step 2's rollout, while rank 0 trains the
drafter in its idle time; a checkpoint is saved after every step. Run with
``torchrun --nproc_per_node 2 dead_rank.py OUT [--trainer stock]``. Rank 1 writes ``OUT/killed_at`` (the time) just
before it kills itself; rank 0 appends to ``OUT/idle_slices.jsonl`` when each idle-time drafter training slice starts
and ends (its step and drafter steps), so the test can tell it was inside one at the kill."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=["tlt", "stock"], default="tlt")
    options = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = grpo_kwargs(out / options.trainer, max_steps=4, ddp_backend="gloo", max_completion_length=16,
                         save_strategy="steps", save_steps=1)
    if options.trainer == "tlt":
        cls, args = TLTGRPOTrainer, TLTGRPOConfig(**kwargs, speculation="always", num_speculative_tokens=3)
    else:
        cls, args = GRPOTrainer, GRPOConfig(**kwargs)

    class DiesInStepTwo(cls):
        def _generate_single_turn(self, *args, **kwargs):
            if self.state.global_step == 1 and self.accelerator.process_index == 1:
                time.sleep(2.0)  # rank 0 is training its drafter in idle time by now
                (out / "killed_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._generate_single_turn(*args, **kwargs)

        def _tlt_train_drafter(self, *args, **kwargs):
            if self.accelerator.process_index != 0:
                return super()._tlt_train_drafter(*args, **kwargs)
            record(global_step=self.state.global_step, start=time.time())
            metrics = super()._tlt_train_drafter(*args, **kwargs)
            record(global_step=self.state.global_step, end=time.time(), drafter_step=self.drafter_trainer.step)
            return metrics

    def record(**event) -> None:
        with open(out / "idle_slices.jsonl", "a") as file:
            file.write(json.dumps(event) + "\n")

    trainer = DiesInStepTwo(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(32),
                            processing_class=char_tokenizer())
    trainer.train()


if __name__ == "__main__":
    main()
