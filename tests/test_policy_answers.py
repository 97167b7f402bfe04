"""The policy's sampled answers kept in the repository (tlt_trainers/shipped/answers.py,
scripts/sample_policy_answers.py) and the broad prompt mix they come from: shards read back what was written, held-out
task families never reach the training data, and the committed folder is what its manifest says."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from tlt_trainers.shipped.answers import Answer, iter_answers, read_manifest, read_shard, write_shard
from tlt_trainers.shipped.prompts import (
    BROAD_TASKS,
    EVAL_CHAT_TOPICS,
    HELD_OUT_TASKS,
    TASKS,
    broad_prompt_mix,
    evaluation_prompts,
    prompt_mix,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-instruct-answers"
VOCAB = 49152  # SmolLM2's


def test_a_shard_reads_back_what_was_written(tmp_path):
    answers = [Answer([1, 2, 3], [4, 5], 0.6, "task:gcd"), Answer([7], [], 0.0, "chat"),
               Answer([9, 9], [49151, 0, 12], 1.0, "code+turn2")]
    path = write_shard(tmp_path / "shard-0000.npz", answers)
    assert read_shard(path) == [Answer(list(a.prompt_ids), list(a.answer_ids), a.temperature, a.source)
                                for a in answers]
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_shard(tmp_path / "big.npz", [Answer([70000], [1], 0.0, "chat")])
    with np.load(path) as data:  # a shard whose lengths do not match its tokens is refused
        arrays = dict(data)
    arrays["lengths"][0, 1] += 1
    np.savez_compressed(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match="lengths add up"):
        read_shard(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError, match="sample_policy_answers.py"):
        read_manifest(tmp_path / "nothing")


def test_held_out_task_families_never_reach_the_training_mix():
    assert not set(HELD_OUT_TASKS) & set(BROAD_TASKS) and not set(HELD_OUT_TASKS) & set(TASKS)
    assert set(TASKS) <= set(BROAD_TASKS) and len(BROAD_TASKS) >= 90
    training = broad_prompt_mix(60, seed=1000)
    held_out = broad_prompt_mix(60, seed=7, held_out=True)
    sources = collections.Counter(item["source"].split(":")[0] for item in training)
    assert sources["task"] == 36 and sources["code"] == 7 and sources["chat"] + sources["chat-long"] == 17
    assert all(item["source"][5:] in BROAD_TASKS for item in training if item["source"].startswith("task:"))
    assert all(item["source"][5:] in HELD_OUT_TASKS for item in held_out if item["source"].startswith("task:"))
    assert {item["text"] for item in training} != {item["text"] for item in broad_prompt_mix(60, seed=1001)}


def test_evaluation_prompts_are_held_out_by_seed_or_by_family():
    class NoTemplate:  # chat_prompt passes the user's text through where a tokenizer has no chat template
        chat_template = None

    families = evaluation_prompts(NoTemplate(), 24, "families")
    assert families == [item["text"] for item in broad_prompt_mix(24, seed=7, held_out=True)]
    assert evaluation_prompts(NoTemplate(), 24, "seeds") == prompt_mix(NoTemplate(), 24, seed=7,
                                                                        topics=EVAL_CHAT_TOPICS)
    assert not set(families) & {item["text"] for item in broad_prompt_mix(200, seed=1000)}
    with pytest.raises(ValueError, match="choose from"):
        evaluation_prompts(NoTemplate(), 4, "tasks")


def test_the_committed_answers_are_what_the_manifest_says():
    manifest = read_manifest(DATA)
    assert manifest["shards"] and manifest["held_out_tasks"] == HELD_OUT_TASKS
    answers = list(iter_answers(DATA))
    assert len(answers) == manifest["conversations"] == sum(s["conversations"] for s in manifest["shards"].values())
    assert sum(len(a.answer_ids) for a in answers) == manifest["answer_tokens"]
    assert all(max(a.prompt_ids) < VOCAB and max(a.answer_ids, default=0) < VOCAB for a in answers)
    assert not any(a.source.split("+")[0][5:] in HELD_OUT_TASKS for a in answers)
    temperatures = collections.Counter(a.temperature for a in answers)
    assert set(temperatures) == set(manifest["temperatures"])
    assert {a.source.split(":")[0].split("+")[0] for a in answers} >= {"task", "chat", "chat-long", "code"}


def test_the_manifest_command_samples_each_run_of_shards_as_it_was_sampled():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sample_policy_answers",
                                                  DATA.parents[1] / "scripts" / "sample_policy_answers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shards = {f"shard-{k:04d}.npz": {"dtype": dtype, "max_tokens": 256}
              for k, dtype in enumerate(["float32"] * 3 + ["bfloat16"] * 2)}
    assert script.regeneration_command(shards, "DIR") == (
        "python scripts/sample_policy_answers.py --out DIR --shards 3 --prompts-per-shard 512 --max-tokens 256 "
        "--dtype float32 && python scripts/sample_policy_answers.py --out DIR --shards 5 --prompts-per-shard 512 "
        "--max-tokens 256 --dtype bfloat16")
    manifest = read_manifest(DATA)  # the committed folder's command is what its shards say
    assert manifest["command"] == script.regeneration_command(manifest["shards"], "data/" + DATA.name)
