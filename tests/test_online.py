"""The drafter-update cycle alone (tlt_trainers.online): slices, the fallback budget, both merge rules on real
tensors, the metrics. The adapters' own tests (TRL's ranks, veRL's replicas) run it end to end."""

import ast
import math
from pathlib import Path

import pytest
import torch
from tiny_models import padded_prompts, tiny_model
from torch import nn

from tlt_trainers import DrafterTrainer, EagleDrafter
from tlt_trainers import metric_names as metric
from tlt_trainers.online import (
    IDLE,
    POST_ROLLOUT,
    DrafterTransport,
    MergeRule,
    SliceReport,
    after_rollout_budget,
    finish_update,
    merge_drafters,
    most_trained,
    step_weighted_average,
    train_slice,
    trains_after_rollout,
    update_metrics,
    waited_seconds,
)

NAN = float("nan")


class Member(nn.Module):
    """A drafter stand-in: floating weights and an integer map (like a draft vocabulary's d2t)."""

    def __init__(self, value: float):
        super().__init__()
        self.proj = nn.Linear(3, 2)
        with torch.no_grad():
            self.proj.weight.fill_(value)
            self.proj.bias.fill_(-value)
        self.register_buffer("d2t", torch.arange(4) + int(value))


class ModuleTransport(DrafterTransport):
    """Members in one process; the default share_from (collect, then load everywhere)."""

    def __init__(self, members: list[Member], steps: list[int], total_steps: list[int]):
        self.members, self.steps, self.total_steps = members, list(steps), list(total_steps)
        self.collected = 0

    def collect(self):
        self.collected += 1
        return [{"state": {k: v.clone() for k, v in m.state_dict().items()}, "steps": s, "total_steps": t,
                 "draft_vocab_ready": True} for m, s, t in zip(self.members, self.steps, self.total_steps)]

    def load_everywhere(self, payload):
        for i, member in enumerate(self.members):
            member.load_state_dict(payload["state"])
            self.total_steps[i] = max(self.total_steps[i], payload["total_steps"])
            self.steps[i] = 0


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", logit_scale=4.0)


@pytest.fixture(scope="module")
def rollouts(model):
    ids, mask = padded_prompts([5, 3, 7, 4], seed=1)
    seqs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0,
                          eos_token_id=None)
    return seqs, torch.cat([mask, torch.ones(len(ids), 12, dtype=torch.long)], dim=1)


def _trainer(model, rollouts, **drafter_kwargs) -> DrafterTrainer:
    trainer = DrafterTrainer(EagleDrafter.from_target(model, **drafter_kwargs), model, micro_batch_size=2)
    trainer.add_sequences(*rollouts)
    return trainer


# ---------------------------------------------------------------------- one slice
def test_a_slice_that_cannot_start_trains_nothing(model, rollouts):
    empty = DrafterTrainer(EagleDrafter.from_target(model), model)
    assert train_slice(empty, 10.0, max_steps=None, at_least_one=True) == {}
    trainer = _trainer(model, rollouts)
    assert train_slice(trainer, 10.0, max_steps=0, at_least_one=True) == {}  # training switched off
    assert train_slice(trainer, 0.0, max_steps=None) == {}  # no idle budget
    assert train_slice(trainer, 10.0, max_steps=None, interrupted=lambda: True) == {}  # the others had arrived
    assert trainer.step == 0


def test_the_fallback_slice_makes_one_step_whatever_the_budget_and_the_interruption(model, rollouts):
    trainer = _trainer(model, rollouts)
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    result = train_slice(trainer, 0.0, max_steps=None, at_least_one=True, interrupted=lambda: True)
    assert result["steps"] == 1 and trainer.step == 1 and math.isfinite(result["loss"])
    assert any(not torch.equal(v, before[k]) for k, v in trainer.drafter.state_dict().items())


