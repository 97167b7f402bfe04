"""Would the drafter be accepted more often at temperature 1 if it drafted from a sharper or flatter law?

    python benchmarks/bench_draft_temperature.py                          # tau 1, 0 (argmax), 0.5, 0.7, 1.15, 1.3
    python benchmarks/bench_draft_temperature.py --taus 1,0.85 --prompts 8

When the policy samples, a chain's drafts may come from any law q: verification accepts a draft with chance
min(1, p/q) and corrects the rest, so the output is the policy's whatever q is (lossless). The engine drafts from the
drafter's own law at the rollout's temperature (tau 1), and a draft is then accepted with chance sum min(p, q). This
measures the alternatives on the shipped SmolLM2-135M-Instruct EAGLE-3 drafter: q = softmax(logits / tau) (tau < 1
sharper, > 1 flatter) and tau 0, point masses on the drafter's argmax (accepted with chance p(argmax q), as vLLM's
EAGLE proposers draft). The engine's chain proposer is replaced here by one whose ``draw`` divides the drafter's warped
logits by tau; nothing else changes. TLT's engine drafts a chain of ``--k`` at every step, batch 4, temperature 1, on
``benchmarks/bench_drafters.py``'s held-out prompts (the same sampling seeds for every tau). Writes
benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers import Drafter, SpeculativeGenerator, TLTConfig  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.proposers import eagle  # noqa: E402
from tlt_trainers.sampling.distribution import process_logits, sample_categorical  # noqa: E402
from tlt_trainers.shipped import shipped_drafter_for  # noqa: E402
from tlt_trainers.shipped.prompts import EVAL_CHAT_TOPICS, prompt_mix  # noqa: E402


class TemperedChainProposer(eagle.EagleChainProposer):
    """The engine's chain proposer, drafting from softmax(warped logits / tau); tau 0: the argmax, a point mass."""

    tau = 1.0

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        sampling = self.runner.sampling
        if not sampling.do_sample:
            return super().draw(logits)
        warped = process_logits(logits, sampling.params, None, sampling.warpers)
        if self.tau == 0:
            return warped.argmax(dim=-1), None
        probs = torch.softmax(warped / self.tau, dim=-1)
        return sample_categorical(probs, sampling.generator), probs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--taus", default="1,0,0.5,0.7,1.15,1.3")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default="bench_draft_temperature")
    args = p.parse_args()
    eagle.EagleChainProposer = TemperedChainProposer  # the drafter kind's factory looks the class up here
    model, tok = load_smollm2()
    drafter = Drafter.from_pretrained(shipped_drafter_for(model, "eagle3"), target=model).float()
    prompts = prompt_mix(tok, args.prompts, seed=7, topics=EVAL_CHAT_TOPICS)
    rows = []
    for tau in (float(t) for t in args.taus.split(",")):
        TemperedChainProposer.tau = tau
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=args.k))
        forwards = emitted = drafted = first = 0
        start = time.perf_counter()
        with torch.no_grad():
            for s in range(0, len(prompts), 4):
                enc = tok(prompts[s : s + 4], return_tensors="pt", padding=True, padding_side="left")
                stats = engine.generate(enc.input_ids, attention_mask=enc.attention_mask,
                                        max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                        generator=torch.Generator().manual_seed(s)).stats
                forwards, emitted = forwards + stats.row_forwards, emitted + stats.generated_tokens_in_steps
                drafted, first = drafted + stats.drafted_rows, first + stats.first_accepted
        rows.append({"tau": tau, "acceptance_length": emitted / forwards, "first_draft_acceptance": first / drafted,
                     "seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    table = print_table(["draft law", "accepted per verify", "first draft accepted"],
                        [["argmax (point mass)" if r["tau"] == 0 else f"tau {r['tau']:g}", r["acceptance_length"],
                          r["first_draft_acceptance"]] for r in rows])
    print(f"wrote {write_results(args.out, {'args': vars(args), 'rows': rows, 'table': table})}")


if __name__ == "__main__":
    main()
