"""Online drafter updates keep acceptance up while the policy moves; warm-up makes a fresh drafter useful."""

import torch
from tiny_models import PAD, char_tokenizer, padded_prompts, tiny_model

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.warmup import warmup_drafter


def rollout(model, drafter, trainer=None, seed=0, rows=16, new_tokens=24, k=4):
    """Greedy rollout of fresh prompts; returns the acceptance length and feeds the trainer if given."""
    ids, mask = padded_prompts([5] * rows, seed=seed)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=k))
    res = engine.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD, feature_sink=trainer.add_features if trainer else None)
    return res.stats.acceptance_length, res.sequences


def move_policy(model, steps=60, lr=3e-2, seed=1):
    """SFT the policy on another model's outputs: its greedy behaviour changes, as it does under RL."""
    teacher = tiny_model("llama", logit_scale=4.0, seed=seed)
    ids, mask = padded_prompts([5] * 32, seed=seed)
    data = teacher.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD,
                            eos_token_id=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        rows = torch.arange(8) + (step * 8) % 32
        labels = data[rows].clone()
        labels[:, : ids.shape[1]] = -100
        loss = model(input_ids=data[rows], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def test_online_updates_recover_acceptance_after_the_policy_moves():
    torch.manual_seed(0)
    model = tiny_model("llama", logit_scale=4.0)
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model, lr=3e-3, buffer_bytes=1 << 20, unroll_steps=2)
    rollout(model, drafter, trainer, seed=10, rows=32, new_tokens=40)
    trainer.train(max_steps=200)
    aligned, _ = rollout(model, drafter, seed=20)

    _, before_move = rollout(model, drafter, seed=20)
    move_policy(model)
    stale, after_move = rollout(model, drafter, seed=20)
    assert not torch.equal(before_move, after_move), "the policy must really have changed"

    trainer.buffer.clear()  # recent rollouts only: the old policy's are stale
    rollout(model, drafter, trainer, seed=11, rows=32, new_tokens=40)
    trainer.train(max_steps=200)
    refreshed, _ = rollout(model, drafter, seed=20)
    print(f"acceptance: aligned {aligned:.2f}, stale after the policy moved {stale:.2f}, refreshed {refreshed:.2f}")
    assert stale < aligned - 0.25, (aligned, stale)
    assert refreshed > stale + 0.25, (stale, refreshed)


def test_warmup_makes_a_fresh_drafter_accept_more():
    model = tiny_model("llama", logit_scale=4.0, vocab_size=64)
    tokenizer = char_tokenizer(64)
    generator = torch.Generator().manual_seed(0)
    words = ["add", "sum", "two", "ten", "what", "is", "plus", "one"]
    prompts = [" ".join(words[i] for i in torch.randint(len(words), (4,), generator=generator).tolist())
               for _ in range(40)]
    drafter, report = warmup_drafter(
        model, tokenizer, prompts[:32], draft_vocab_size=32, max_new_tokens=24, batch_size=16, train_seconds=8,
        unroll_steps=2, lr=3e-3, eval_prompts=prompts[32:], eval_new_tokens=16, show_progress=False,
        log=lambda *_: None)
    assert drafter.config.draft_vocab_size == 32 and report.answer_tokens > 0
    before = report.acceptance_before["t0"]["acceptance_length"]
    after = report.acceptance_after["t0"]["acceptance_length"]
    assert after > before + 0.3, (before, after)
    assert report.training["steps"] > 0


def test_warmup_teaches_an_eagle3_drafter_the_policys_law(monkeypatch):
    """The engine hands the warm-up features and sampled tokens only; an EAGLE-3 drafter's answers go through one
    policy forward so that it trains on the policy's top-k law, as the shipped drafters did."""
    from tlt_trainers import DrafterTrainer, Eagle3Drafter

    seen = []
    train = DrafterTrainer.train

    def recording(self, *args, **kwargs):
        seen.extend(self.buffer.sequences)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(DrafterTrainer, "train", recording)
    model = tiny_model("llama", logit_scale=4.0, vocab_size=64, num_hidden_layers=6)
    drafter, report = warmup_drafter(model, char_tokenizer(64), ["add two", "sum ten one", "what is plus"],
                                     architecture="eagle3", max_new_tokens=8, train_seconds=0.2,
                                     temperatures=(1.0,), show_progress=False, log=lambda *_: None)
    assert isinstance(drafter, Eagle3Drafter) and report.training["steps"] > 0
    assert len(seen) == 3 and all(seq.target_ids is not None for seq in seen)
