"""EagleDrafter and DrafterTrainer on tiny models: binding to the policy, persistence, draft vocabulary, training."""

import json
import math
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_models import PAD, padded_prompts, tiny_model

from tlt_trainers import DrafterTrainer, EagleDrafter, EagleDrafterConfig

KINDS = ["llama", "qwen2", "qwen3", "gemma", "gemma2"]


def drafter_inputs(drafter, batch=2, length=5, seed=0):
    """Random policy features, next tokens and positions for a drafter forward."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, drafter.config.hidden_size, generator=gen)
    tokens = torch.randint(0, drafter.config.vocab_size, (batch, length), generator=gen)
    positions = torch.arange(length).expand(batch, -1)
    return hidden, tokens, positions


def perturbed(drafter, seed=0):
    """Make every weight of the drafter distinct from its init (norms start at exactly one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return drafter


def snapshot(module):
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def assert_same_tensors(module, before):
    now = dict([*module.named_parameters(), *module.named_buffers()])
    assert now.keys() == before.keys()
    for name, tensor in now.items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name


def greedy_data(model, prompts=16, new_tokens=24, seed=0):
    """The policy's own greedy continuations of random prompts, with their attention mask."""
    lengths = [3 + i % 3 for i in range(prompts)]
    ids, mask = padded_prompts(lengths, vocab_size=model.config.vocab_size, seed=seed)
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)
    full = torch.cat([mask, torch.ones(len(ids), seqs.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    return seqs, full


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot when another process holds the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model("llama", logit_scale=4.0)


# ------------------------------------------------------------------------------------------------ from_target
@pytest.mark.parametrize("kind", KINDS)
def test_from_target_reads_through_the_policy(kind):
    model = tiny_model(kind)
    drafter = EagleDrafter.from_target(model)
    config = model.config
    assert drafter.config.hidden_size == config.hidden_size
    assert drafter.config.vocab_size == config.vocab_size
    assert drafter.config.target_model_type == kind
    assert drafter.draft_vocab_size == config.vocab_size and drafter.d2t is None

    # Embedding: the policy's own module, with Gemma's sqrt(hidden) scaling.
    tokens = torch.randint(0, config.vocab_size, (2, 7))
    embedded = drafter.embed(tokens)
    assert torch.equal(embedded, model.get_input_embeddings()(tokens))
    raw = model.get_input_embeddings().weight[tokens]
    scale = math.sqrt(config.hidden_size) if kind.startswith("gemma") else 1.0
    torch.testing.assert_close(embedded, raw * scale)

    # Head: F.linear with the policy's LM head, soft-capped like the model's forward (gemma2: 5.0).
    pred = torch.randn(2, 7, config.hidden_size) * 50  # large enough for gemma2's cap to bite
    expected = F.linear(pred, model.lm_head.weight).float()
    softcap = getattr(config, "final_logit_softcapping", None)
    assert drafter.config.final_logit_softcapping == softcap
    if softcap is not None:
        expected = torch.tanh(expected / softcap) * softcap
    logits = drafter.logits(pred)
    assert logits.dtype == torch.float32 and logits.shape == (2, 7, config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    if kind == "gemma2":
        assert logits.abs().max() < 5.0 < F.linear(pred, model.lm_head.weight).abs().max()

    # On the policy's real final hidden states the drafter's head gives exactly the policy's logits.
    ids = torch.randint(3, config.vocab_size, (1, 6))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        torch.testing.assert_close(drafter.logits(hidden), model(input_ids=ids).logits.float(), rtol=1e-5, atol=1e-5)
        hidden_in, next_tokens, positions = drafter_inputs(drafter)
        assert drafter(hidden_in, next_tokens, positions).shape == hidden_in.shape


def test_from_target_settings():
    model = tiny_model("llama")
    drafter = EagleDrafter.from_target(model, draft_vocab_size=16, intermediate_size=48)
    assert drafter.config.draft_vocab_size == 16 and drafter.config.intermediate_size == 48
    assert drafter.d2t.dtype == torch.long and torch.equal(drafter.d2t, torch.arange(16))
    with pytest.raises(TypeError, match=r"unknown settings \['num_layers'\]"):
        EagleDrafter.from_target(model, num_layers=2)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=rf"draft_vocab_size={bad} must be in \(0, vocab_size=64\]"):
            EagleDrafter.from_target(model, draft_vocab_size=bad)


def test_from_target_follows_the_policy_dtype():
    model = tiny_model("llama").to(torch.bfloat16)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=8)
    assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())
    assert drafter.d2t.dtype == torch.long
    assert drafter.logits(torch.randn(1, 2, 32, dtype=torch.bfloat16)).dtype == torch.float32


# ------------------------------------------------------------------------------------------------ by reference
@pytest.mark.parametrize("kind", ["llama", "gemma"])  # gemma: tied embedding and head
def test_policy_embedding_and_head_are_held_by_reference(kind):
    model = tiny_model(kind)
    drafter = EagleDrafter.from_target(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert drafter.target.embed is embed and drafter.target.head is head
    assert drafter.head_weight().data_ptr() == head.weight.data_ptr()
    assert not drafter.head_weight().requires_grad, "the drafter must see the policy's head as frozen"

    policy_ptrs = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    own = [*drafter.parameters(), *drafter.state_dict().values()]
    assert own and not any(t.data_ptr() in policy_ptrs for t in own)
    names = list(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n or n.startswith("_target") for n in names), names
    own_modules = ("fc.", "input_layernorm.", "self_attn.", "post_attention_layernorm.", "mlp.")
    assert all(n.startswith(own_modules) for n, _ in drafter.named_parameters())
    assert not any(m is embed or m is head for m in drafter.modules())

    # Moving or freezing the drafter leaves the policy alone.
    before = snapshot(model)
    drafter.to(torch.float64).requires_grad_(False)
    assert embed.weight.dtype == head.weight.dtype == torch.float32
    assert embed.weight.requires_grad and head.weight.requires_grad
    assert_same_tensors(model, before)


def test_draft_vocab_head_is_a_detached_slice(model):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=8)
    drafter.set_draft_vocab(torch.tensor([9, 3, 5, 60, 7, 11, 40, 2]))
    assert torch.equal(drafter.d2t, torch.tensor([2, 3, 5, 7, 9, 11, 40, 60]))
    assert torch.equal(drafter.head_weight(), model.lm_head.weight[drafter.d2t])
    assert not drafter.head_weight().requires_grad
    assert torch.equal(drafter.to_target_ids(torch.tensor([0, 7, 4])), torch.tensor([2, 60, 9]))
    pred = torch.randn(3, 32)
    torch.testing.assert_close(drafter.logits(pred), F.linear(pred, model.lm_head.weight)[:, drafter.d2t],
                               rtol=0, atol=1e-6)


def test_unbound_drafter_says_how_to_bind(model):
    drafter = EagleDrafter(EagleDrafter.from_target(model).config)
    with pytest.raises(RuntimeError, match=r"not bound to a policy: call drafter\.bind\(model\)"):
        drafter.logits(torch.randn(1, 32))
    assert drafter.bind(model) is drafter and drafter.target.head is model.lm_head


# ------------------------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_save_and_load_round_trip(tmp_path, kind):
    model = tiny_model(kind)
    drafter = perturbed(EagleDrafter.from_target(model, draft_vocab_size=16))
    vocab = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:16]
    drafter.set_draft_vocab(vocab)
    drafter.save_pretrained(tmp_path / "drafter")

    files = sorted(p.name for p in (tmp_path / "drafter").iterdir())
    assert files == ["config.json", "model.safetensors"]  # no pickle: nothing to unpickle on load
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architecture"] == "EagleDrafter" and config["draft_vocab_size"] == 16
    assert config["target_model_type"] == kind
    assert config["final_logit_softcapping"] == (5.0 if kind == "gemma2" else None)
    stored = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert stored.keys() == drafter.state_dict().keys()

    loaded = EagleDrafter.from_pretrained(tmp_path / "drafter", target=model)
    assert loaded.config == drafter.config
    assert loaded.target.head is model.get_output_embeddings()
    assert_same_tensors(loaded, snapshot(drafter))
    assert torch.equal(loaded.d2t, vocab.sort().values)

    hidden, tokens, positions = drafter_inputs(drafter)
    with torch.no_grad():
        expected = drafter.logits(drafter(hidden, tokens, positions))
        assert torch.equal(loaded.logits(loaded(hidden, tokens, positions)), expected)


