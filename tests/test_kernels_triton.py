"""The Triton verification kernels against the torch path, fed the same inputs and uniforms.

Runs under Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set by tests/conftest.py): decisions
(drafts kept, path through the tree) must be identical, and so must the sampled tokens for these seeds (the
kernel's block sums differ from ``cumsum`` only within rounding, see ``tlt_trainers/kernels/verify_triton.py``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_kernels_reference import chain_case, random_dist  # noqa: E402

from tlt_trainers.sampling import verify_sampled_with_uniforms  # noqa: E402
from tlt_trainers.sampling.tree import DraftTree, verify_tree  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA, or TRITON_INTERPRET=1 set before triton is first imported "
                "(tests/conftest.py "
                "sets it)", allow_module_level=True)

from tlt_trainers.kernels import verify_chain_triton as _chain_kernel  # noqa: E402
from tlt_trainers.kernels import verify_tree_triton as _tree_kernel  # noqa: E402

# Where Triton runs the kernels: the GPU, or the CPU under the interpreter (how the suite runs without a GPU)
KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def on_kernel_device(launcher):
    """``launcher`` fed its tensors on the kernels' device; its results come back to the CPU, where the torch path's
    are compared with them."""

    def run(*args):
        out = launcher(*(a.to(KERNEL_DEVICE) if torch.is_tensor(a) else a for a in args))
        if dataclasses.is_dataclass(out):
            return dataclasses.replace(out, **{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
                                               if torch.is_tensor(getattr(out, f.name))})
        return tuple(t.cpu() for t in out)

    return run


verify_chain_triton, verify_tree_triton = on_kernel_device(_chain_kernel), on_kernel_device(_tree_kernel)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_vocab", [None, 13])
@pytest.mark.parametrize("vocab", [32, 1500])  # one block, and several blocks of the vocabulary
def test_chain_kernel_equals_the_torch_path(k, draft_vocab, vocab):
    batch = 64
    tokens, q, p, d2t, index = chain_case(batch, k, vocab, seed=k + vocab, draft_vocab=draft_vocab)
    gen = torch.Generator().manual_seed(200 + k)
    uniforms, residual_uniforms = torch.rand(batch, k, generator=gen), torch.rand(batch, generator=gen)
    expected = verify_sampled_with_uniforms(tokens, q, p, uniforms, residual_uniforms, d2t, index)
    got = verify_chain_triton(tokens, q, p, uniforms, residual_uniforms, d2t, index)
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.next_token, expected.next_token)
    torch.testing.assert_close(got.first_acceptance, expected.first_acceptance, rtol=1e-5, atol=1e-6)
    counts = torch.bincount(expected.num_accepted, minlength=k + 1)
    assert counts[0] > 0 and counts[k] > 0, "the case must exercise both a first rejection and full acceptance"


def test_chain_kernel_edge_cases():
    """All accepted (p = q, u = 0), first rejected (u = 1 where p < q), and rows whose residual is all zero."""
    batch, k, vocab = 4, 3, 40
    gen = torch.Generator().manual_seed(1)
    q = random_dist((batch, k, vocab), gen, zeros=0.0)
    p = torch.cat([q, random_dist((batch, 1, vocab), gen)], dim=1)
    tokens = q.reshape(-1, vocab).argmax(-1).reshape(batch, k)
    uniforms = torch.zeros(batch, k)
    residual_uniforms = torch.rand(batch, generator=gen)
    everything = verify_chain_triton(tokens, q, p, uniforms, residual_uniforms)
    assert everything.num_accepted.tolist() == [k] * batch  # p = q: every draft kept, bonus from p_k
    assert torch.equal(everything.next_token,
                       verify_sampled_with_uniforms(tokens, q, p, uniforms, residual_uniforms).next_token)
    p_low = p.clone()
    p_low[torch.arange(batch), 0, tokens[:, 0]] = 0.0  # the policy forbids every first draft
    first = verify_chain_triton(tokens, q, p_low, torch.ones(batch, k), residual_uniforms)
    expected = verify_sampled_with_uniforms(tokens, q, p_low, torch.ones(batch, k), residual_uniforms)
    assert first.num_accepted.tolist() == [0] * batch and torch.equal(first.next_token, expected.next_token)
    assert not (first.next_token == tokens[:, 0]).any()


def tree_case(batch, vocab, seed):
    """Random trees with rows of different shapes (a chain, a wide root, mixed), some nodes on likely tokens."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ([0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 2, 3])
    parents = torch.tensor([shapes[b % 3] for b in range(batch)])
    depths = torch.zeros_like(parents)
    for i in range(parents.shape[1]):
        parent = parents[:, i]
        depths[:, i] = torch.where(parent == 0, 1, depths.gather(1, (parent - 1).clamp(min=0)[:, None])[:, 0] + 1)
    p = random_dist((batch, parents.shape[1] + 1, vocab), gen, zeros=0.5) ** 6  # peaked, as a policy often is
    p = p / p.sum(-1, keepdim=True)
    # Candidates: mostly the policy's likely tokens at their parent, so paths go deep.
    likely = torch.multinomial(p.reshape(-1, vocab), 1, generator=gen).reshape(batch, -1)
    tokens = likely.gather(1, parents)
    return DraftTree(tokens, parents, depths), p


