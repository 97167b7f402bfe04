"""The veRL ``tlt`` rollout server (TLTRolloutServer) samples what veRL's sampling_params ask for, with vLLM's meaning,
and reports it as veRL's vLLM server does: per-request max_tokens, stop_token_ids and ignore_eos, the stop reason
("completed" on a stop token, "length" at the limit), log-probs of the law each token was drawn from (repetition
penalty, temperature, top-k, min-p: vLLM's processed_logprobs), and a clear error for a setting it cannot honour.

No Ray: the server object is driven directly on a tiny random Llama saved to disk, against transformers'
``model.generate`` and its logits processors.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

pytest.importorskip("verl")

from tiny_models import EOS, PAD, save_with_char_tokenizer, tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from tlt_trainers.verl.server import TLTRolloutServer  # noqa: E402

RESPONSE_LENGTH = 8
# What veRL 0.9.1's agent loop sends by default (rollout.calculate_log_probs=False), and for validation (greedy).
VERL_TRAIN = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=False)
VERL_VALIDATE = dict(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=False)
GREEDY = dict(temperature=0.0)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (length,), generator=gen).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_server")
    model = tiny_model("llama", vocab_size=64, seed=5, logit_scale=4.0)
    model.generation_config.eos_token_id = EOS
    return save_with_char_tokenizer(model, path)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def make_server(path, speculation: str = "never", response_length: int = RESPONSE_LENGTH,
                prompt_length: int | None = None, **extra) -> TLTRolloutServer:
    settings = {"speculation": speculation, "device": "cpu", "batch_wait_ms": 5.0, **extra}
    if speculation != "never":
        settings["num_speculative_tokens"] = 3
    return TLTRolloutServer(str(path), settings, response_length=response_length, prompt_length=prompt_length)


def serve(server: TLTRolloutServer, requests: list[tuple[list[int], dict]]) -> list:
    """The requests sent together (one batch per sampling law, as a GRPO step's), their TokenOutputs in order."""
    async def go():
        return await asyncio.gather(*(server.generate(prompt, dict(params), request_id=str(i))
                                      for i, (prompt, params) in enumerate(requests)))
    return asyncio.run(go())


def greedy_generate(model, prompt: list[int], max_new_tokens: int, eos, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' greedy completion of one unpadded prompt, cut after its first EOS (vLLM keeps the stop token)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD, repetition_penalty=repetition_penalty)
    completion = out[0, len(prompt):].tolist()
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    end = next((i + 1 for i, t in enumerate(completion) if t in stops), len(completion))
    return completion[:end]


@torch.no_grad()
def processed_logprobs(model, prompt: list[int], completion: list[int], processors) -> list[float]:
    """log_softmax of transformers' processed scores at each sampled token, every step from its own prefix."""
    out = []
    for t, token in enumerate(completion):
        ids = torch.tensor([prompt + completion[:t]])
        scores = model(input_ids=ids).logits[:, -1].float()
        for processor in processors:
            scores = processor(ids, scores)
        out.append(torch.log_softmax(scores, dim=-1)[0, token].item())
    return out


def no_eos_prompts(model, count: int, seed: int) -> list[list[int]]:
    """Prompts whose greedy continuation has no EOS within RESPONSE_LENGTH tokens (so the limit ends them)."""
    found = []
    for prompt in random_prompts(40, 5, seed):
        if EOS not in greedy_generate(model, prompt, RESPONSE_LENGTH, eos=None):
            found.append(prompt)
        if len(found) == count:
            return found
    raise AssertionError("no prompt without EOS for the test")


# ----------------------------------------------------------------------------- settings refused or accepted
@pytest.fixture(scope="module")
def server(model_dir):
    return make_server(model_dir)


@pytest.mark.parametrize("params, named", [
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=-0.3), "frequency_penalty"),
    (dict(seed=7), "seed"),
    (dict(stop=["\n"]), "stop"),
    (dict(n=2), "n"),
    (dict(min_tokens=2), "min_tokens"),
    (dict(logit_bias={3: 2.0}), "logit_bias"),
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(min_p=0.2, top_p=0.9), "min_p"),
    (dict(some_new_setting=1), "some_new_setting"),
])
def test_a_setting_it_cannot_honour_is_refused_by_name(server, params, named):
    with pytest.raises(ValueError, match=named) as error:
        serve(server, [([5, 6, 7], {**VERL_TRAIN, **params})])
    assert "rollout.name=vllm" in str(error.value)