def test_load_without_target_then_bind(tmp_path, model):
    drafter = perturbed(EagleDrafter.from_target(model))
    drafter.save_pretrained(str(tmp_path))  # str paths work too
    loaded = EagleDrafter.from_pretrained(str(tmp_path))
    assert loaded._target is None
    assert_same_tensors(loaded, snapshot(drafter))
    loaded.bind(model)
    pred = torch.randn(2, 32)
    assert torch.equal(loaded.logits(pred), drafter.logits(pred))


def test_load_for_a_lower_precision_policy(tmp_path, model):
    drafter = perturbed(EagleDrafter.from_target(model, draft_vocab_size=8))
    drafter.save_pretrained(tmp_path)
    policy = tiny_model("llama").to(torch.bfloat16)
    loaded = EagleDrafter.from_pretrained(tmp_path, target=policy)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.d2t.dtype == torch.long and torch.equal(loaded.d2t, drafter.d2t)


# ------------------------------------------------------------------------------------------------ mismatches
def test_drafter_for_another_hidden_size(tmp_path, model):
    other = tiny_model("llama", hidden_size=48)
    drafter = EagleDrafter.from_target(other)
    message = r"hidden_size=48 does not match the policy's 32.*EagleDrafter\.from_target\(model\)"
    with pytest.raises(ValueError, match=message):
        drafter.bind(model)
    with pytest.raises(ValueError, match=message):
        EagleDrafter(drafter.config, target=model)
    with pytest.raises(ValueError, match=message):
        DrafterTrainer(drafter, model)
    drafter.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        EagleDrafter.from_pretrained(tmp_path, target=model)


