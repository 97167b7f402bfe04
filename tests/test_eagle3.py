"""Eagle3Drafter: fused low/middle/high features from the passes that run anyway, token-only training with the
policy's cached top-k law, training-time test that matches chained drafting, and the engine stays exact."""

import pytest
import torch
from test_drafter_training import assert_unrolled_matches_chained
from test_engine_sampling import engine_samples, hf_samples, two_sample_pvalue
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import Drafter, DrafterTrainer, Eagle3Drafter, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.eagle3 import default_aux_layers
from tlt_trainers.drafter.losses import chunked_soft_cross_entropy
from tlt_trainers.modeling.features import capture_features
from tlt_trainers.modeling.kv_cache import LayeredKV, RowKV

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)


@pytest.fixture(scope="module")
def rollouts(model):
    ids, mask = padded_prompts([5, 3, 7, 4, 6, 5] * 4, seed=3)
    seqs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD,
                          eos_token_id=None)
    return seqs, torch.cat([mask, torch.ones(len(ids), 30, dtype=torch.long)], dim=1)


@pytest.fixture(scope="module")
def trained(model):
    ids, mask = padded_prompts([5] * 32, seed=0)
    seqs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=PAD,
                          eos_token_id=None)
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainer = DrafterTrainer(drafter, model, lr=3e-3, unroll_steps=2)
    trainer.add_sequences(seqs, torch.cat([mask, torch.ones(32, 40, dtype=torch.long)], dim=1))
    trainer.train(max_steps=150)
    return drafter


def test_features_are_the_residual_streams_entering_the_chosen_layers(model):
    ids = torch.tensor([[3, 7, 9, 4]])
    reference = model(ids, output_hidden_states=True).hidden_states  # [0]: embeddings, [k]: after layer k - 1
    with capture_features(model.get_decoder(), tuple(LAYERS)) as captured:
        model.get_decoder()(input_ids=ids)
    features, final = captured[0]
    assert torch.allclose(features, torch.cat([reference[k] for k in LAYERS], dim=-1))
    assert torch.allclose(final, model.get_decoder()(input_ids=ids).last_hidden_state)


def test_default_layers_follow_vllm_and_small_policies_are_refused(model):
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(6) == [1, 3, 5]  # vLLM's (2, 3, 3) repeats a layer
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Drafter.from_target(tiny_model("llama"))  # 2 layers


def test_fresh_drafter_starts_from_the_policy_head_and_norm(model):
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS, draft_vocab_size=16)
    assert drafter.feature_size == 3 * 32 and drafter.feature_layers == tuple(LAYERS)
    ids = torch.arange(40, 56)
    drafter.set_draft_vocab(ids)
    assert torch.equal(drafter.lm_head.weight, model.get_output_embeddings().weight[ids])
    assert torch.equal(drafter.norm.weight, model.get_decoder().norm.weight)
    assert drafter.target_to_draft()[45].item() == 5 and drafter.target_to_draft()[3].item() == -1


def test_unrolled_steps_compute_what_chained_drafting_computes(model):
    """Step 0 reads the fused policy features [3H], later steps the drafter's own predictions [H]."""
    torch.manual_seed(0)
    assert_unrolled_matches_chained(Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS), feature_width=96)


def test_training_caches_the_policy_targets_and_learns(model, rollouts):
    policy = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainer = DrafterTrainer(drafter, model, lr=3e-3, unroll_steps=2)
    trainer.add_sequences(*rollouts)
    seq = trainer.buffer.sequences[0]
    assert seq.features.shape[1] == 96 and seq.target_ids.shape == (seq.features.shape[0], 16)
    # The cached law at t is the policy's at t + 1: its top-1 is the greedy rollout's next-next token (after the
    # random 5-token prompt of row 0).
    assert torch.equal(seq.target_ids[3:-1, 0].long(), seq.tokens[5:])
    before = trainer.evaluate()
    metrics = trainer.train(max_steps=60)
    after = trainer.evaluate()
    assert metrics["steps"] == 60 and len(metrics["top1_by_step"]) == 2 and metrics["feature_loss"] == 0.0
    assert after["loss"] < before["loss"] and after["top1"] > before["top1"] + 0.2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in policy.items())
    assert model.get_output_embeddings().weight.grad is None


