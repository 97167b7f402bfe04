"""The engine and the warm-up command on the real SmolLM2-135M-Instruct (slow: minutes on CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from tlt_trainers.pretrained import load_smollm2

    torch.set_num_threads(2)
    return load_smollm2()


def test_greedy_speculation_is_identical_to_generate_on_the_real_model(smollm2):
    model, tok = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 17 + 25?", "Name a prime number larger than 50 and explain why it is prime.")]
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=2048)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=4))
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ours = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, **settings)
    reference = model.generate(enc.input_ids, attention_mask=enc.attention_mask, **settings)
    assert torch.equal(ours.sequences, reference)


def test_warmup_command_runs_offline(tmp_path):
    out = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "tlt_trainers.cli", "warmup-drafter", "--out", str(out), "--num-prompts", "4",
           "--eval-prompts", "1", "--max-new-tokens", "16", "--train-seconds", "5", "--draft-vocab-size", "1024"]
    subprocess.run(cmd, check=True, timeout=900)
    report = json.loads((out / "warmup_report.json").read_text())
    assert report["answer_tokens"] > 0 and report["training"]["steps"] > 0
    assert report["acceptance_after"]["t0"]["acceptance_length"] >= 1.0
    drafter_config = json.loads((out / "config.json").read_text())
    assert drafter_config["draft_vocab_size"] == 1024 and drafter_config["target_name_or_path"] == "smollm2-135m"


def test_tree_and_history_greedy_identical_on_the_real_model(smollm2):
    model, tok = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Calculate 12 + 30. Give only the final answer."}],
                                       tokenize=False, add_generation_prompt=True)] * 3
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=2048)
    reference = model.generate(**enc, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)
    for strategy in ("tree:4x3:10", "history:6", "tree:3x2:5+history:4"):
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy))
        for _ in range(2):  # the second call drafts from the first one's history
            ours = engine.generate(enc.input_ids, attention_mask=enc.attention_mask, do_sample=False,
                                   max_new_tokens=24, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            assert torch.equal(ours.sequences, reference), strategy


def test_reproduction_script_runs_end_to_end(tmp_path):
    """examples/reproduce.py with tiny settings: both trainers run, JSON and PNG are written."""
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    out = tmp_path / "repro"
    script = Path(__file__).resolve().parents[1] / "examples" / "reproduce.py"
    subprocess.run([sys.executable, str(script), "--steps", "2", "--prompts-per-step", "1",
                    "--num-generations", "4", "--max-completion-length", "16", "--skip-steps", "0",
                    "--output-dir", str(out)], check=True, timeout=900)
    result = json.loads((out / "reproduce.json").read_text())
    assert set(result["runs"]) == {"stock", "tlt"}
    assert all(len(run["steps"]) == 2 for run in result["runs"].values())
    assert all(s["rollout_seconds"] > 0 and "reward" in s for run in result["runs"].values() for s in run["steps"])
    assert result["step_time_ratio"] > 0 and (out / "reproduce.png").stat().st_size > 10_000