def test_drafter_for_another_vocabulary(tmp_path, model):
    drafter = EagleDrafter.from_target(tiny_model("llama", vocab_size=80))
    message = r"vocab_size=80 does not match the policy's LM head \(64 tokens\).*EagleDrafter\.from_target\(model\)"
    with pytest.raises(ValueError, match=message):
        drafter.bind(model)
    drafter.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        EagleDrafter.from_pretrained(tmp_path, target=model)


def test_drafter_for_another_logit_transform():
    drafter = EagleDrafter.from_target(tiny_model("gemma2"))  # soft-capped at 5.0; gemma is not
    with pytest.raises(ValueError, match=r"soft-capping/scale differs.*EagleDrafter\.from_target\(model\)"):
        drafter.bind(tiny_model("gemma"))


def test_trainer_rebinds_a_drafter_bound_elsewhere(model):
    """A drafter bound to a same-shaped other policy is trained against the trainer's policy, not the other."""
    drafter = EagleDrafter.from_target(tiny_model("llama", seed=5))
    DrafterTrainer(drafter, model)
    assert drafter.target.head is model.get_output_embeddings()


# ------------------------------------------------------------------------------------------------ broken files
@pytest.fixture
def saved(tmp_path, model):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=8)
    drafter.save_pretrained(tmp_path)
    return tmp_path


def _edit_config(directory, **changes):
    path = Path(directory, "config.json")
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _edit_weights(directory, edit):
    path = str(Path(directory, "model.safetensors"))
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_missing_weights_file(saved, model):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is missing; the drafter at .* is incomplete"):
        EagleDrafter.from_pretrained(saved, target=model)


def test_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"No drafter config at .*config\.json; save one with"):
        EagleDrafter.from_pretrained(saved)


def test_missing_directory(tmp_path):
    """A local path that does not exist is reported as such, not sent to the Hub as a repo id."""
    with pytest.raises(FileNotFoundError, match="No drafter directory at"):
        EagleDrafter.from_pretrained(tmp_path / "nowhere" / "drafter")
    with pytest.raises(FileNotFoundError, match="No drafter directory at"):
        EagleDrafter.from_pretrained("./no-such-drafter")


def test_config_of_another_architecture(saved):
    _edit_config(saved, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"is not a drafter config of this package \(architecture='LlamaForCausalLM'"):
        EagleDrafter.from_pretrained(saved)


def test_config_without_architecture(saved):
    _edit_config(saved, architecture=None)
    with pytest.raises(ValueError, match=r"is not a drafter config of this package \(architecture=None"):
        EagleDrafter.from_pretrained(saved)


def test_config_with_unknown_or_missing_fields(saved):
    _edit_config(saved, num_layers=3)
    with pytest.raises(ValueError, match=r"Unknown EagleDrafterConfig fields \['num_layers'\]: .*newer version"):
        EagleDrafter.from_pretrained(saved)
    _edit_config(saved, num_layers=None, hidden_size=None)
    with pytest.raises(ValueError, match=r"missing required fields \['hidden_size'\]"):
        EagleDrafter.from_pretrained(saved)


