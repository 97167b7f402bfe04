"""The capture rehearsal's cases: every step kind the engine traces into a graph, on a tiny random Llama.

Shared by ``benchmarks/bench_capture_rehearsal.py`` (the table) and ``tests/test_capture_rehearsal.py`` (CI).
Each case builds its own policy and drafter on the host (the rehearsal leaves them on ``meta``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tlt_trainers import BlockDrafter, Eagle3Drafter, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout.capture_rehearsal import RehearsalResult, rehearse_step

VOCAB, PAD, EOS = 64, 0, 1
# kind -> (strategy the engine is fixed to, the strategy name its traced step carries)
KINDS = {
    "plain": ("none", "none"),
    "eagle1": ("chain:4", "chain:4"),
    "eagle1+draft-vocab": ("chain:4", "chain:4"),
    "eagle3": ("chain:4", "chain:4"),
    "eagle3-2-layers": ("chain:4", "chain:4"),  # a KV cache per decoder layer (LayeredKV)
    "tree": ("tree:4x2:8", "tree:4x2:8"),
    "block": ("block:3", "block:3"),
    "history": ("history:8", "history:8"),
}
BATCHES = (1, 8)
SAMPLINGS = ("greedy", "T=1")
DTYPES = ("float32", "bfloat16", "float32+autocast")


@dataclass(frozen=True)
class Case:
    kind: str
    batch: int
    sampling: str
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.kind}-b{self.batch}-{self.sampling}-{self.dtype}"


def all_cases() -> list[Case]:
    return [Case(k, b, s, d) for k in KINDS for b in BATCHES for s in SAMPLINGS for d in DTYPES]


def tiny_policy(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(dtype)
    with torch.no_grad():  # sharper next-token laws: sampled rows repeat earlier rollouts (history matches)
        model.get_output_embeddings().weight.mul_(6.0)
    model.generation_config.pad_token_id = PAD
    return model


def _drafter(kind: str, model):
    if kind in ("eagle1",):
        return EagleDrafter.from_target(model)
    if kind == "eagle1+draft-vocab":
        drafter = EagleDrafter.from_target(model, draft_vocab_size=32)
        drafter.set_draft_vocab(torch.arange(3, 35))
        return drafter
    if kind in ("eagle3", "tree"):
        return Eagle3Drafter.from_target(model)
    if kind == "eagle3-2-layers":
        return Eagle3Drafter.from_target(model, num_hidden_layers=2)
    if kind == "block":
        return BlockDrafter.from_target(model, block_size=4)
    return None


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of a few lengths; with history, the same two prompts repeat (rows share a group)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [6 + (3 * i) % 7 for i in range(batch)]
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def rehearse_case(case: Case, new_tokens: int = 24) -> RehearsalResult:
    """Build the case's engine and rehearse the capture of its first traced step of the case's kind."""
    dtype = torch.bfloat16 if case.dtype == "bfloat16" else torch.float32
    model = tiny_policy(dtype)
    strategy, traced = KINDS[case.kind]
    drafter = _drafter(case.kind, model)
    config = TLTConfig(speculation="never" if strategy == "none" else "always",
                       strategy=None if strategy == "none" else strategy, cuda_graphs="static",
                       history_drafting=case.kind == "history", show_progress=False)
    engine = SpeculativeGenerator(model, drafter, config)
    ids, mask = prompts(case.batch)
    sampling = dict(do_sample=case.sampling != "greedy", temperature=1.0, top_k=0, top_p=1.0)
    common = dict(attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD, **sampling)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if case.dtype == "float32+autocast"
                else contextlib.nullcontext())
    with autocast:
        if case.kind == "history":  # an earlier rollout of the same prompts, as sampled: the rehearsed call matches it
            engine.generate(ids, generator=torch.Generator().manual_seed(0), **common)
        return rehearse_step(engine, ids, traced, generator=torch.Generator().manual_seed(0), **common)