def test_what_verl_sends_and_vllm_defaults_are_accepted(server):
    vllm_defaults = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
                         top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
                         max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True,
                         skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                         logit_bias=None, allowed_token_ids=None, bad_words=[], extra_args=None,
                         structured_outputs=None, flat_logprobs=False, watermarking=True)
    requests = [([5, 6, 7], VERL_TRAIN), ([8, 9], VERL_VALIDATE), ([5, 6], {**VERL_TRAIN, "logprobs": True}),
                ([4, 4, 4], {**VERL_TRAIN, "stop_token_ids": [9, 10]}),  # the tool agent loop adds stop tokens
                ([7, 3], {**VERL_TRAIN, "max_tokens": 4}), ([6], vllm_defaults)]
    outputs = serve(server, requests)
    assert all(1 <= len(o.token_ids) <= RESPONSE_LENGTH for o in outputs)
    assert outputs[2].log_probs is not None and len(outputs[2].log_probs) == len(outputs[2].token_ids)
    assert outputs[0].log_probs is None


# ----------------------------------------------------------------------------- length, stop tokens, stop reason
def test_max_tokens_and_the_length_stop_reason(model_dir, reference):
    server = make_server(model_dir)
    a, b = no_eos_prompts(reference, 2, seed=1)
    full_a = greedy_generate(reference, a, RESPONSE_LENGTH, eos=EOS)
    full_b = greedy_generate(reference, b, RESPONSE_LENGTH, eos=EOS)
    outputs = serve(server, [(a, {**VERL_VALIDATE, "max_tokens": 3}), (b, VERL_VALIDATE),
                             (a, {**VERL_VALIDATE, "max_tokens": 100})])  # capped at response_length
    assert outputs[0].token_ids == full_a[:3]
    assert outputs[1].token_ids == full_b
    assert outputs[2].token_ids == full_a
    assert [o.stop_reason for o in outputs] == ["length"] * 3  # cut at the limit, as vLLM's finish_reason says


def test_without_max_tokens_a_long_prompt_gets_what_is_left_of_the_budget(model_dir, reference):
    """veRL's vLLM server: no max_tokens means min(response_length, prompt_length + response_length - prompt)."""
    server = make_server(model_dir, prompt_length=4)
    a, b = no_eos_prompts(reference, 2, seed=1)  # a and b are longer than prompt_length
    full_a = greedy_generate(reference, a, RESPONSE_LENGTH, eos=EOS)
    budget = 4 + RESPONSE_LENGTH - len(a)
    assert 0 < budget < RESPONSE_LENGTH
    short, explicit = serve(server, [(a, VERL_VALIDATE), (a, {**VERL_VALIDATE, "max_tokens": RESPONSE_LENGTH})])
    assert short.token_ids == full_a[:budget] and short.stop_reason == "length"
    assert explicit.token_ids == full_a  # an explicit max_tokens is the request's own