def test_a_slice_stops_at_its_step_cap_or_when_interrupted(model, rollouts):
    trainer = _trainer(model, rollouts)
    assert train_slice(trainer, 60.0, max_steps=3)["steps"] == 3
    calls = []

    def interrupted() -> bool:  # the slowest member arrives after two micro-steps
        calls.append(trainer.step)
        return trainer.step >= 5

    assert train_slice(trainer, 60.0, max_steps=None, interrupted=interrupted)["steps"] == 2
    assert trainer.step == 5


def test_a_slice_chooses_the_draft_vocabulary_first_where_asked(model, rollouts):
    reference = _trainer(model, rollouts, draft_vocab_size=8)
    chosen = reference.rebuild_draft_vocab().clone()
    trainer = _trainer(model, rollouts, draft_vocab_size=8)
    assert not torch.equal(trainer.drafter.d2t, chosen)
    train_slice(trainer, 60.0, max_steps=1)
    assert not torch.equal(trainer.drafter.d2t, chosen)  # not asked: the vocabulary stays
    train_slice(trainer, 60.0, max_steps=1, rebuild_draft_vocab=True)
    assert torch.equal(trainer.drafter.d2t, chosen)


# ---------------------------------------------------------------------- the fallback budget
class Settings:
    def __init__(self, seconds=30.0, fraction=0.1, max_steps=None):
        self.drafter_update_seconds, self.drafter_update_fraction = seconds, fraction
        self.drafter_max_steps_per_update = max_steps


def test_fallback_budget_is_a_fraction_of_the_rollout_capped_and_each_zero_switches_it_off():
    assert after_rollout_budget(Settings(), 20.0) == pytest.approx(2.0)
    assert after_rollout_budget(Settings(seconds=1.5), 20.0) == 1.5
    assert after_rollout_budget(Settings(max_steps=4), 0.0) == 0.0  # on: the slice still makes one step
    for off in (Settings(seconds=0.0), Settings(fraction=0.0), Settings(max_steps=0)):
        assert not trains_after_rollout(off) and after_rollout_budget(off, 20.0) is None


# ---------------------------------------------------------------------- merge rules on real tensors
def test_most_trained_gives_everyone_the_source_drafter_ties_to_the_lowest():
    assert most_trained([0, 3, 3, 1]) == 1 and most_trained([0, 0]) == 0
    members = [Member(1.0), Member(2.0), Member(3.0)]
    transport = ModuleTransport(members, steps=[1, 4, 4], total_steps=[7, 10, 12])
    reports = [SliceReport(steps=1, loss=3.0, total_steps=7), SliceReport(steps=4, loss=2.0, top1=0.5, total_steps=10),
               SliceReport(steps=4, loss=1.0, total_steps=12)]
    merged = merge_drafters(MergeRule.MOST_TRAINED, reports, transport)
    assert (merged.source, merged.steps, merged.loss, merged.top1, merged.total_steps) == (1, 4, 2.0, 0.5, 10)
    for member in members:
        assert torch.equal(member.proj.weight, torch.full((2, 3), 2.0))
        assert torch.equal(member.d2t, torch.arange(4) + 2)
    assert transport.total_steps == [10, 10, 12]


def test_step_weighted_average_weights_by_steps_and_leaves_out_who_did_not_train():
    members = [Member(1.0), Member(4.0), Member(100.0)]
    transport = ModuleTransport(members, steps=[1, 3, 0], total_steps=[5, 9, 2])
    reports = [SliceReport(steps=1, loss=2.0, top1=0.2), SliceReport(steps=3, loss=4.0, top1=NAN), SliceReport()]
    merged = merge_drafters("step_weighted_average", reports, transport)
    assert merged.rule is MergeRule.STEP_WEIGHTED_AVERAGE and merged.source is None
    assert (merged.steps, merged.loss, merged.top1, merged.total_steps) == (4, 3.0, 0.2, 9)
    expected = (1 * 1.0 + 3 * 4.0) / 4  # the untrained member's weights count for nothing
    for member in members:
        assert torch.allclose(member.proj.weight, torch.full((2, 3), expected))
        assert torch.allclose(member.proj.bias, torch.full((2,), -expected))
        assert torch.equal(member.d2t, torch.arange(4) + 1)  # integer maps: the first trained member's
    assert transport.steps == [0, 0, 0] and transport.total_steps == [9, 9, 9]


