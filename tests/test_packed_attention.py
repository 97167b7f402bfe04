"""Packed drafter training: sequences laid end to end instead of padded, the training-time test's attention merged
from a causal varlen prefix and the diagonal keys (``tlt_trainers/kernels/packed_attention.py``).

The torch backend runs here through the same autograd function the flash-attn backend uses on CUDA; it must give
the padded path's outputs, loss and gradients. flash-attn itself needs CUDA (its check is skipped here, and runs in
``benchmarks/gpu_check.py``)."""

import copy

import pytest
import torch
from tiny_models import PAD, padded_prompts, tiny_model

from tlt_trainers import DrafterTrainer, Eagle3Drafter, EagleDrafter
from tlt_trainers.kernels.packed_attention import (
    FLASH_TOLERANCE,
    PackedSequences,
    TorchVarlen,
    backend_difference,
    flash_varlen_available,
    packed_ttt_attention,
    varlen_backend,
)

LAYERS = [1, 3, 5]
LENGTHS = [7, 3, 1, 5, 2, 9]  # shorter than the unroll depth, single tokens, one long tail


def test_a_micro_batch_shorter_than_the_unroll_depth(model):
    """Fewer packed tokens than draft steps: every later step reads only the query's own key."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    hidden, tokens, positions, valid = padded_inputs(drafter, [1, 2])
    packed = PackedSequences.from_lengths([1, 2])
    outputs = drafter.forward_unrolled(hidden[valid][None], tokens[valid][None], packed.positions[None], packed, 5)
    assert len(outputs) == 5 and all(torch.isfinite(out).all() for out in outputs)
    padded = drafter.forward_unrolled(hidden, tokens, positions, valid, 5)
    torch.testing.assert_close(outputs[1][0, 2], padded[1][1, 1])  # the only position scored at step 1


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", logit_scale=4.0, num_hidden_layers=6, num_key_value_heads=2)  # grouped-query


def padded_inputs(drafter, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch, length = len(lengths), max(lengths)
    hidden = torch.randn(batch, length, drafter.feature_size, generator=generator)
    tokens = torch.randint(0, 64, (batch, length), generator=generator)
    positions = torch.arange(length).expand(batch, -1)
    valid = positions < torch.tensor(lengths)[:, None]
    return hidden, tokens, positions, valid


@pytest.mark.parametrize("depth,layers", [(1, 1), (2, 1), (4, 1), (3, 2)])
def test_packed_unroll_equals_padded_outputs_and_gradients(model, depth, layers):
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS, num_hidden_layers=layers)
    hidden, tokens, positions, valid = padded_inputs(drafter, LENGTHS)
    packed = PackedSequences.from_lengths(LENGTHS)
    weights = [torch.randn(*valid.shape, drafter.config.hidden_size, generator=torch.Generator().manual_seed(k))
               for k in range(depth)]

    def scored_sum(outputs, select):  # step k is scored at positions >= k only (as in training)
        return sum((out * w)[select(k)].sum() for k, (out, w) in enumerate(zip(outputs, weights, strict=True)))

    padded = drafter.forward_unrolled(hidden, tokens, positions, valid, depth)
    scored_sum(padded, lambda k: valid & (positions >= k)).backward()
    padded_grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()

    packed_out = drafter.forward_unrolled(hidden[valid][None], tokens[valid][None], packed.positions[None], packed,
                                          depth)
    unpacked = [torch.zeros_like(p).masked_scatter(valid[..., None], out[0]) for out, p in zip(packed_out, padded,
                                                                                               strict=True)]
    scored_sum(unpacked, lambda k: valid & (positions >= k)).backward()
    for k, (a, b) in enumerate(zip(padded, unpacked, strict=True)):
        select = valid & (positions >= k)
        torch.testing.assert_close(b[select], a[select], atol=2e-6, rtol=1e-5)
    for name, p in drafter.named_parameters():
        if name in padded_grads:
            torch.testing.assert_close(p.grad, padded_grads[name], atol=2e-5, rtol=1e-4, msg=name)


def test_torch_backend_backward_is_the_gradient_of_its_forward():
    """TorchVarlen.backward follows flash-attn's contract (gradients from the output and log-sum-exp it is given);
    with its own forward's output and lse it must be autograd's gradient of plain causal attention."""
    generator = torch.Generator().manual_seed(1)
    packed = PackedSequences.from_lengths([4, 1, 6])
    q = torch.randn(packed.total, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(packed.total, 2, 8, generator=generator, requires_grad=True)
    v = torch.randn(packed.total, 2, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(packed.total, 4, 8, generator=generator)
    scale = 8**-0.5
    out, lse = TorchVarlen.forward(q.detach(), k.detach(), v.detach(), packed.cu_seqlens, packed.max_len, scale)
    dq, dk, dv = TorchVarlen.backward(grad_out, q.detach(), k.detach(), v.detach(), out, lse, packed.cu_seqlens,
                                      packed.max_len, scale)
    reference = []
    for start, end in zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist(), strict=True):
        keys, values = (x[start:end].repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))
        reference.append(torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys, values, is_causal=True).transpose(0, 1))
    reference = torch.cat(reference)
    torch.testing.assert_close(out, reference.detach(), atol=1e-6, rtol=1e-5)
    reference.backward(grad_out)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_step_whose_queries_have_no_prefix_attends_to_its_diagonal_only():
    """Sequences no longer than the step have no causal prefix at all: the merged softmax is the diagonal's."""
    packed = PackedSequences.from_lengths([2, 1])
    generator = torch.Generator().manual_seed(2)
    keys = [torch.randn(3, 1, 8, generator=generator) for _ in range(3)]
    values = [torch.randn(3, 1, 8, generator=generator) for _ in range(3)]
    query = torch.randn(3, 1, 8, generator=generator)
    out = packed_ttt_attention(query, keys, values, packed, TorchVarlen())
    # token 1 (position 1 of sequence 0) at step 2: step 1's key at position 0, and itself (step 2's key)
    scores = torch.stack([(query[1] * keys[1][0]).sum(), (query[1] * keys[2][1]).sum()]) * 8**-0.5
    expected = scores.softmax(0) @ torch.stack([values[1][0, 0], values[2][1, 0]])
    torch.testing.assert_close(out[1, 0], expected)
    torch.testing.assert_close(out[2], values[2][2])  # a one-token sequence sees only itself