@pytest.fixture(scope="module")
def stop_model(model_dir, reference, tmp_path_factory):
    """A model whose generation config ends completions on a token its greedy continuation of ``prompt`` reaches
    at step 3 (``free``: that continuation with nothing ending it), and ``other``, a prompt that never reaches it."""
    for prompt in no_eos_prompts(reference, 10, seed=2):
        free = greedy_generate(reference, prompt, RESPONSE_LENGTH, eos=None)  # no EOS in it
        if len(set(free[:4])) == 4:
            break
    else:
        raise AssertionError("no prompt for the test")
    stop = free[2]
    other = next(p for p in no_eos_prompts(reference, 10, seed=8)
                 if stop not in greedy_generate(reference, p, RESPONSE_LENGTH, eos=None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.generation_config.eos_token_id = stop
    # the tokenizer's EOS (1) ends completions too, as in vLLM
    path = save_with_char_tokenizer(model, tmp_path_factory.mktemp("tiny_llama_stop"))
    return path, prompt, free, stop, other


def test_stop_reason_is_length_at_the_limit_and_completed_on_eos(stop_model, reference):
    path, prompt, free, stop, other = stop_model
    outputs = serve(make_server(path), [(prompt, VERL_VALIDATE), (other, VERL_VALIDATE)])
    assert outputs[0].token_ids == free[:3] and outputs[0].stop_reason == "completed"  # ends on EOS, kept
    assert outputs[1].token_ids == greedy_generate(reference, other, RESPONSE_LENGTH, eos=None)
    assert outputs[1].stop_reason == "length"  # cut at response_length, as vLLM's finish_reason says


@pytest.mark.parametrize("speculation", ["never", "always"])
def test_stop_token_ids_and_ignore_eos(stop_model, speculation):
    path, prompt, free, stop, _ = stop_model
    server = make_server(path, speculation)
    # One batch: the engine stops on the tokens all four share (none) and each request is cut at its own.
    outputs = serve(server, [(prompt, GREEDY), (prompt, {**GREEDY, "ignore_eos": True}),
                             (prompt, {**GREEDY, "stop_token_ids": [free[1]]}),
                             (prompt, {**GREEDY, "ignore_eos": True, "stop_token_ids": [free[-1]]})])
    assert outputs[0].token_ids == free[:3] and outputs[0].stop_reason == "completed"
    assert outputs[1].token_ids == free and outputs[1].stop_reason == "length"  # EOS does not end it
    assert outputs[2].token_ids == free[:2] and outputs[2].stop_reason == "completed"  # the stop token is kept
    last = free.index(free[-1]) + 1
    assert outputs[3].token_ids == free[:last] and outputs[3].stop_reason == "completed"


# ----------------------------------------------------------------------------- the law and its log-probs
def test_repetition_penalty_counts_the_prompt_not_the_padding(model_dir, reference):
    """A short prompt is left-padded in the batch; the penalty must cover its own tokens only (vLLM: prompt and
    completion), so a pad id that is the prompt's best next token must not be penalized."""
    penalty = 3.0
    for short in random_prompts(40, 3, seed=3):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([short])).logits[:, -1]
        scores = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([short]), logits)
        best = int(scores.argmax())
        with_pad = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([short + [best]]), logits)
        if best not in short and int(with_pad.argmax()) != best:
            break  # penalizing the pad id would change this prompt's first greedy token
    else:
        raise AssertionError("no prompt for the test")
    long = random_prompts(1, 9, seed=4)[0]
    server = make_server(model_dir)
    server.pad_id = best  # any pad id must give the same completions
    params = {**VERL_VALIDATE, "repetition_penalty": penalty}
    outputs = serve(server, [(short, params), (long, params)])
    assert outputs[0].token_ids == greedy_generate(reference, short, RESPONSE_LENGTH, EOS, penalty)
    assert outputs[1].token_ids == greedy_generate(reference, long, RESPONSE_LENGTH, EOS, penalty)


def test_logprobs_are_those_of_the_penalized_law(model_dir, reference):
    """log_softmax of the repetition-penalized, tempered, top-k scores at each sampled token (vLLM's
    processed_logprobs, veRL's default logprobs_mode), for sampled and greedy requests."""
    server = make_server(model_dir)
    prompts = random_prompts(3, 4, seed=6) + [[9, 9, 9, 9, 9, 9, 9]]
    sampled = dict(temperature=0.7, top_k=20, top_p=1.0, repetition_penalty=1.5, logprobs=True)
    greedy = dict(temperature=0.0, repetition_penalty=1.5, logprobs=True)
    outputs = serve(server, [(p, sampled) for p in prompts] + [(p, greedy) for p in prompts])
    for row, output in enumerate(outputs):
        prompt = prompts[row % len(prompts)]
        if row < len(prompts):
            processors = [RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.7),
                          TopKLogitsWarper(20)]
        else:
            processors = [RepetitionPenaltyLogitsProcessor(1.5)]
            assert output.token_ids == greedy_generate(reference, prompt, RESPONSE_LENGTH, EOS, 1.5)
        expected = processed_logprobs(reference, prompt, output.token_ids, processors)
        assert all(math.isfinite(v) for v in output.log_probs)
        assert output.log_probs == pytest.approx(expected, abs=1e-5), f"row {row}"