def test_step_weighted_average_keeps_a_lone_drafter_and_dtype():
    half = {"w": torch.ones(2, dtype=torch.bfloat16)}
    payloads = [{"state": half, "steps": 2, "total_steps": 3, "draft_vocab_ready": False},
                {"state": {"w": torch.zeros(2, dtype=torch.bfloat16)}, "steps": 2, "total_steps": 4,
                 "draft_vocab_ready": True}, None]
    merged = step_weighted_average(payloads)
    assert merged["state"]["w"].dtype == torch.bfloat16
    assert torch.equal(merged["state"]["w"].float(), torch.full((2,), 0.5))
    assert merged["draft_vocab_ready"] and merged["total_steps"] == 4 and merged["steps"] == 4
    assert step_weighted_average(payloads[:1])["state"] is half
    assert step_weighted_average([None, {**payloads[0], "steps": 0}]) is None


@pytest.mark.parametrize("rule", list(MergeRule))
def test_nothing_is_merged_when_nobody_trained(rule):
    members = [Member(1.0), Member(2.0)]
    transport = ModuleTransport(members, steps=[0, 0], total_steps=[3, 3])
    assert merge_drafters(rule, [SliceReport(), SliceReport()], transport) is None
    assert members[0].proj.weight[0, 0].item() == 1.0 and members[1].proj.weight[0, 0].item() == 2.0


# ---------------------------------------------------------------------- the cycle
def test_idle_training_skips_the_fallback():
    members = [Member(1.0), Member(2.0)]
    transport = ModuleTransport(members, steps=[0, 5], total_steps=[0, 5])
    idle = [SliceReport(costs_timed=2, total_steps=0), SliceReport(steps=5, loss=1.0, seconds=0.7, total_steps=5)]
    outcome = finish_update(idle, transport, MergeRule.MOST_TRAINED, fallback=lambda: pytest.fail("fallback ran"))
    assert outcome.trigger == IDLE and outcome.trained == tuple(idle) and outcome.fallback_seconds == 0.0
    assert outcome.merged.source == 1 and members[0].proj.weight[0, 0].item() == 2.0
    assert update_metrics(outcome) == pytest.approx({
        metric.DRAFTER_IDLE_SECONDS: 0.7, metric.DRAFTER_UPDATE_SECONDS: 0.0, metric.DRAFTER_STEPS: 5.0,
        metric.DRAFTER_LOSS: 1.0, metric.DRAFTER_TOP1: NAN, metric.DRAFTER_SYNC_SECONDS: outcome.sync_seconds,
        metric.DRAFTER_TRIGGER_IDLE: 1.0, metric.DRAFTER_TOTAL_STEPS: 5.0, metric.COST_BATCH_SIZES_TIMED: 2.0,
    }, nan_ok=True)