def test_a_deferred_law_is_computed_on_first_training_and_is_the_law_computed_on_arrival(model, rollouts):
    """``add_features(defer_law=True)`` (TRL's vLLM path) keeps the final states and computes nothing on the
    rollout's path; the first micro-batch that reads a sequence computes exactly the law an eager add caches, the
    buffer's byte count follows, and training is then the same. Fails if the law is computed on arrival, or never."""
    seqs, mask = rollouts
    with capture_features(model.get_decoder(), tuple(LAYERS)) as captured:
        model.get_decoder()(input_ids=seqs, attention_mask=mask)
    features, final = captured[0]
    trainers = []
    for defer in (False, True):
        torch.manual_seed(1)
        trainer = DrafterTrainer(Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS), model, lr=3e-3,
                                 unroll_steps=2, seed=0)
        for row, keep in enumerate(mask.bool()):
            trainer.add_features(seqs[row][keep], features[row][keep][:-1], final[row][keep], defer_law=defer)
        trainers.append(trainer)
    eager, deferred = trainers
    pending = deferred.buffer.sequences[0]
    assert pending.target_ids is None and pending.final.shape == (pending.features.shape[0], 32)
    assert deferred.buffer.nbytes > eager.buffer.nbytes  # the final states count against the buffer's cap
    first = deferred.train(max_steps=1)
    settled = sum(s.final is None for s in deferred.buffer.sequences)
    assert 0 < settled <= deferred.micro_batch_size < len(deferred.buffer)  # only what the micro-step read
    assert first["steps"] == 1 and eager.train(max_steps=1)["loss"] == pytest.approx(first["loss"], abs=1e-6)
    deferred.evaluate()  # reads every sequence
    assert deferred.buffer.nbytes == eager.buffer.nbytes
    for a, b in zip(eager.buffer.sequences, deferred.buffer.sequences, strict=True):
        assert b.final is None and torch.equal(a.target_ids, b.target_ids) and torch.equal(a.target_probs,
                                                                                           b.target_probs)


def test_engine_features_train_on_the_sampled_tokens(model):
    """Rollouts from the engine's verify passes carry the aux features (no extra forward) and no cached law:
    the drafter learns the tokens the policy drew."""
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainer = DrafterTrainer(drafter, model, lr=3e-3)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=2))
    ids, mask = padded_prompts([4, 6, 5, 3], seed=5)
    engine.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, eos_token_id=None,
                    pad_token_id=PAD, feature_sink=trainer.add_features, generator=torch.Generator().manual_seed(0))
    assert len(trainer.buffer) == 4
    seq = trainer.buffer.sequences[0]
    assert seq.target_ids is None and seq.features.shape[1] == 96
    with capture_features(model.get_decoder(), tuple(LAYERS)) as captured:
        model.get_decoder()(input_ids=seq.tokens[None])
    assert torch.allclose(seq.features, captured[0][0][0, :-1], atol=1e-4)
    metrics = trainer.train(max_steps=5)
    assert metrics["steps"] == 5 and metrics["loss"] == metrics["loss"]


@pytest.mark.parametrize("drafter_name", ["trained", "two_layers"])  # two_layers: a cache per decoder layer
@pytest.mark.parametrize("strategy", ["chain", "tree"])
def test_greedy_is_identical_to_generate(model, request, drafter_name, strategy):
    drafter = request.getfixturevalue(drafter_name)
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    config = (TLTConfig(speculation="always", strategy="tree:4x2:6") if strategy == "tree"
              else TLTConfig(speculation="always", num_speculative_tokens=4))
    ours = SpeculativeGenerator(model, drafter, config).generate(
        ids, attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=24)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
                               max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens
    assert ours.stats.acceptance_length > 1.2