def test_raw_logprobs_mode_and_refused_modes(model_dir, reference):
    """rollout.logprobs_mode=raw_logprobs: the model's own log-softmax at each sampled token, before the penalty and
    temperature the tokens were drawn with; modes returning logits are refused by name."""
    server = TLTRolloutServer(str(model_dir), {"speculation": "never", "device": "cpu", "batch_wait_ms": 5.0},
                              response_length=RESPONSE_LENGTH, logprobs_mode="raw_logprobs")
    prompt = random_prompts(1, 4, seed=6)[0]
    (output,) = serve(server, [(prompt, dict(temperature=0.7, repetition_penalty=1.5, logprobs=True))])
    assert output.log_probs == pytest.approx(processed_logprobs(reference, prompt, output.token_ids, []), abs=1e-5)
    processed = processed_logprobs(reference, prompt, output.token_ids,
                                   [RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.7)])
    assert output.log_probs != pytest.approx(processed, abs=1e-3)  # the two modes differ here
    with pytest.raises(ValueError, match="logprobs_mode='raw_logits'"):
        TLTRolloutServer(str(model_dir), {"speculation": "never", "device": "cpu"}, response_length=RESPONSE_LENGTH,
                         logprobs_mode="raw_logits")


def test_min_p_is_sampled_and_in_the_logprobs(model_dir, reference):
    """min_p (vLLM: after temperature, before top-k) keeps the tokens with at least min_p times the top token's
    probability; every sampled token is one of them and its log-prob is the renormalized law's."""
    server = make_server(model_dir, response_length=12)
    prompts = random_prompts(6, 4, seed=7)
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.3, logprobs=True)
    outputs = serve(server, [(p, params) for p in prompts for _ in range(2)])
    for row, output in enumerate(outputs):
        prompt = prompts[row // 2]
        expected = processed_logprobs(reference, prompt, output.token_ids, [MinPLogitsWarper(0.3)])
        assert output.log_probs == pytest.approx(expected, abs=1e-5), f"row {row}"
        raw = processed_logprobs(reference, prompt, output.token_ids, [])
        top = [torch.log_softmax(reference(input_ids=torch.tensor([prompt + output.token_ids[:t]])).logits[0, -1]
                                 .float(), -1).max().item() for t in range(len(output.token_ids))]
        assert all(lp >= math.log(0.3) + best - 1e-5 for lp, best in zip(raw, top, strict=True)), f"row {row}"


# ----------------------------------------------------------------------------- warm start from a public drafter
def test_starts_from_a_public_layout_drafter_and_stays_exact(model_dir, reference, tmp_path):
    """tlt.drafter_name_or_path = an EAGLE-1 drafter in the TLT authors' FastRL layout (model.-prefixed, Qwen2-style
    q/k/v biases): the server's drafter is that one, and its speculative greedy outputs are transformers'."""
    from public_layouts import write_fastrl_eagle

    from tlt_trainers import EagleDrafter

    torch.manual_seed(4)
    published = EagleDrafter.from_target(reference, qkv_bias=True)
    folder = write_fastrl_eagle(published, reference, tmp_path / "fastrl")
    server = make_server(model_dir, speculation="always", drafter_name_or_path=str(folder))
    assert isinstance(server.drafter, EagleDrafter) and server.drafter.config.qkv_bias
    state = server.drafter.state_dict()
    assert all(torch.equal(state[k], v) for k, v in published.state_dict().items())
    prompts = random_prompts(4, 5, seed=9)
    outputs = serve(server, [(prompt, GREEDY) for prompt in prompts])
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == greedy_generate(reference, prompt, RESPONSE_LENGTH, eos=EOS)


@pytest.mark.parametrize("targets", ["auto", "sampled"])
def test_an_eagle3_drafter_learns_the_policys_law_from_the_served_rollouts(tmp_path, targets):
    """The engine's sink hands features and the sampled tokens only; by default an EAGLE-3 drafter's rollouts go
    through one policy forward that gives the policy's top-k law (at T=1 the sampled token is a target it memorises:
    benchmarks/bench_adaptation_offline.py); 'sampled' keeps the sink's."""
    from tlt_trainers import Eagle3Drafter
    from tlt_trainers.drafter.trainer import TARGET_TOP_K

    model = tiny_model("llama", vocab_size=64, seed=5, logit_scale=4.0, num_hidden_layers=6)
    model.generation_config.eos_token_id = EOS
    path = save_with_char_tokenizer(model, tmp_path / "policy")
    server = make_server(path, speculation="always", drafter_architecture="eagle3", drafter_targets=targets)
    assert isinstance(server.drafter, Eagle3Drafter)
    serve(server, [(prompt, VERL_TRAIN) for prompt in random_prompts(4, 5, seed=3)])
    sequences = list(server.trainer.buffer.sequences)
    assert len(sequences) == 4
    if targets == "sampled":
        assert all(seq.target_ids is None for seq in sequences)
        return
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    for seq in sequences:
        with torch.no_grad():
            law = policy(seq.tokens[None]).logits[0, 1:].float().softmax(-1).topk(TARGET_TOP_K)
        torch.testing.assert_close(seq.target_probs.float(), law.values, atol=1e-3, rtol=1e-3)  # kept in float16
        assert torch.equal(seq.target_ids[:, 0].long(), law.indices[:, 0])


# ----------------------------------------------------------------------------- memory kept between batches
@pytest.mark.parametrize("hook", ["sleep", "release_kv_cache"])
def test_sleep_and_release_kv_cache_give_the_engines_memory_back(model_dir, reference, hook):
    """veRL puts a replica to sleep after each rollout (and releases its KV cache before a weight sync): the engine's
    graph session (``cuda_graphs="static"``, the CPU stand-in for CUDA graphs) is freed, and the next batch, which
    builds a new one, is as exact as the first."""
    server = make_server(model_dir, speculation="always", cuda_graphs="static")
    prompts = random_prompts(4, 5, seed=9)
    first = serve(server, [(prompt, GREEDY) for prompt in prompts])
    assert asyncio.run(server.engine_memory()) > 0
    asyncio.run(server.clear_kv_cache())  # no prefix cache to clear, and not a release
    assert asyncio.run(server.engine_memory()) > 0
    asyncio.run(getattr(server, hook)())
    assert asyncio.run(server.engine_memory()) == 0
    asyncio.run(server.wake_up() if hook == "sleep" else server.resume_kv_cache())
    second = serve(server, [(prompt, GREEDY) for prompt in prompts])
    assert asyncio.run(server.engine_memory()) > 0
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert a.token_ids == b.token_ids == greedy_generate(reference, prompt, RESPONSE_LENGTH, eos=EOS)
    release = asyncio.run(server.release_engine_memory())
    assert release["held_bytes"] > 0 and release["session_freed"]


def test_keep_engine_memory_keeps_it_through_sleep(model_dir):
    server = make_server(model_dir, speculation="always", cuda_graphs="static", keep_engine_memory=True)
    serve(server, [(prompt, GREEDY) for prompt in random_prompts(4, 5, seed=9)])
    held = asyncio.run(server.engine_memory())
    asyncio.run(server.sleep())
    asyncio.run(server.release_kv_cache())
    assert held > 0 and asyncio.run(server.engine_memory()) == held
    assert asyncio.run(server.release_engine_memory()) == {}
