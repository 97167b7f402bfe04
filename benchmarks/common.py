"""Shared parts of the benchmarks: real prompts, a warmed-up drafter, timing, tables and JSON."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from tlt_trainers import Drafter
from tlt_trainers.pretrained import cache_root
from tlt_trainers.warmup import warmup_drafter

RESULTS = Path(__file__).parent / "results"
WARMUP_INFO = "warmup.json"  # beside a cached drafter: the data and training that made it
WARMUP_VERSION = "w2"  # bump when the warm-up changes what it trains, so old caches are not reused


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


def warm_drafter(model, tokenizer, *, prompts: int, new_tokens: int, train_seconds: float,
                 draft_vocab: int = 4096, seed: int = 0, cache_name: str | None = None,
                 dataset: str = "gsm_symbolic", instruction: str = " Think step by step.",
                 temperatures: tuple[float, ...] = (1.0, 0.0), log=print):
    """The library's drafter warm-up (``warmup_drafter``) on ``prompts`` questions of ``dataset``, cached on disk.

    The questions use seed ``1000 + seed``, apart from the benchmarks' rollout prompts, and are shared between
    ``temperatures`` (0 is greedy): the data a TLT drafter sees in training is the policy's rollouts on the task
    being trained, at the rollout temperature. ``train_seconds`` is training only (sampling feeds the trainer's
    buffer directly). The cache name carries ``WARMUP_VERSION``, so a cache made by an older warm-up is not reused.
    """
    cache = cache_root() / "drafters" / f"{cache_name}-{WARMUP_VERSION}" if cache_name else None
    if cache is not None and (cache / "config.json").is_file():
        log(f"loading warmed-up drafter from {cache}")
        info = {"cached": str(cache)}
        if (cache / WARMUP_INFO).is_file():
            info.update(json.loads((cache / WARMUP_INFO).read_text()))
        return Drafter.from_pretrained(cache, target=model), info  # EAGLE-3 for SmolLM2, as warmup_drafter makes it
    texts = math_prompts(tokenizer, prompts, seed=1000 + seed, dataset=dataset, instruction=instruction)
    drafter, report = warmup_drafter(model, tokenizer, texts, draft_vocab_size=draft_vocab, max_new_tokens=new_tokens,
                                     temperatures=tuple(temperatures), train_seconds=train_seconds, seed=seed,
                                     show_progress=False, log=log)
    info = {"warmup": WARMUP_VERSION, "answer_tokens": report.answer_tokens,
            "sampling_seconds": report.sampling_seconds, "dataset": dataset, "instruction": instruction,
            "prompts": prompts, "new_tokens": new_tokens, "temperatures": list(temperatures), **report.training}
    if cache is not None:
        drafter.save_pretrained(cache)
        (cache / WARMUP_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return drafter, info


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX2 / AVX-512, which decide CPU kernel speed (Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512")) if flag in flags]
    return f"{fields.get('model name', platform.machine())} ({', '.join(isa) or 'no AVX2'})"


def machine() -> dict:
    """Where a result was measured, stored with it (benchmarks/update_docs.py prints the date and CPU)."""
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cpu": cpu_name(),
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
    payload = {"command": "python " + shlex.join(sys.argv), "machine": machine(), **payload}
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