def test_sampling_matches_generate_distribution():
    model = tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3, num_hidden_layers=6)
    torch.manual_seed(11)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    reference = hf_samples(model, seed=1, temperature=0.9)
    ours, stats = engine_samples(model, drafter, seed=2, temperature=0.9)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_save_load_round_trip_picks_the_class(model, trained, tmp_path):
    trained.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target=model)
    assert isinstance(loaded, Eagle3Drafter) and loaded.config == trained.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trained.state_dict().values()))
    with pytest.raises(ValueError, match="is an Eagle3Drafter and EagleDrafter.from_pretrained loads only"):
        EagleDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="made for another model"):
        Drafter.from_pretrained(tmp_path, target=tiny_model("llama", num_hidden_layers=4))


def test_chunked_cross_entropy_matches_the_dense_one():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    ids, probs = torch.randint(0, 50, (37, 5)), torch.rand(37, 5, dtype=torch.float64)
    upstream = torch.randn(37, dtype=torch.float64)
    losses, argmax = chunked_soft_cross_entropy(hidden, weight, ids, probs, chunk=8)
    dense = -(probs * (hidden @ weight.T).log_softmax(-1).gather(-1, ids)).sum(-1)
    assert torch.allclose(losses.double(), dense, atol=1e-5)
    assert torch.equal(argmax, (hidden @ weight.T).argmax(-1))
    grads = torch.autograd.grad((losses.double() * upstream).sum(), (hidden, weight))
    expected = torch.autograd.grad((dense * upstream).sum(), (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected))


def test_chunked_and_dense_training_losses_agree(model, rollouts):
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainer = DrafterTrainer(drafter, model, unroll_steps=2, precision="float32")
    trainer.add_sequences(*rollouts)
    batch = trainer._batch(list(trainer.buffer.sequences)[:4])
    chunked, metrics = trainer._loss(batch)
    grads = torch.autograd.grad(chunked, list(drafter.parameters()))
    trainer.loss_chunk_size = 0
    dense, dense_metrics = trainer._loss(batch)
    expected = torch.autograd.grad(dense, list(drafter.parameters()))
    assert torch.allclose(chunked, dense, atol=1e-5) and metrics["top1_by_step"] == dense_metrics["top1_by_step"]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected))


def test_a_new_draft_vocabulary_keeps_the_trained_rows(model):
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS, draft_vocab_size=16)
    drafter.set_draft_vocab(torch.arange(10, 26))
    with torch.no_grad():
        drafter.lm_head.weight.fill_(7.0)  # "trained"
    drafter.set_draft_vocab(torch.arange(18, 34))
    assert (drafter.lm_head.weight[:8] == 7.0).all()  # tokens 18..25 stayed
    assert torch.equal(drafter.lm_head.weight[8:], model.get_output_embeddings().weight[26:34])


def test_a_trained_drafter_grows_its_draft_vocabulary_keeping_what_it_learned(model, trained):
    drafter = trained
    vocab = torch.arange(4, 64, 2)  # 30 tokens: some the drafter drafts (all 64 now), half of them dropped
    grown = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS, draft_vocab_size=16)
    grown.load_state_dict({k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "lm_head.weight")},
                          strict=False)
    grown.set_draft_vocab(torch.arange(0, 32, 2))
    with torch.no_grad():
        grown.lm_head.weight.copy_(torch.randn_like(grown.lm_head.weight))  # "trained" rows of tokens 0, 2, .., 30
    bigger = grown.with_draft_vocab(vocab)
    assert bigger.draft_vocab_size == 30 and torch.equal(bigger.d2t, vocab)
    for name, value in grown.state_dict().items():
        if name not in ("d2t", "lm_head.weight"):
            assert torch.equal(bigger.state_dict()[name], value), name
    assert torch.equal(bigger.lm_head.weight[:14], grown.lm_head.weight[2:])  # tokens 4..30 kept their rows
    assert torch.equal(bigger.lm_head.weight[14:], model.get_output_embeddings().weight[32:64:2])
    with pytest.raises(RuntimeError, match="not bound"):
        Eagle3Drafter(grown.config).with_draft_vocab(vocab)


