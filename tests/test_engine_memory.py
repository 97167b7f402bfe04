"""What the engine keeps between generate() calls is counted and given back (tlt_trainers.rollout.memory).

``cuda_graphs="static"`` is the CPU stand-in for CUDA graphs: the same graph session (the policy's and the
drafter's caches, the rows' buffers, the graphs' static inputs) is kept across calls, without capturing.
"""

import gc
import weakref

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import Eagle3Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.rollout.memory import (
    SessionShape,
    give_back,
    held_breakdown,
    held_bytes,
    session_bytes_formula,
)

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def policy_and_drafter():
    torch.manual_seed(0)
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=6)
    return model, Eagle3Drafter.from_target(model, aux_layer_ids=[1, 3, 5])


def generate(engine, seed: int = 16):
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2, 4, 6], seed=seed)
    return engine.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                           eos_token_id=EOS, generator=torch.Generator().manual_seed(0))


def static_engine(model, drafter, graphs: str = "static") -> SpeculativeGenerator:
    return SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="chain:3",
                                                          cuda_graphs=graphs))


def test_held_bytes_counts_the_session_by_part_as_the_formula_computes_it(policy_and_drafter):
    model, drafter = policy_and_drafter
    engine = static_engine(model, drafter)
    assert engine.held_bytes() == 0  # nothing generated yet
    generate(engine)
    session = engine._graph_session
    parts = held_breakdown(engine)
    assert engine.held_bytes() == held_bytes(engine) == sum(parts.values()) > 0
    # The big parts follow the formula the benchmark uses for GPU shapes: rows = the batch bucket, the session's
    # capacity, the compute dtype (float32 here), EAGLE-3 features of 3 tapped layers.
    shape = SessionShape.from_config(model.config, dtype_bytes=4, drafter_kv_heads=drafter.config.num_key_value_heads,
                                     drafter_head_dim=drafter.config.head_dim)
    computed = session_bytes_formula(shape, rows=session.max_batch, capacity=session.capacity)
    assert parts["policy KV cache"] == pytest.approx(computed.policy_kv, rel=1e-3)
    assert parts["drafter KV cache"] == computed.drafter_kv
    features = parts["rows' buffers (features, tokens)"]
    assert computed.features <= features <= 1.1 * computed.features  # plus the rows' token buffers
    # Views share storages: the same session counted twice is the same number.
    assert held_bytes(engine) == engine.held_bytes()


def test_give_back_frees_the_session_now(policy_and_drafter):
    model, drafter = policy_and_drafter
    engine = static_engine(model, drafter)
    generate(engine)
    alive = weakref.ref(engine._graph_session)
    before = engine.held_bytes()
    gc.disable()  # the collector may not run by itself between the rollout and the training step
    try:
        release = give_back(engine)
        assert release.held_bytes == before > 0
        assert engine.held_bytes() == 0
        assert release.session_freed and alive() is None  # freed, not merely unreferenced by the engine
    finally:
        gc.enable()
    # The next call builds a new session (and captures again) and is as exact as before.
    again = generate(engine)
    assert engine.held_bytes() == before
    reference = static_engine(model, drafter)
    assert torch.equal(again.sequences, generate(reference).sequences)


def test_nothing_is_held_without_graphs(policy_and_drafter):
    model, drafter = policy_and_drafter
    engine = static_engine(model, drafter, graphs="off")
    generate(engine)
    assert engine.held_bytes() == 0
    release = give_back(engine)
    assert release.held_bytes == 0 and release.session_freed and not release.collected


def test_formula_at_gpu_shapes_is_in_the_range_the_issue_names():
    """A Qwen2.5-7B-shaped policy in bfloat16, 64 rows of 4096 slots: the KV cache alone is 14 GiB."""
    qwen7b = SessionShape(layers=28, kv_heads=4, head_dim=128, hidden=3584, vocab=151936, drafter_kv_heads=4)
    computed = session_bytes_formula(qwen7b, rows=64, capacity=4096)
    assert computed.policy_kv == 2 * 28 * 64 * 4 * 4096 * 128 * 2
    assert 10 * 2**30 < computed.tensors < 30 * 2**30
