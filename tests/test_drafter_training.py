"""DrafterTrainer: unrolled training matches inference, the bounded buffer, checkpoints, feeding from the engine."""

import json

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.buffer import FeatureBuffer
from tlt_trainers.drafter.trainer import cosine_lr, estimated_acceptance_length
from tlt_trainers.modeling.kv_cache import RowState, additive_mask, attention_allowed


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", logit_scale=4.0)


@pytest.fixture(scope="module")
def rollouts(model):
    ids, mask = padded_prompts([5, 3, 7, 4, 6, 5], seed=3)
    seqs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                          eos_token_id=None)
    return seqs, torch.cat([mask, torch.ones(len(ids), 20, dtype=torch.long)], dim=1)


def assert_unrolled_matches_chained(drafter, feature_width: int, vocab: int = 64) -> None:
    """Step d of ``drafter.forward_unrolled`` at position t equals the d-th chained draft step of the engine."""
    length, tlen = 12, 6
    hidden = torch.randn(1, length, feature_width)
    tokens = torch.randint(3, vocab, (1, length + 1))
    positions = torch.arange(length)[None]
    with torch.no_grad():
        valid = torch.ones(1, length, dtype=torch.bool)
        unrolled = drafter.forward_unrolled(hidden, tokens[:, 1:], positions, valid, 3)
        # Inference: real pairs at slots [0, tlen), then chain steps at slots tlen, tlen + 1 with teacher tokens.
        kv, state = drafter.new_kv(length), RowState(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        slots = torch.arange(tlen)[None]
        mask = additive_mask(attention_allowed(state, slots, tlen), torch.float32)
        out = drafter(hidden[:, :tlen], tokens[:, 1 : tlen + 1], slots, mask, kv, slots, tlen)
        feature = out[:, -1:]
        state.length += tlen
        assert torch.allclose(feature, unrolled[0][:, tlen - 1 : tlen], atol=1e-5)
        for step in (1, 2):
            slot = torch.tensor([[tlen + step - 1]])
            mask = additive_mask(attention_allowed(state, slot, tlen + step), torch.float32)
            feature = drafter(feature, tokens[:, tlen + step : tlen + step + 1], slot, mask, kv, slot, tlen + step)
            assert torch.allclose(feature, unrolled[step][:, tlen + step - 1 : tlen + step], atol=1e-5), step


def test_unrolled_steps_compute_what_chained_drafting_computes(model):
    torch.manual_seed(0)
    assert_unrolled_matches_chained(EagleDrafter.from_target(model), feature_width=32)


def test_unrolled_training_reports_each_step_and_keeps_the_policy_intact(model, rollouts):
    policy = {k: v.clone() for k, v in model.state_dict().items()}
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model, lr=3e-3, unroll_steps=3)
    trainer.add_sequences(*rollouts)
    before = trainer.evaluate()
    metrics = trainer.train(max_steps=30)
    assert len(metrics["top1_by_step"]) == 3
    assert 1.0 <= metrics["estimated_acceptance_length"] <= 5.0
    after = trainer.evaluate()
    assert after["top1"] > before["top1"] + 0.1 and after["loss"] < before["loss"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, policy[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_a_cosine_schedule_decays_each_micro_step_to_a_tenth_and_gives_the_rate_back(model, rollouts):
    trainer = DrafterTrainer(EagleDrafter.from_target(model), model, lr=2e-3)
    trainer.add_sequences(*rollouts)
    rates = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train(max_steps=5, lr_schedule="cosine")
    assert rates == pytest.approx([cosine_lr(2e-3, k / 5) for k in range(5)])
    assert rates[0] == pytest.approx(2e-3) and rates == sorted(rates, reverse=True)
    assert cosine_lr(2e-3, 1.0) == pytest.approx(2e-4) and cosine_lr(2e-3, 0.5) == pytest.approx(1.1e-3)
    assert trainer.optimizer.param_groups[0]["lr"] == 2e-3  # the next call starts from the trainer's rate
    rates.clear()
    trainer.train(max_steps=3)  # constant: the default
    assert rates == [2e-3] * 3
    with pytest.raises(ValueError, match="choose 'constant' or 'cosine'"):
        trainer.train(max_steps=1, lr_schedule="linear")
    with pytest.raises(ValueError, match="give max_seconds or max_steps"):
        trainer.train(should_stop=lambda: True, lr_schedule="cosine")


def test_estimated_acceptance_length():
    assert estimated_acceptance_length([1.0], 4) == 5.0
    assert estimated_acceptance_length([0.0, 1.0], 4) == 1.0
    assert estimated_acceptance_length([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)


def test_buffer_is_bounded_in_bytes_and_keeps_recent_windows():
    buffer = FeatureBuffer(max_bytes=10 * (8 * 8 * 4 + 9 * 8), max_tokens=8)
    for i in range(30):
        buffer.add(torch.full((21,), i % 5), torch.zeros(20, 8))  # windows cut to 8 tokens
    assert all(seq.features.shape[0] == 8 and seq.tokens.shape[0] == 9 for seq in buffer.sequences)
    assert len(buffer) == 10 and buffer.nbytes <= buffer.max_bytes and buffer.evicted_sequences == 20
    assert buffer.most_frequent(3, 10).tolist()[:1] in ([0], [1], [2], [3], [4])
    # a data set's draft vocabulary, counted without features: by count, then by id; empty rows count nothing
    counted = FeatureBuffer.counting([torch.tensor([3, 3, 1]), [1, 3, 7], []])
    assert counted.most_frequent(4, 10).tolist() == [3, 1, 7, 0] and len(counted) == 0
    with pytest.raises(ValueError, match="tokens \\[L\\+1\\] and features \\[L, H\\]"):
        buffer.add(torch.zeros(5, dtype=torch.long), torch.zeros(5, 8))


def test_draft_vocabulary_is_rebuilt_from_token_frequencies(model):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=4)
    trainer = DrafterTrainer(drafter, model)
    ids = torch.tensor([[9, 9, 9, 9, 7, 7, 7, 5, 5, 3]])
    trainer.add_sequences(ids)
    assert trainer.rebuild_draft_vocab().tolist() == [3, 5, 7, 9]


def test_whole_conversations_of_any_length_enter_the_buffer_as_if_alone(model):
    rows = [torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13, 6, 11)]
    trainer = DrafterTrainer(EagleDrafter.from_target(model), model)
    progress = []
    added = trainer.add_token_rows([r.tolist() for r in rows], batch_rows=2,
                                   on_batch=lambda done, total: progress.append((done, total)))
    assert added == 5 and progress == [(2, 5), (4, 5), (5, 5)]
    assert [len(seq.tokens) for seq in trainer.buffer.sequences] == [4, 6, 9, 11, 13]  # shortest first
    alone = DrafterTrainer(trainer.drafter, model)
    for seq in trainer.buffer.sequences:  # padding beside a row changes neither its tokens nor its features
        alone.add_sequences(seq.tokens[None])
        assert any(torch.equal(seq.tokens, r) for r in rows)
        assert torch.allclose(seq.features, alone.buffer.sequences[-1].features, atol=1e-5)
    kept = DrafterTrainer(trainer.drafter, model)
    kept.add_token_rows(rows, batch_rows=2, sort_by_length=False)
    assert [len(seq.tokens) for seq in kept.buffer.sequences] == [9, 4, 13, 6, 11]


def test_engine_feeds_rollout_features_without_another_forward(model, rollouts):
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model)
    ids, mask = padded_prompts([4, 6], seed=8)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=3))
    engine.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, eos_token_id=EOS,
                    pad_token_id=PAD, feature_sink=trainer.add_features)
    assert len(trainer.buffer) == 2
    reference = DrafterTrainer(drafter, model)
    for seq in trainer.buffer.sequences:
        reference.add_sequences(seq.tokens[None])
    for ours, theirs in zip(trainer.buffer.sequences, reference.buffer.sequences):
        assert torch.equal(ours.tokens, theirs.tokens)
        assert torch.allclose(ours.features, theirs.features, atol=1e-5)