@pytest.mark.parametrize("vocab", [24, 1500])
def test_tree_kernel_equals_the_torch_path(vocab):
    batch = 48
    tree, p = tree_case(batch, vocab, seed=vocab)
    gen = torch.Generator().manual_seed(3)
    uniforms = torch.rand(batch, tree.max_depth + 1, generator=gen)
    expected = verify_tree(tree, p, generator=torch.Generator().manual_seed(3))
    accepted, path, token = verify_tree_triton(tree.tokens, tree.parents, p, uniforms)
    assert torch.equal(accepted, expected.num_accepted)
    assert torch.equal(path, expected.path)
    assert torch.equal(token, expected.next_token)
    assert expected.num_accepted.max() >= 3 and (expected.num_accepted == 0).any()


@pytest.mark.parametrize("strategy", ["chain:4", "tree:3x2:5"])
def test_engine_with_the_fused_kernels_samples_what_the_torch_path_samples(monkeypatch, strategy):
    """The engine's verification through the kernels (as on CUDA; forced here on CPU under the interpreter): the
    same generator gives the same completions as the torch path, draft for draft."""
    from test_engine_greedy import train_drafter
    from tiny_models import EOS, PAD, padded_prompts, tiny_model

    import tlt_trainers.kernels.verify_triton as verify_triton
    from tlt_trainers import SpeculativeGenerator, TLTConfig
    from tlt_trainers.kernels import fused_verification as verify_module

    model = tiny_model("llama", logit_scale=4.0)
    drafter = train_drafter(model, steps=60)
    model, drafter = model.to(KERNEL_DEVICE), drafter.to(KERNEL_DEVICE)  # the engine's tensors where Triton runs
    ids, mask = (t.to(KERNEL_DEVICE) for t in padded_prompts([3, 6, 4, 5], seed=2))

    def sample():
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy,
                                                                cuda_graphs="off"))  # kernels called every step
        return engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.9,
                               eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(5))

    torch_path = sample()
    calls = []
    kernel_chain, kernel_tree = verify_triton.verify_chain_triton, verify_triton.verify_tree_triton
    monkeypatch.setattr(verify_triton, "verify_chain_triton", lambda *a, **k: calls.append("chain") or
                        kernel_chain(*a, **k))
    monkeypatch.setattr(verify_triton, "verify_tree_triton", lambda *a, **k: calls.append("tree") or
                        kernel_tree(*a, **k))
    monkeypatch.setattr(verify_module, "fused_kernels", lambda device: verify_triton)
    fused = sample()
    assert calls and set(calls) == {"chain" if strategy.startswith("chain") else "tree"}
    assert torch.equal(fused.sequences, torch_path.sequences)
    assert fused.stats.generated_tokens > fused.stats.row_forwards  # drafts were accepted on the way


def test_liger_loss_on_hard_labels_equals_the_torch_loss(monkeypatch):
    """EAGLE-3 training on the rollout's own tokens (hard labels) through liger-kernel's fused linear cross-entropy
    (as on CUDA; forced here under the interpreter): the same loss, gradients and agreement as the torch version."""
    liger = pytest.importorskip("liger_kernel.transformers.functional")
    from tiny_models import EOS, PAD, padded_prompts, tiny_model

    from tlt_trainers import DrafterTrainer, Eagle3Drafter, SpeculativeGenerator, TLTConfig
    from tlt_trainers.drafter import losses

    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6).to(KERNEL_DEVICE)  # liger runs there
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5])
    trainer = DrafterTrainer(drafter, model, unroll_steps=2, precision="float32")
    ids, mask = (t.to(KERNEL_DEVICE) for t in padded_prompts([5, 3, 7, 4], seed=3))
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="never"))
    engine.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, eos_token_id=EOS, pad_token_id=PAD,
                    generator=torch.Generator().manual_seed(0), feature_sink=trainer.add_features)
    sequences = list(trainer.buffer.sequences)
    assert sequences and all(seq.target_ids is None for seq in sequences)  # hard labels: the sampled tokens
    batch = trainer._batch(sequences)

    calls = []
    fused = liger.liger_fused_linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    torch_loss, torch_metrics = trainer._loss(batch)
    torch_grads = torch.autograd.grad(torch_loss, list(drafter.parameters()))
    monkeypatch.setattr(losses, "liger_fused_cross_entropy", lambda device: counted)
    liger_loss, liger_metrics = trainer._loss(batch)
    liger_grads = torch.autograd.grad(liger_loss, list(drafter.parameters()))
    assert len(calls) == 2  # one per unrolled step
    torch.testing.assert_close(liger_loss, torch_loss, rtol=1e-5, atol=1e-5)
    assert liger_metrics["top1_by_step"] == torch_metrics["top1_by_step"]
    for got, expected in zip(liger_grads, torch_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