@pytest.fixture(scope="module")
def buffered_trainers(model):
    """Two trainers on the same buffer and the same drafter initialisation: padded and packed."""
    ids, mask = padded_prompts([5, 3, 7, 4, 6, 5, 2, 8], seed=4)
    seqs = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=20, pad_token_id=PAD,
                          eos_token_id=None)
    mask = torch.cat([mask, torch.ones(len(ids), 20, dtype=torch.long)], dim=1)
    mask[::3, -9:] = 0  # a long tail: some answers stop early
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    trainers = {}
    for attention in ("padded", "packed"):
        trainer = DrafterTrainer(copy.deepcopy(drafter), model, lr=3e-3, unroll_steps=3, micro_batch_size=4,
                                 attention=attention, precision="float32", seed=0)
        trainer.add_sequences(seqs, mask)
        trainers[attention] = trainer
    return trainers


@pytest.mark.parametrize("targets", ["policy top-k", "next token"])
def test_packed_micro_batch_gives_the_padded_loss_metrics_and_gradients(buffered_trainers, targets):
    padded, packed = buffered_trainers["padded"], buffered_trainers["packed"]
    sequences = list(padded.buffer.sequences)[:5]
    if targets == "next token":  # rollouts from the engine's sink come without the policy's law
        sequences = [copy.copy(seq) for seq in sequences]
        for seq in sequences:
            seq.target_ids = seq.target_probs = None
    results = {}
    for name, trainer in (("padded", padded), ("packed", packed)):
        batch = trainer._batch(sequences)
        trainer.drafter.zero_grad()
        loss, metrics = trainer._loss(batch)
        loss.backward()
        results[name] = (loss.detach(), metrics, batch.num_tokens,
                         {n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None})
        trainer.drafter.zero_grad()
    assert isinstance(packed._batch(sequences).layout, PackedSequences)
    assert results["packed"][2] == results["padded"][2] == sum(seq.features.shape[0] for seq in sequences)
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-5, rtol=1e-5)
    for step, (a, b) in enumerate(zip(results["packed"][1]["top1_by_step"], results["padded"][1]["top1_by_step"],
                                      strict=True)):
        assert a == pytest.approx(b, abs=1e-6), step
    for name, grad in results["padded"][3].items():
        torch.testing.assert_close(results["packed"][3][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_training_follows_padded_training(buffered_trainers):
    """Ten micro-steps on the same sampled micro-batches end at the same drafter (float32).

    Compared against how far training moved each tensor: AdamW divides by the root of the squared gradient, so an
    entry whose gradient is near zero moves by up to the rate on a rounding difference (seen on an AVX-512 Xeon:
    one entry of 3072 off by 1.3e-4 after ten steps at lr 3e-3, the losses equal), while a packing error (a token
    attending across sequences) moves whole tensors by as much as training does."""
    padded, packed = (copy.deepcopy(buffered_trainers[k]) for k in ("padded", "packed"))
    start = {name: p.detach().clone() for name, p in padded.drafter.named_parameters()}
    a, b = padded.train(max_steps=10), packed.train(max_steps=10)
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for (name, p), q in zip(padded.drafter.named_parameters(), packed.drafter.parameters(), strict=True):
        moved = (p - start[name]).norm()
        assert moved > 0, name
        assert (q - p).norm() <= 1e-2 * moved, (name, float((q - p).norm()), float(moved))


def test_packed_bf16_autocast_stays_close_to_padded(buffered_trainers):
    padded, packed = buffered_trainers["padded"], buffered_trainers["packed"]
    sequences = list(padded.buffer.sequences)[:6]
    losses = []
    for trainer in (padded, packed):
        batch = trainer._batch(sequences)  # built outside autocast, as in train()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(trainer._loss(batch)[0].float())
    assert losses[1] == pytest.approx(losses[0].item(), rel=2e-2)


def test_layout_choice_and_clear_errors(model):
    eagle3 = Eagle3Drafter.from_target(model, aux_layer_ids=LAYERS)
    eagle1 = EagleDrafter.from_target(model)
    assert DrafterTrainer(eagle3, model, attention="packed").packed
    assert not DrafterTrainer(eagle3, model, attention="padded").packed
    # auto packs EAGLE-3 (off CUDA: the torch loop; on CUDA only with flash-attn's varlen kernel)
    assert DrafterTrainer(eagle3, model).packed
    assert not flash_varlen_available(torch.device("cpu"))
    assert not DrafterTrainer(eagle1, model, attention="auto").packed
    with pytest.raises(ValueError, match="EAGLE-1 drafters train padded"):
        DrafterTrainer(eagle1, model, attention="packed")
    with pytest.raises(ValueError, match="choose one of"):
        DrafterTrainer(eagle3, model, attention="varlen")
    with pytest.raises(RuntimeError, match=r"tlt-trainers\[flash\]"):
        varlen_backend(torch.zeros(4, 2, 8, dtype=torch.bfloat16), prefer="flash-attn")
    assert isinstance(varlen_backend(torch.zeros(4, 2, 8)), TorchVarlen)
    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.from_lengths([3, 0])


def test_backend_difference_catches_a_backend_with_a_wrong_normaliser():
    """The check flash-attn must pass before packed training uses it (flash_varlen_available) tells a wrong backend."""
    packed = PackedSequences.from_lengths([5, 1, 19, 8])
    assert backend_difference(TorchVarlen(), packed, step=1, heads=4, kv_heads=2) == 0.0

    class ShiftedLse(TorchVarlen):
        @staticmethod
        def forward(*args):
            out, lse = TorchVarlen.forward(*args)
            return out, lse + 0.5

    assert backend_difference(ShiftedLse(), packed, step=1, heads=4, kv_heads=2) > FLASH_TOLERANCE


def flash_ready() -> bool:
    return torch.cuda.is_available() and flash_varlen_available(torch.device("cuda"))


@pytest.mark.skipif(not flash_ready(), reason="flash-attn's varlen kernels need a CUDA GPU and flash-attn 2.7-2.8 "
                    "(pip install 'tlt-trainers[flash]'); the torch backend above runs the same autograd function")
@pytest.mark.parametrize("step", [0, 2])
def test_flash_backend_equals_torch_backend(step):
    device = torch.device("cuda")
    packed = PackedSequences.from_lengths([37, 5, 130, 1, 64], device)
    generator = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16).requires_grad_()

    query = leaf(packed.total, 8, 64)
    keys = [leaf(packed.total, 2, 64) for _ in range(step + 1)]
    values = [leaf(packed.total, 2, 64) for _ in range(step + 1)]
    grad_out = torch.randn(packed.total, 8, 64, generator=generator, device=device, dtype=torch.bfloat16)
    results = []
    for backend in (TorchVarlen(), varlen_backend(query, prefer="flash-attn")):
        out = packed_ttt_attention(query, keys, values, packed, backend)
        grads = torch.autograd.grad(out, [query, *keys, *values], grad_out)
        results.append((out.float(), [g.float() for g in grads]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=2e-2, rtol=2e-2)
    for mine, theirs in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(mine, theirs, atol=5e-2, rtol=5e-2)