def test_checkpoint_round_trip(model, rollouts, tmp_path):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=16)
    trainer = DrafterTrainer(drafter, model, lr=1e-3)
    trainer.add_sequences(*rollouts)
    trainer.rebuild_draft_vocab()
    trainer.train(max_steps=5)
    trainer.save_checkpoint(tmp_path)

    fresh = EagleDrafter.from_target(model, draft_vocab_size=16)
    resumed = DrafterTrainer(fresh, model, lr=1e-3)
    resumed.load_checkpoint(tmp_path)
    assert resumed.step == 5
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(fresh.d2t, drafter.d2t)
    ours, theirs = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    for key in ours["state"]:
        assert torch.equal(ours["state"][key]["exp_avg"], theirs["state"][key]["exp_avg"])
    # Fields added later (qkv_bias, rope_scaling) are left out while at their defaults, and a checkpoint that
    # names them at their defaults resumes as well.
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert "qkv_bias" not in state["drafter_config"] and "qkv_bias" not in json.loads(
        (tmp_path / "config.json").read_text())
    state["drafter_config"] |= {"qkv_bias": False, "rope_scaling": None}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    DrafterTrainer(EagleDrafter.from_target(model, draft_vocab_size=16), model, lr=1e-3).load_checkpoint(tmp_path)