def test_without_idle_steps_every_member_trains_after_the_rollout():
    members = [Member(1.0), Member(3.0)]
    transport = ModuleTransport(members, steps=[0, 0], total_steps=[4, 4])
    calls = []

    def fallback():
        calls.append(1)
        transport.steps, transport.total_steps = [2, 2], [6, 6]
        return [SliceReport(steps=2, loss=1.0, top1=0.4, seconds=0.5, total_steps=6),
                SliceReport(steps=2, loss=3.0, top1=0.6, seconds=0.9, total_steps=6)]

    outcome = finish_update([SliceReport(total_steps=4)] * 2, transport, MergeRule.STEP_WEIGHTED_AVERAGE, fallback)
    assert calls == [1] and outcome.trigger == POST_ROLLOUT
    assert all(torch.allclose(m.proj.weight, torch.full((2, 3), 2.0)) for m in members)
    values = update_metrics(outcome)
    assert values[metric.DRAFTER_UPDATE_SECONDS] == 0.9  # the slowest member's training delays the policy update
    assert values[metric.DRAFTER_IDLE_SECONDS] == 0.0 and values[metric.DRAFTER_TRIGGER_IDLE] == 0.0
    assert values[metric.DRAFTER_STEPS] == 4.0 and values[metric.DRAFTER_TOTAL_STEPS] == 6.0
    assert values[metric.DRAFTER_LOSS] == pytest.approx(2.0) and values[metric.DRAFTER_TOP1] == pytest.approx(0.5)


def test_no_fallback_and_no_idle_steps_merges_nothing():
    transport = ModuleTransport([Member(1.0)], steps=[0], total_steps=[8])
    outcome = finish_update([SliceReport(total_steps=8)], transport, MergeRule.STEP_WEIGHTED_AVERAGE, None)
    assert outcome.merged is None and outcome.trigger == IDLE
    values = update_metrics(outcome)
    assert values[metric.DRAFTER_STEPS] == 0.0 and math.isnan(values[metric.DRAFTER_LOSS])
    assert values[metric.DRAFTER_TRIGGER_IDLE] == 0.0 and values[metric.DRAFTER_TOTAL_STEPS] == 8.0


def test_a_real_slice_feeds_the_cycle(model, rollouts):
    trainer = _trainer(model, rollouts)
    drafter = trainer.drafter

    class OneMember(ModuleTransport):
        def collect(self):
            return [{"state": dict(drafter.state_dict()), "steps": 1, "total_steps": trainer.step,
                     "draft_vocab_ready": True}]

        def load_everywhere(self, payload):
            drafter.load_state_dict(payload["state"])

    def fallback():
        return [SliceReport.from_metrics(train_slice(trainer, 0.0, max_steps=None, at_least_one=True))]

    outcome = finish_update([SliceReport()], OneMember([], [], []), "step_weighted_average", fallback)
    assert outcome.trigger == POST_ROLLOUT and outcome.merged.steps == 1 and outcome.total_steps == trainer.step == 1
    assert outcome.fallback_seconds > 0 and math.isfinite(update_metrics(outcome)[metric.DRAFTER_LOSS])


# ---------------------------------------------------------------------- small parts
def test_reports_round_trip_through_a_row_and_read_trainer_metrics():
    report = SliceReport(steps=3, loss=0.5, top1=0.25, seconds=1.5, costs_timed=2, total_steps=11)
    assert SliceReport.from_row(report.as_row()) == report
    assert isinstance(SliceReport.from_row(report.as_row()).steps, int)
    read = SliceReport.from_metrics({"steps": 2, "loss": 1.0, "seconds": 0.3, "costs_timed": [1, 2, 4]}, total_steps=9)
    assert (read.steps, read.costs_timed, read.total_steps, math.isnan(read.top1)) == (2, 3, 9, True)
    assert SliceReport.from_metrics({}, total_steps=4) == SliceReport(total_steps=4)


def test_waited_seconds_sums_each_members_wait_for_the_slowest():
    assert waited_seconds([1.0, 3.0, 2.5]) == pytest.approx(2.5) and waited_seconds([]) == 0.0


def test_online_sits_below_the_adapters():
    root = Path(__file__).parents[1] / "tlt_trainers" / "online"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = ("." * node.level) + (node.module or "")
            elif isinstance(node, ast.Import):
                name = ",".join(alias.name for alias in node.names)
            else:
                continue
            for banned in ("trl", "verl", "vllm", "ray"):
                assert banned not in name.replace(".", " ").replace(",", " ").split(), (path.name, name)