def test_features_of_the_wrong_layers_are_refused_with_the_fix(model):
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainer = DrafterTrainer(drafter, model)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))  # no drafter: final states
    ids, mask = padded_prompts([4, 5], seed=5)
    with pytest.raises(ValueError, match="feature_layers=drafter.feature_layers"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                        feature_sink=trainer.add_features)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                    feature_sink=trainer.add_features, feature_layers=drafter.feature_layers)
    assert len(trainer.buffer) == 2 and trainer.buffer.sequences[0].features.shape[1] == 96


def test_aux_layers_are_three_increasing_ids(model):
    with pytest.raises(ValueError, match="three distinct policy layers"):
        Eagle3Drafter.from_target(model, aux_layer_ids=[3, 1, 5])
    with pytest.raises(ValueError, match="three distinct policy layers"):
        Eagle3Drafter.from_target(model, aux_layer_ids=[1, 5])


@pytest.fixture(scope="module")
def unpadded(model):
    """A trainer whose buffer holds 4 greedy answers to unpadded prompts (positions are token indices)."""
    ids, _ = padded_prompts([5] * 4, seed=1)
    seqs = model.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=PAD, eos_token_id=None)
    torch.manual_seed(0)
    trainer = DrafterTrainer(Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS), model, unroll_steps=2,
                             micro_batch_size=8)
    trainer.add_sequences(seqs)
    trainer.train(max_steps=20)  # a drafter that is neither the policy's head nor random
    return trainer, seqs


def test_sampled_acceptance_is_the_overlap_of_the_drafter_and_policy_laws(model, unpadded):
    """evaluate()'s first-step sampled acceptance is the mean over positions of sum min(p, q) over the policy's
    top-16: computed here from the policy's logits and the drafter's own forward, not from the trainer's batch."""
    trainer, seqs = unpadded
    measured = trainer.evaluate()["sampled_acceptance_by_step"]
    assert len(measured) == 2
    with torch.no_grad():
        law = model(seqs).logits.float().softmax(-1)  # [N, T, V]: the law of token t + 1
        overlaps = []
        for row, seq in zip(range(len(seqs)), trainer.buffer.sequences):
            length = seq.features.shape[0]
            out = trainer.drafter(seq.features[None].float(), seq.tokens[None, 1:], torch.arange(length)[None])
            q = trainer.drafter.logits(out)[0].softmax(-1)  # a draft at t: token t + 2
            top = law[row, 1 : length + 1].topk(16, dim=-1)
            overlaps.append(torch.minimum(q.gather(-1, top.indices), top.values).sum(-1))
    assert measured[0] == pytest.approx(float(torch.cat(overlaps).mean()), abs=2e-3)
    assert 0 < measured[1] < 1


def test_the_tv_term_adds_one_minus_the_overlap_at_each_step(model, unpadded):
    trainer, _ = unpadded
    with_tv = DrafterTrainer(trainer.drafter, model, unroll_steps=2, tv_weight=0.5)
    batch = trainer._batch(list(trainer.buffer.sequences))
    with torch.no_grad():
        plain, metrics = trainer._loss(batch)
        loss, _ = with_tv._loss(batch)
    expected = plain + sum(trainer.unroll_decay**d * 0.5 * (1 - a)
                           for d, a in enumerate(metrics["sampled_acceptance_by_step"]))
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_feature_noise_is_relative_to_each_feature_and_only_in_training(model, unpadded):
    trainer, _ = unpadded
    noisy = DrafterTrainer(trainer.drafter, model, unroll_steps=2, feature_noise=0.1)
    batch = trainer._batch(list(trainer.buffer.sequences))
    moved = noisy._with_feature_noise(batch).hidden - batch.hidden
    ratio = moved.pow(2).mean(-1).sqrt() / batch.hidden.pow(2).mean(-1).sqrt()
    assert ratio.mean() == pytest.approx(0.1, rel=0.1)
    noisy.buffer = trainer.buffer
    assert noisy.evaluate()["loss"] == pytest.approx(trainer.evaluate()["loss"])  # evaluation sees clean features
    with pytest.raises(ValueError, match="must be >= 0"):
        DrafterTrainer(trainer.drafter, model, feature_noise=-0.1)


