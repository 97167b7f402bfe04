"""A drafter kind is one record: a kind defined here, in tests/ alone, and registered, generates exactly (greedy
identity, sampled law), trains, saves, loads, exports and ships through the public API, with no edit under
tlt_trainers/. The built-in kinds are records of the same registry."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_engine_sampling import engine_samples, hf_samples, two_sample_pvalue
from test_engine_sampling import model as sampling_model  # noqa: F401  (the fixture)
from tiny_models import PAD, padded_prompts, tiny_model
from torch import nn

import tlt_trainers.shipped as shipped
from tlt_trainers import Drafter, DrafterTrainer, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.base import AutoregressiveDrafter
from tlt_trainers.drafter.eagle import new_drafter
from tlt_trainers.drafter.registry import DrafterKind, kind_named, kind_of, register, registered, unregister
from tlt_trainers.kinds.setup import rollout_drafter
from tlt_trainers.proposers.eagle import token_proposers
from tlt_trainers.settings import DrafterSettings


class MLPDrafter(AutoregressiveDrafter):
    """A toy kind: no attention, fc([embed(x_{t+1}); h_t]) and a residual MLP predict h_{t+1}; the policy's LM head
    scores it (as EAGLE-1, over the full vocabulary)."""

    def __init__(self, config, target=None):
        super().__init__(config)
        h, inner = config.hidden_size, config.intermediate_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.mlp = nn.Sequential(nn.Linear(h, inner), nn.SiLU(), nn.Linear(inner, h))
        if target is not None:
            self.bind(target)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.uses_draft_vocab:
            raise ValueError("an MLPDrafter scores the policy's whole vocabulary: pass draft_vocab_size=None")

    @classmethod
    def from_target(cls, model, **overrides):
        return new_drafter(cls, model, {}, overrides)

    @property
    def feature_size(self):
        return self.config.hidden_size

    def _step(self, features, tokens):
        x = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        return x + self.mlp(x)

    def forward(self, hidden, next_tokens, positions, mask=None, kv=None, slots=None, kv_len=None):
        return self._step(hidden, next_tokens)

    def forward_unrolled(self, hidden, next_tokens, positions, valid, depth):
        outputs, features = [], hidden
        for _ in range(depth):
            predicted = self._step(features, next_tokens)
            outputs.append(predicted)
            features = torch.cat([hidden[:, :1], predicted[:, :-1]], dim=1)  # step d at t reads step d-1 at t-1
        return outputs

    def logits(self, predicted):
        weight = self.target.head.weight.detach()
        return F.linear(predicted.to(weight.dtype), weight).float()


def export_flat(drafter, out_dir, verifier_name_or_path=None, dtype=None):
    """The toy kind's one export layout: its tensors and a small manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or torch.float32
    save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()},
              str(out / "flat.safetensors"))
    (out / "manifest.json").write_text(json.dumps({"kind": "mlp", "verifier": verifier_name_or_path,
                                                   "hidden_size": drafter.config.hidden_size}))
    return out


@pytest.fixture
def mlp_kind():
    kind = register(DrafterKind(name="mlp", drafter_class=MLPDrafter, description="toy MLP drafter",
                                proposers=token_proposers, strategy_kinds=("chain", "tree"),
                                training_loss=DrafterTrainer.autoregressive_loss, exports={"flat": export_flat}))
    yield kind
    unregister(kind)


