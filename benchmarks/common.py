"""Shared parts of the benchmarks: real prompts, a warmed-up drafter, timing, tables and JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.pretrained import cache_root

RESULTS = Path(__file__).parent / "results"
WARMUP_INFO = "warmup.json"  # beside a cached drafter: the data and training that made it


def math_prompts(tokenizer, count: int, seed: int = 0, dataset: str = "gsm_symbolic",
                 instruction: str = " Think step by step.") -> list[str]:
    """Chat-formatted reasoning-gym questions (offline, generated locally)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset(dataset, size=count, seed=seed)
    texts = []
    for item in data:
        messages = [{"role": "user", "content": item["question"] + instruction}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def encode(tokenizer, texts: list[str]):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def completion_mask(sequences: torch.Tensor, prompt_len: int, pad_token_id: int, eos_token_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first EOS, 0 for the padding after it."""
    completion = sequences[:, prompt_len:]
    is_end = (completion == eos_token_id) | (completion == pad_token_id)
    ended_before = torch.cumsum(is_end.to(torch.int64), dim=1) - is_end.to(torch.int64)
    return (ended_before == 0).to(torch.long)


def count_generated(sequences, prompt_len, tok) -> int:
    """Real generated tokens (up to and including EOS) in a batch of sequences."""
    return int(completion_mask(sequences, prompt_len, tok.pad_token_id, tok.eos_token_id).sum())


def sample_answers(model, tokenizer, prompts, max_new_tokens, temperature, seed, batch_size=48):
    """The policy's own answers (prompt + completion + masks), sampled with the plain engine."""
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = encode(tokenizer, prompts[start : start + batch_size])
        res = engine.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              do_sample=temperature > 0, temperature=max(temperature, 1e-5),
                              eos_token_id=eos, pad_token_id=pad, generator=torch.Generator().manual_seed(seed + start))
        full_mask = torch.cat([mask, completion_mask(res.sequences, ids.shape[1], pad, eos)], dim=1)
        out.append((res.sequences, full_mask, ids.shape[1]))
    return out


def frequent_tokens(batches, count: int, vocab_size: int) -> torch.Tensor:
    """The ``count`` most frequent token ids in the sampled data (ties and unseen filled by lowest id)."""
    counter = Counter()
    for seqs, mask, _ in batches:
        counter.update(seqs[mask.bool()].tolist())
    ranked = [tok for tok, _ in counter.most_common(count)]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen][: count - len(ranked)]
    return torch.tensor(ranked[:count])


def warm_drafter(model, tokenizer, *, prompts: int, new_tokens: int, train_seconds: float,
                 draft_vocab: int = 4096, seed: int = 0, cache_name: str | None = None,
                 dataset: str = "gsm_symbolic", instruction: str = " Think step by step.",
                 temperatures: tuple[float, ...] = (1.0, 0.0), log=print):
    """A drafter trained briefly on the policy's own answers (cached on disk when ``cache_name`` is given).

    The answers come from ``prompts`` questions of ``dataset`` (seed ``1000 + seed``, apart from the benchmarks'
    rollout prompts), split evenly between ``temperatures`` (0 is greedy): the data a TLT drafter sees in training
    is the policy's rollouts on the task being trained, at the rollout temperature.
    """
    cache = cache_root() / "drafters" / cache_name if cache_name else None
    if cache is not None and (cache / "config.json").is_file():
        log(f"loading warmed-up drafter from {cache}")
        info = {"cached": str(cache)}
        if (cache / WARMUP_INFO).is_file():  # how it was made (caches written since this file exists)
            info.update(json.loads((cache / WARMUP_INFO).read_text()))
        return EagleDrafter.from_pretrained(cache, target=model), info
    texts = math_prompts(tokenizer, prompts, seed=1000 + seed, dataset=dataset, instruction=instruction)
    start = time.perf_counter()
    bounds = [i * len(texts) // len(temperatures) for i in range(len(temperatures) + 1)]
    batches = []
    for i, temperature in enumerate(temperatures):
        batches += sample_answers(model, tokenizer, texts[bounds[i] : bounds[i + 1]], new_tokens, temperature, seed)
    sampling_seconds = time.perf_counter() - start
    tokens = sum(int(m[:, p:].sum()) for _, m, p in batches)
    log(f"sampled {tokens} answer tokens in {sampling_seconds:.0f}s ({dataset}, T={list(temperatures)})")
    torch.manual_seed(seed)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=draft_vocab)
    drafter.set_draft_vocab(frequent_tokens(batches, draft_vocab, drafter.config.vocab_size))
    trainer = DrafterTrainer(drafter, model, lr=1e-3, micro_batch_size=8)
    width = max(s.shape[1] for s, _, _ in batches)
    ids = torch.cat([torch.nn.functional.pad(s, (width - s.shape[1], 0), value=tokenizer.pad_token_id)
                     for s, _, _ in batches])
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for _, m, _ in batches])
    metrics = trainer.train_on_sequences(ids, mask, max_seconds=train_seconds)
    log(f"drafter trained {metrics['steps']} steps in {metrics['seconds']:.0f}s: loss {metrics['loss']:.3f}, "
        f"top-1 agreement {metrics['top1']:.2f}")
    info = {"answer_tokens": tokens, "sampling_seconds": sampling_seconds, "dataset": dataset,
            "instruction": instruction, "prompts": prompts, "new_tokens": new_tokens,
            "temperatures": list(temperatures), **metrics}
    if cache is not None:
        drafter.save_pretrained(cache)
        (cache / WARMUP_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return drafter, info


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
    }


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"command": "python " + " ".join(sys.argv), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(headers: list[str], rows: list[list]) -> str:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    text = "\n".join(lines)
    print(text)
    return text