def test_feature_cache_computes_each_conversation_once_and_fills_the_same_buffer(model, tmp_path):
    from tlt_trainers.drafter.feature_cache import FeatureCache

    rows = [torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13, 6, 11)]
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    fresh = DrafterTrainer(drafter, model, max_tokens_per_sequence=10)  # the 11- and 13-token rows are windowed
    fresh.add_token_rows(rows, batch_rows=2)
    cached = DrafterTrainer(drafter, model, max_tokens_per_sequence=10)
    cache = FeatureCache.for_trainer(tmp_path, cached)
    assert cache.fill(cached, rows[:3], batch_rows=2) == {"cached": 0, "computed": 3}
    again = DrafterTrainer(drafter, model, max_tokens_per_sequence=10)
    assert cache.fill(again, rows, batch_rows=2) == {"cached": 3, "computed": 2}  # a folder that gained rows
    # the same order and data; a forward's batch partners (padding) move the features' last bits only
    for ours, theirs in zip(again.buffer.sequences, fresh.buffer.sequences, strict=True):
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.target_ids, theirs.target_ids)
        assert torch.allclose(ours.features, theirs.features, atol=1e-5)
        assert torch.allclose(ours.target_probs.float(), theirs.target_probs.float(), atol=1e-3)
    assert again.buffer.token_counts.tolist() == fresh.buffer.token_counts.tolist()
    # another window (or policy, layers, dtype) is another cache
    other = DrafterTrainer(drafter, model, max_tokens_per_sequence=12)
    assert FeatureCache.for_trainer(tmp_path, other).fill(other, rows[:1]) == {"cached": 0, "computed": 1}


def test_a_feature_pass_killed_midway_keeps_its_finished_batches(model, tmp_path):
    from tlt_trainers.drafter.feature_cache import FeatureCache

    rows = [torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13, 6, 11)]
    trainer = DrafterTrainer(Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS), model)
    cache = FeatureCache.for_trainer(tmp_path, trainer)

    def killed(done: int, total: int) -> None:
        if done >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.fill(trainer, rows, batch_rows=2, on_batch=killed)
    resumed = DrafterTrainer(trainer.drafter, model)
    assert cache.fill(resumed, rows, batch_rows=2) == {"cached": 2, "computed": 3} and len(resumed.buffer) == 5
    with pytest.raises(ValueError, match="fewer than two tokens"):
        cache.fill(resumed, [torch.tensor([5])])


def test_reading_cached_features_gives_the_freed_host_memory_back_as_it_goes(model, tmp_path, monkeypatch):
    import tlt_trainers.drafter.feature_cache as feature_cache

    rows = [torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13, 6, 11)]
    trainer = DrafterTrainer(Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS), model)
    cache = feature_cache.FeatureCache.for_trainer(tmp_path, trainer)
    cache.fill(trainer, rows)
    released = []  # the buffer's size at each release: every RELEASE_EVERY conversations read, and at the end
    monkeypatch.setattr(feature_cache, "RELEASE_EVERY", 2)
    monkeypatch.setattr(feature_cache, "release_freed_host_memory", lambda: released.append(len(again.buffer)))
    again = DrafterTrainer(trainer.drafter, model)
    assert cache.fill(again, rows) == {"cached": 5, "computed": 0}
    assert released == [2, 4, 5]