def _trained(model, steps, seed=0):
    ids, mask = padded_prompts([5] * 32, vocab_size=model.config.vocab_size, seed=seed)
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)
    full_mask = torch.cat([mask, torch.ones(32, seqs.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
    torch.manual_seed(seed)
    drafter = MLPDrafter.from_target(model)
    before = [p.detach().clone() for p in drafter.parameters()]
    report = DrafterTrainer(drafter, model, lr=3e-3).train_on_sequences(seqs, full_mask, max_steps=steps)
    return drafter, before, report


def test_the_built_in_kinds_are_records_of_the_registry():
    names = {kind.name: kind.architecture for kind in registered().values()}
    assert {"eagle": "EagleDrafter", "eagle3": "Eagle3Drafter", "block": "BlockDrafter"}.items() <= names.items()
    assert kind_named("block").strategy_kinds == ("block",) and kind_named("eagle3").vllm.method == "eagle3"
    with pytest.raises(ValueError, match="not a registered drafter kind"):
        kind_of("MLPDrafter")


def test_a_kind_defined_in_tests_generates_trains_saves_loads_and_exports(mlp_kind, tmp_path):
    model = tiny_model("llama", logit_scale=4.0)
    drafter, before, report = _trained(model, steps=150)
    assert report["steps"] == 150 and any(not torch.equal(a, b) for a, b in zip(before, drafter.parameters()))
    assert drafter.drafts_blocks is False and kind_of(drafter) is mlp_kind

    # greedy: token for token what model.generate gives, with drafts both kept and rejected
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    config = TLTConfig(speculation="always", num_speculative_tokens=3)
    ours = SpeculativeGenerator(model, drafter, config).generate(ids, attention_mask=mask, do_sample=False,
                                                                  max_new_tokens=24, pad_token_id=PAD)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    assert torch.equal(ours.sequences, reference)
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens
    torch.manual_seed(0)
    untrained = SpeculativeGenerator(model, MLPDrafter.from_target(model), config).generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    assert torch.equal(untrained.sequences, reference)
    assert ours.stats.acceptance_length > untrained.stats.acceptance_length + 0.5  # training taught it the policy

    # save and load: Drafter.from_pretrained picks the class from config.json's architecture
    drafter.save_pretrained(tmp_path / "saved")
    loaded = Drafter.from_pretrained(tmp_path / "saved", target=model)
    assert type(loaded) is MLPDrafter
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))

    # export to the kind's own layout; a layout it does not have names the ones it has
    out = drafter.export(tmp_path / "flat", "flat", "tiny-policy")
    assert json.loads((out / "manifest.json").read_text())["verifier"] == "tiny-policy"
    assert torch.equal(load_file(str(out / "flat.safetensors"))["fc.weight"], drafter.fc.weight)
    with pytest.raises(ValueError, match=r"exports to \['flat'\]"):
        drafter.export(tmp_path / "vllm", "vllm")

    # the settings choose it by name and the trainers' setup builds a fresh one
    fresh, trainer, _ = rollout_drafter(model, DrafterSettings(drafter_architecture="mlp"), seed=0)
    assert type(fresh) is MLPDrafter and trainer.drafter is fresh


def test_a_kind_defined_in_tests_keeps_the_sampled_law(mlp_kind, sampling_model):  # noqa: F811
    torch.manual_seed(11)
    drafter = MLPDrafter.from_target(sampling_model)  # untrained: both acceptances and rejections
    for sampling in (dict(temperature=1.0), dict(temperature=0.7, top_k=4)):
        reference = hf_samples(sampling_model, seed=1, **sampling)
        ours, stats = engine_samples(sampling_model, drafter, seed=2, **sampling)
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        assert two_sample_pvalue(reference, ours) > 1e-3


def test_a_kind_ships_its_own_drafters(tmp_path):
    policy = tiny_model("llama", seed=4)
    folder = tmp_path / "tiny-mlp"
    kind = register(DrafterKind(name="mlp", drafter_class=MLPDrafter, proposers=token_proposers,
                                strategy_kinds=("chain", "tree"), training_loss=DrafterTrainer.autoregressive_loss,
                                shipped=(folder,), auto_rank=-1))
    try:
        torch.manual_seed(123)  # not the seed rollout_drafter starts a fresh drafter from
        MLPDrafter.from_target(policy).save_pretrained(folder)
        (folder / shipped.FINGERPRINT).write_text(json.dumps(shipped.policy_fingerprint(policy)))
        assert shipped.shipped_drafter_for(policy, "mlp") == folder
        assert shipped.shipped_drafter_for(policy) == folder  # auto_rank -1: 'auto' prefers it
        started, _, _ = rollout_drafter(policy, DrafterSettings(), seed=0)
        assert type(started) is MLPDrafter
        saved = load_file(str(folder / "model.safetensors"))
        assert saved and all(torch.equal(started.state_dict()[name].cpu(), value) for name, value in saved.items())
        torch.manual_seed(1)
        fresh = MLPDrafter.from_target(policy)
        assert any(not torch.equal(fresh.state_dict()[name], value) for name, value in saved.items())  # not a fresh one
    finally:
        unregister(kind)
    assert shipped.shipped_drafter_for(policy) is None