def test_mismatched_or_corrupt_checkpoints_are_errors(model, rollouts, tmp_path):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=16)
    trainer = DrafterTrainer(drafter, model)
    trainer.add_sequences(*rollouts)
    trainer.train(max_steps=1)
    trainer.save_checkpoint(tmp_path)
    other = DrafterTrainer(EagleDrafter.from_target(model, draft_vocab_size=8), model)
    with pytest.raises(ValueError, match="made for another drafter .*draft_vocab_size"):
        other.load_checkpoint(tmp_path)
    same = DrafterTrainer(EagleDrafter.from_target(model, draft_vocab_size=16), model)
    (tmp_path / "optimizer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="incomplete or corrupt"):
        same.load_checkpoint(tmp_path)
    (tmp_path / "trainer_state.json").write_text("{broken")
    with pytest.raises(ValueError, match="is corrupt"):
        same.load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="trainer_state.json is missing"):
        same.load_checkpoint(tmp_path / "nowhere")
    assert json.loads  # the state file is JSON, readable by people


def test_empty_buffer_is_a_clear_error(model):
    with pytest.raises(ValueError, match="buffer is empty"):
        DrafterTrainer(EagleDrafter.from_target(model), model).train(max_steps=1)


def test_add_sequences_trims_padding_and_keeps_row_order(model):
    """Chunks of similar length, cut to the columns they use, give each row the features of its own forward."""
    drafter = EagleDrafter.from_target(model)
    rows = [[5, 6, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [8, 9], [4, 4, 4, 4, 4], [7], [], []]
    width = 14
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # left-padded prompts, right-padded answers, as a rollout returns them
        left = 2 + i % 3
        ids[i, left : left + len(row)] = torch.tensor(row)
        mask[i, left : left + len(row)] = 1
    trainer = DrafterTrainer(drafter, model)
    widths = []
    decoder_forward = trainer.target.decoder.forward
    trainer.target.decoder.forward = lambda **kw: widths.append(kw["input_ids"].shape[1]) or decoder_forward(**kw)
    try:  # one-token and empty rows have no (feature, next token) pair; a chunk of only an empty row runs none
        assert trainer.add_sequences(ids, mask, chunk=2) == 4
    finally:
        del trainer.target.decoder.forward
    assert widths == [10, 4, 1]  # longest rows first, each chunk cut to the columns its rows use (of 14)
    alone = DrafterTrainer(drafter, model)
    for row in rows[:4]:
        alone.add_sequences(torch.tensor([row]))
    assert [seq.tokens.tolist() for seq in trainer.buffer.sequences] == rows[:4]
    for ours, theirs in zip(trainer.buffer.sequences, alone.buffer.sequences):
        assert torch.allclose(ours.features, theirs.features, atol=1e-5)
    with pytest.raises(ValueError, match="must have input_ids' shape"):
        trainer.add_sequences(ids, mask[:, :-1])


@pytest.mark.parametrize("speculation", ["never", "always"])
def test_the_result_gives_the_rows_the_feature_sink_gets_even_where_pad_is_eos(model, speculation):
    # With pad an EOS, sequences alone cannot tell where a completion ended; completion_lengths can. The rows a
    # caller reads from the result (warm-up and veRL's server, learning the law by a forward) are the sink's.
    drafter = EagleDrafter.from_target(model)
    ids, mask = padded_prompts([3, 7, 5, 6], seed=4)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation=speculation, num_speculative_tokens=3))
    sunk = []
    result = engine.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True, temperature=1.0,
                             eos_token_id=[EOS, *range(5, 13)], pad_token_id=6,
                             generator=torch.Generator().manual_seed(3),
                             feature_sink=lambda tokens, features: sunk.append(tokens.cpu()))
    rows = result.token_rows(mask)
    lengths = result.completion_lengths.tolist()
    assert any(int(row[-1]) == 6 for row in rows)  # completions that end in the pad token (an EOS too)
    assert sorted(map(tuple, map(torch.Tensor.tolist, rows))) == sorted(map(tuple, map(torch.Tensor.tolist, sunk)))
    for row, prompt, keep, n in zip(rows, ids, mask.bool(), lengths):
        assert torch.equal(row[: int(keep.sum())], prompt[keep]) and len(row) == int(keep.sum()) + n