def test_a_bfloat16_buffer_holds_the_features_in_half_the_memory_and_the_cache_stays_float32(model, tmp_path):
    from tlt_trainers.drafter.buffer import FeatureBuffer
    from tlt_trainers.drafter.feature_cache import FeatureCache

    rows = [torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13, 6, 11)]
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)

    def trainer(dtype):
        made = DrafterTrainer(drafter, model, seed=0)
        made.buffer = FeatureBuffer(made.buffer.max_bytes, made.buffer.max_tokens, feature_dtype=dtype)
        return made

    half = trainer(torch.bfloat16)  # computes the features: the cache still gets the policy's float32 ones
    cache = FeatureCache.for_trainer(tmp_path, half)
    float32_held = []  # by the pass's own buffer after each batch is saved: none (a folder's would not fit)
    assert cache.fill(half, rows, batch_rows=2, on_batch=lambda done, total: float32_held.append(
        len(half.buffer.sequences))) == {"cached": 0, "computed": 5}
    assert float32_held == [0, 0, 0]
    assert torch.load(cache.path(rows[0]))["features"].dtype == torch.float32
    full = trainer(None)
    assert cache.fill(full, rows, batch_rows=2) == {"cached": 5, "computed": 0}
    for ours, theirs in zip(half.buffer.sequences, full.buffer.sequences, strict=True):
        assert ours.features.dtype == torch.bfloat16 and theirs.features.dtype == torch.float32
        assert torch.equal(ours.features, theirs.features.to(torch.bfloat16))
    feature_bytes = [sum(s.features.numel() * s.features.element_size() for s in t.buffer.sequences)
                     for t in (half, full)]
    assert feature_bytes[0] * 2 == feature_bytes[1] and half.buffer.nbytes < full.buffer.nbytes
    # training batches are cast back to the policy's dtype: the loss moves by bfloat16 rounding only
    assert half.evaluate()["loss"] == pytest.approx(full.evaluate()["loss"], rel=2e-2)
    with pytest.raises(ValueError, match="floating dtype"):
        FeatureBuffer(feature_dtype=torch.int8)


# ------------------------------------------------------------------------------------------------ two layers
@pytest.fixture(scope="module")
def two_layers(model, trained):
    """The trained one-layer drafter with a second layer stacked on it, trained on."""
    ids, mask = padded_prompts([5] * 32, seed=0)
    seqs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=PAD,
                          eos_token_id=None)
    torch.manual_seed(0)
    drafter = trained.stacked(2)
    trainer = DrafterTrainer(drafter, model, lr=3e-3, unroll_steps=2)
    trainer.add_sequences(seqs, torch.cat([mask, torch.ones(32, 40, dtype=torch.long)], dim=1))
    trainer.train(max_steps=40)
    return drafter


def test_a_two_layer_drafter_unrolls_what_it_drafts_with_a_cache_per_layer(model):
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS, num_hidden_layers=2)
    kv = drafter.new_kv(8)
    assert isinstance(kv, LayeredKV) and len(kv.layers) == 2
    assert_unrolled_matches_chained(drafter, feature_width=96)
    for wrong in (LayeredKV(8, 3), RowKV(8)):  # a single RowKV would be shared by both layers
        with pytest.raises(ValueError, match="make it with drafter.new_kv"):
            drafter(torch.randn(1, 2, 96), torch.tensor([[4, 5]]), torch.arange(2)[None], None, wrong,
                    torch.arange(2)[None], 2)


def test_a_stacked_layer_starts_as_a_pass_through_and_training_grows_it(model, trained, two_layers):
    deeper = trained.stacked(2)
    hidden, tokens, positions = torch.randn(2, 7, 96), torch.randint(3, 64, (2, 7)), torch.arange(7).expand(2, -1)
    with torch.no_grad():
        assert torch.equal(deeper(hidden, tokens, positions), trained(hidden, tokens, positions))
    assert deeper.midlayer.self_attn.q_proj.weight.data_ptr() != trained.midlayer.self_attn.q_proj.weight.data_ptr()
    grown = two_layers.later_layers[0]
    assert grown.self_attn.o_proj.weight.abs().sum() > 0 and grown.mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="already has 2 layers"):
        two_layers.stacked(2)


def test_a_two_layer_drafter_saves_and_loads(model, two_layers, tmp_path):
    two_layers.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target=model)
    assert isinstance(loaded, Eagle3Drafter) and loaded.config.num_hidden_layers == 2
    assert loaded.state_dict().keys() == two_layers.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), two_layers.state_dict().values()))
    with pytest.raises(ValueError, match="EagleDrafter has one decoder layer"):
        EagleDrafter.from_target(model, num_hidden_layers=2)
