"""Shipped drafters: a policy is matched by what it is (shapes and embedding checksum), not by its name, and the
trainers start from the match unless told otherwise."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

import tlt_trainers.shipped as shipped
from tlt_trainers import BlockDrafter, Eagle3Drafter, EagleDrafter
from tlt_trainers.drafter.setup import rollout_drafter
from tlt_trainers.settings import DrafterSettings


@pytest.fixture
def shelf(tmp_path, monkeypatch):
    """A shipped-drafters folder holding one EAGLE-3 drafter made for a tiny 6-layer policy."""
    policy = tiny_model("llama", num_hidden_layers=6, seed=4)
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(policy, aux_layer_ids=[1, 3, 5])
    folder = tmp_path / "tiny-eagle3"
    drafter.save_pretrained(folder)
    (folder / shipped.FINGERPRINT).write_text(json.dumps(shipped.policy_fingerprint(policy)))
    monkeypatch.setattr(shipped, "HERE", tmp_path)
    return policy, drafter, folder


def test_the_policy_is_recognised_however_it_was_loaded(shelf):
    policy, _, folder = shelf
    assert shipped.shipped_drafter_for(policy) == folder
    assert shipped.shipped_drafter_for(policy.to(torch.bfloat16)) == folder  # rounding stays within the tolerance
    policy.to(torch.float32)
    assert shipped.shipped_drafter_for(tiny_model("llama", num_hidden_layers=6, seed=5)) is None  # other weights
    assert shipped.shipped_drafter_for(tiny_model("llama", seed=4)) is None  # other shapes


def test_trainers_start_from_the_shipped_drafter_unless_told_otherwise(shelf):
    policy, drafter, _ = shelf
    loaded, _, ready = rollout_drafter(policy, DrafterSettings(), seed=0)
    assert isinstance(loaded, Eagle3Drafter) and ready
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    fresh, _, _ = rollout_drafter(policy, DrafterSettings(drafter_name_or_path="fresh"), seed=1)
    assert not torch.equal(fresh.fc.weight, drafter.fc.weight)
    colocated_vllm, _, _ = rollout_drafter(policy, DrafterSettings(), seed=0, engine="vllm")
    assert isinstance(colocated_vllm, Eagle3Drafter)  # VLLMDrafterSync serves and refreshes EAGLE-3
    eagle1_only, _, _ = rollout_drafter(policy, DrafterSettings(), seed=0, engine="vllm-eagle1")
    assert isinstance(eagle1_only, EagleDrafter) and not eagle1_only.config.uses_draft_vocab  # vLLM's EAGLE-1
    with pytest.raises(ValueError, match="serves and reloads EAGLE-1"):
        rollout_drafter(policy, DrafterSettings(drafter_architecture="eagle3"), seed=0, engine="vllm-eagle1")
    with pytest.raises(ValueError, match="serves EAGLE-1 drafters, but the drafter is a Eagle3Drafter"):
        rollout_drafter(policy, DrafterSettings(), seed=0, engine="vllm-eagle1", drafter=drafter)
    eagle1, _, _ = rollout_drafter(policy, DrafterSettings(drafter_architecture="eagle"), seed=0)
    assert isinstance(eagle1, EagleDrafter)


def test_the_architecture_the_user_set_picks_the_shipped_drafter(shelf, tmp_path):
    """drafter_architecture='block' never starts from the shipped EAGLE-3 drafter: from the shipped block drafter
    where one ships, else from a fresh block drafter; 'auto' keeps EAGLE-3 where both ship."""
    policy, eagle3, eagle3_folder = shelf
    fresh_block, _, _ = rollout_drafter(policy, DrafterSettings(drafter_architecture="block"), seed=0)
    assert isinstance(fresh_block, BlockDrafter)
    assert shipped.shipped_drafter_for(policy, "block") is None
    torch.manual_seed(1)
    block = BlockDrafter.from_target(policy, block_size=4, num_hidden_layers=1)
    block_folder = tmp_path / "tiny-block"  # sorts before tiny-eagle3: the order of folders decides nothing
    block.save_pretrained(block_folder)
    (block_folder / shipped.FINGERPRINT).write_text(json.dumps(shipped.policy_fingerprint(policy)))
    assert shipped.shipped_drafter_for(policy) == eagle3_folder
    assert shipped.shipped_drafter_for(policy, "eagle3") == eagle3_folder
    assert shipped.shipped_drafter_for(policy, "block") == block_folder
    assert shipped.shipped_drafter_for(policy, "eagle") is None
    loaded, _, _ = rollout_drafter(policy, DrafterSettings(drafter_architecture="block"), seed=0)
    assert isinstance(loaded, BlockDrafter) and torch.equal(loaded.fc.weight, block.fc.weight)
    assert not torch.equal(fresh_block.fc.weight, block.fc.weight)
    assert isinstance(rollout_drafter(policy, DrafterSettings(), seed=0)[0], Eagle3Drafter)
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        shipped.shipped_drafter_for(policy, "medusa")


def test_model_card_figures_are_the_bench_drafters_result():
    """One figure, one source: the shipped card's acceptance table is what benchmarks/bench_drafters.py measured
    (its result file), as ``scripts/train_shipped_drafter.py card`` writes it."""
    import importlib.util

    from tlt_trainers.drafter.model_card import acceptance_table

    root = Path(__file__).resolve().parents[1]
    path = root / "scripts" / "train_shipped_drafter.py"
    spec = importlib.util.spec_from_file_location("train_shipped_drafter", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    results = root / "benchmarks" / "results"
    for folder, result, row in (("smollm2-135m-instruct-eagle3", "bench_drafters.json", script.SHIPPED_ROW),
                                ("smollm2-135m-instruct-block", "bench_drafters_block.json", script.BLOCK_ROW)):
        rows, source = script.card_acceptance(results / result, row)
        assert len(rows) == 4  # greedy and T=1, batch 1 and 4
        card = (root / "tlt_trainers" / "shipped" / folder / "README.md").read_text()
        assert acceptance_table(rows) in card and source in card, folder


def test_the_shipped_block_drafter_is_opt_in_for_smollm2():
    """Both ship for SmolLM2-135M-Instruct; 'auto' keeps the EAGLE-3 one (the block drafter did not beat it by the
    margin issue 37 asks for: docs/block_drafter.md), drafter_architecture='block' gets the block one."""
    from tlt_trainers.pretrained import load_smollm2

    model, _ = load_smollm2()
    assert shipped.shipped_drafter_for(model).name == "smollm2-135m-instruct-eagle3"
    block = shipped.shipped_drafter_for(model, "block")
    assert block.name == "smollm2-135m-instruct-block"
    loaded, _, ready = rollout_drafter(model, DrafterSettings(drafter_architecture="block"), seed=0)
    assert isinstance(loaded, BlockDrafter) and ready and loaded.block_size == 8
