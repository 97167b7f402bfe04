"""The policy's own answers, kept small in the repository: token ids in compressed shards, so that any machine
retrains a drafter without sampling again.

A data folder holds ``manifest.json`` (the policy, how and where each shard was sampled, the command that makes
more) and ``shard-NNNN.npz`` files written by ``scripts/sample_policy_answers.py``. A shard's arrays:

* ``tokens``: uint16, every conversation's prompt and answer ids end to end (SmolLM2's vocabulary has 49,152 ids);
* ``lengths``: int32 ``(n, 2)``, each row's prompt and answer length;
* ``temperature``: float32, the temperature the answer was sampled at (0: greedy);
* ``source``: int16 index into ``sources`` (``task:<name>``, ``chat``, ``chat-long``, ``code``, with ``+turn2`` for
  second turns).

``numpy.savez_compressed`` (zip, deflate): no pickle, read with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
MAX_TOKEN_ID = np.iinfo(np.uint16).max


@dataclass(frozen=True)
class Answer:
    """One conversation: the prompt's ids (chat template applied), the policy's answer ids, how it was sampled."""

    prompt_ids: Sequence[int]
    answer_ids: Sequence[int]
    temperature: float
    source: str


def write_shard(path: str | Path, answers: Sequence[Answer]) -> Path:
    """Write ``answers`` as one compressed shard (atomically: a reader never sees half a file)."""
    if not answers:
        raise ValueError("write_shard: no answers to write.")
    ids = [np.asarray(list(a.prompt_ids) + list(a.answer_ids), dtype=np.int64) for a in answers]
    largest = max(int(row.max(initial=0)) for row in ids)
    if largest > MAX_TOKEN_ID or min(int(row.min(initial=0)) for row in ids) < 0:
        raise ValueError(f"write_shard: token id {largest} does not fit uint16; this format is for vocabularies of "
                         f"at most {MAX_TOKEN_ID + 1} ids.")
    sources = sorted({a.source for a in answers})
    index = {name: i for i, name in enumerate(sources)}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez_compressed(
        tmp, tokens=np.concatenate(ids).astype(np.uint16),
        lengths=np.array([[len(a.prompt_ids), len(a.answer_ids)] for a in answers], dtype=np.int32),
        temperature=np.array([a.temperature for a in answers], dtype=np.float32),
        source=np.array([index[a.source] for a in answers], dtype=np.int16), sources=np.array(sources))
    tmp.replace(path)
    return path


def read_shard(path: str | Path) -> list[Answer]:
    """The answers of one shard."""
    with np.load(path, allow_pickle=False) as data:
        tokens, lengths = data["tokens"].astype(np.int64), data["lengths"]
        temperature, source, sources = data["temperature"], data["source"], [str(s) for s in data["sources"]]
    if int(lengths.sum()) != len(tokens):
        raise ValueError(f"{path}: the lengths add up to {int(lengths.sum())} tokens, the shard holds {len(tokens)}.")
    answers, start = [], 0
    for (prompt, answer), t, s in zip(lengths.tolist(), temperature.tolist(), source.tolist()):
        row = tokens[start : start + prompt + answer].tolist()
        answers.append(Answer(row[:prompt], row[prompt:], round(float(t), 4), sources[s]))  # float32 on disk
        start += prompt + answer
    return answers


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: sample answers first (python scripts/sample_policy_answers.py "
                                f"--out {directory}).")
    return json.loads(path.read_text())


def iter_answers(directory: str | Path) -> Iterator[Answer]:
    """Every answer of the folder's shards, in the manifest's order."""
    for name in read_manifest(directory)["shards"]:
        yield from read_shard(Path(directory) / name)


def answer_share(answers: Sequence[Answer], answer_tokens: int, seed: int) -> list[Answer]:
    """A seeded share of whole answers, shuffled across shards, with at least ``answer_tokens`` answer tokens."""
    answers = list(answers)
    random.Random(seed).shuffle(answers)
    taken = 0
    for count, answer in enumerate(answers):
        taken += len(answer.answer_ids)
        if taken >= answer_tokens:
            return answers[: count + 1]
    raise ValueError(f"The answers hold {taken} answer tokens, fewer than the {answer_tokens} asked for: sample more "
                     "shards with scripts/sample_policy_answers.py, or ask for fewer.")