def test_config_not_json(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        EagleDrafter.from_pretrained(saved)


def test_weights_missing_a_tensor(saved):
    _edit_weights(saved, lambda state: state.pop("fc.weight"))
    with pytest.raises(ValueError, match=r"do not match its config \(missing \['fc\.weight'\], unexpected \[\]\)"):
        EagleDrafter.from_pretrained(saved)


def test_weights_missing_the_draft_vocabulary(saved):
    _edit_weights(saved, lambda state: state.pop("d2t"))
    with pytest.raises(ValueError, match=r"missing \['d2t'\]"):
        EagleDrafter.from_pretrained(saved)


def test_weights_with_a_policy_tensor(saved):
    _edit_weights(saved, lambda state: state.update({"lm_head.weight": torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"unexpected \['lm_head\.weight'\]"):
        EagleDrafter.from_pretrained(saved)


def test_weights_of_the_wrong_shape(saved):
    _edit_weights(saved, lambda state: state.update({"fc.weight": torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"(?s)do not match its config: .*size mismatch for fc\.weight"):
        EagleDrafter.from_pretrained(saved)


# ------------------------------------------------------------------------------------------------ draft vocabulary
def test_set_draft_vocab_rejects_bad_ids(model):
    drafter = EagleDrafter.from_target(model, draft_vocab_size=4)
    with pytest.raises(ValueError, match=r"exactly draft_vocab_size=4 ids"):
        drafter.set_draft_vocab(torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="must be distinct token ids"):
        drafter.set_draft_vocab(torch.tensor([3, 4, 4, 5]))
    for out_of_range in ([3, 4, 5, 64], [-1, 3, 4, 5]):
        with pytest.raises(ValueError, match="must be distinct token ids of the policy's vocabulary"):
            drafter.set_draft_vocab(torch.tensor(out_of_range))
    assert torch.equal(drafter.d2t, torch.arange(4)), "a rejected vocabulary leaves the old one in place"
    full = EagleDrafter.from_target(model)
    with pytest.raises(ValueError, match="a drafter created with draft_vocab_size < vocab_size"):
        full.set_draft_vocab(torch.arange(64))


def test_draft_head_follows_the_policy_head(model):
    """The cached head slice is re-cut whenever the policy's head changes: in place, by an optimizer, by
    load_state_dict, by a new Parameter, or by a new draft vocabulary."""
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    drafter = EagleDrafter.from_target(model, draft_vocab_size=8)
    drafter.set_draft_vocab(torch.arange(10, 18))
    pred = torch.randn(3, 32)

    def check():
        expected = F.linear(pred, head.weight.detach()[drafter.d2t])
        torch.testing.assert_close(drafter.logits(pred), expected, rtol=0, atol=1e-6)

    check()
    cached = drafter.head_weight()
    assert drafter.head_weight() is cached, "unchanged head: the slice is reused"
    with torch.no_grad():
        head.weight.mul_(2.0)
    check()
    head.weight.grad = torch.randn_like(head.weight)
    torch.optim.SGD([head.weight], lr=0.5).step()
    check()
    model.load_state_dict({**model.state_dict(), "lm_head.weight": torch.randn(64, 32)})
    check()
    head.weight = torch.nn.Parameter(torch.randn(64, 32))
    check()
    drafter.set_draft_vocab(torch.arange(30, 38))
    check()


# ------------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def data(model):
    return greedy_data(model)


def eval_loss(trainer, ids, mask):
    """Loss on exactly these sequences, through a scratch buffer so the trainer's own stays as it is."""
    scratch = DrafterTrainer(trainer.drafter, trainer.model, micro_batch_size=trainer.micro_batch_size)
    scratch.add_sequences(ids, mask)
    return scratch.evaluate()


def test_training_lowers_the_loss_on_the_policys_outputs(model, data):
    ids, mask = data
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model, lr=3e-3)
    before = eval_loss(trainer, ids, mask)
    metrics = trainer.train_on_sequences(ids, mask, max_steps=40)
    after = eval_loss(trainer, ids, mask)
    assert metrics["steps"] == 40 and trainer.step == 40 and metrics["seconds"] > 0
    assert {"loss", "feature_loss", "token_loss", "top1"} <= metrics.keys()
    assert after["loss"] < 0.75 * before["loss"]
    assert after["token_loss"] < before["token_loss"] and after["top1"] > before["top1"] + 0.2
    assert not drafter.training


def test_budgets(model, data):
    ids, mask = data
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model, micro_batch_size=5)
    assert trainer.train_on_sequences(ids, mask)["steps"] == math.ceil(len(ids) / 5)  # no budget: one epoch
    assert trainer.train_on_sequences(ids, mask, max_steps=3)["steps"] == 3
    assert trainer.train_on_sequences(ids, mask, max_seconds=0.0)["steps"] == 0
    assert trainer.step == math.ceil(len(ids) / 5) + 3


def test_should_stop_ends_training_within_one_micro_step(model, data):
    ids, mask = data
    drafter = EagleDrafter.from_target(model)
    trainer = DrafterTrainer(drafter, model)
    before = snapshot(drafter)
    assert trainer.train_on_sequences(ids, mask, max_steps=100, should_stop=lambda: True)["steps"] == 0
    assert_same_tensors(drafter, before)

    # The other ranks finish while micro-step 2 runs: training ends right after it.
    stop, updates = [], []
    step = trainer.optimizer.step

    def step_and_maybe_finish(*args, **kwargs):
        updates.append(1)
        if len(updates) == 2:
            stop.append(True)
        return step(*args, **kwargs)

    trainer.optimizer.step = step_and_maybe_finish
    metrics = trainer.train_on_sequences(ids, mask, max_steps=100, should_stop=lambda: bool(stop))
    assert metrics["steps"] == 2 and len(updates) == 2


@pytest.mark.parametrize("kind, draft_vocab_size", [("llama", None), ("llama", 16), ("gemma", None)])
def test_training_leaves_the_policy_bit_identical(kind, draft_vocab_size):
    model = tiny_model(kind, logit_scale=4.0)
    ids, mask = greedy_data(model, prompts=9, new_tokens=12)
    before = snapshot(model)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=draft_vocab_size)
    drafter_before = snapshot(drafter)
    DrafterTrainer(drafter, model, lr=1e-2).train_on_sequences(ids, mask, max_steps=5)
    assert_same_tensors(model, before)
    assert all(p.grad is None for p in model.parameters()), "drafter training must not put gradients in the policy"
    changed = [n for n, p in drafter.named_parameters() if not torch.equal(p, drafter_before[n])]
    assert changed, "the drafter itself did train"


# ------------------------------------------------------------------------------------------------ Hub
def test_push_to_hub_uploads_a_loadable_folder(tmp_path, monkeypatch, model):
    """Only the Hub's network is mocked: ``HfApi.create_repo`` and ``HfApi.upload_folder`` record their calls and
    copy the uploaded folder to a local "hub"; everything else (saving, the folder's contents, loading) is real."""
    calls, hub = [], tmp_path / "hub"

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls.append(("upload_folder", repo_id, kwargs))
        shutil.copytree(folder_path, hub / repo_id)
        return f"https://huggingface.co/{repo_id}/commit/0123abc"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)

    drafter = perturbed(EagleDrafter.from_target(model, draft_vocab_size=8))
    drafter.set_draft_vocab(torch.arange(20, 28))
    url = drafter.push_to_hub("someone/tiny-drafter", private=True, commit_message="drafter after step 100")
    assert url == "https://huggingface.co/someone/tiny-drafter/commit/0123abc"
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1] == "someone/tiny-drafter" and calls[0][2]["private"] is True and calls[0][2]["exist_ok"]
    assert calls[1][2]["commit_message"] == "drafter after step 100"

    uploaded = hub / "someone" / "tiny-drafter"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = EagleDrafter.from_pretrained(uploaded, target=model)
    assert_same_tensors(loaded, snapshot(drafter))
    pred = torch.randn(2, 32)
    assert torch.equal(loaded.logits(pred), drafter.logits(pred))


def test_from_pretrained_downloads_a_repo_id(tmp_path, monkeypatch, model):
    """Only the Hub's network is mocked: ``snapshot_download`` returns a local folder as if downloaded."""
    drafter = perturbed(EagleDrafter.from_target(model))
    drafter.save_pretrained(tmp_path / "snapshot")
    requested = []

    def snapshot_download(repo_id, **kwargs):
        requested.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = EagleDrafter.from_pretrained("someone/tiny-drafter", target=model, revision="v1")
    from tlt_trainers.drafter.hub import DRAFTER_FILES

    assert requested == [("someone/tiny-drafter", {"revision": "v1", "allow_patterns": list(DRAFTER_FILES)})]
    assert_same_tensors(loaded, snapshot(drafter))
    assert isinstance(loaded.config, EagleDrafterConfig)
