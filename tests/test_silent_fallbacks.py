"""Where TLT falls back to something other than what the user set, it says so once.

A resumed run without TLT's RNG state, a drafter warm-up that cannot sample the rollouts' law, vLLM's weight-load
warnings dropped on a drafter reload, and a veRL replica whose ``/metrics`` cannot be read (whose counts must then
arrive late, never as a negative delta).
"""

import io
import logging
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest


@contextmanager
def captured_warnings(module_logger):
    calls = []
    with mock.patch.object(module_logger, "warning", side_effect=lambda msg, *a, **k: calls.append(msg % a if a
                                                                                                  else msg)):
        yield calls


@pytest.fixture
def trl_parts():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from trl_scripts.common import char_tokenizer, grpo_kwargs, length_reward, policy, prompt_dataset

    from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer

    def build(tmp_path, **overrides):
        args = TLTGRPOConfig(**{**grpo_kwargs(tmp_path / "run"), **overrides})
        return TLTGRPOTrainer(model=policy(), reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                              processing_class=char_tokenizer())

    return build


def test_resume_without_tlt_rng_state_says_the_run_is_not_reproducible(tmp_path, trl_parts):
    from tlt_trainers.trl import trainer as trainer_module

    trainer = trl_parts(tmp_path)
    checkpoint = tmp_path / "checkpoint-3"  # as stock GRPOTrainer writes it: no tlt_rng_state_0.pth
    checkpoint.mkdir()
    with captured_warnings(trainer_module.logger) as calls:
        trainer._load_rng_state(str(checkpoint))
    assert len(calls) == 1 and "tlt_rng_state_0.pth" in calls[0] and "not reproduce" in calls[0], calls


def test_warmup_that_cannot_sample_the_rollouts_law_says_so(tmp_path, trl_parts):
    """A generation setting the engine does not reproduce sends rollouts to TRL's generate; the drafter's own
    sampling then uses TRL's plain settings, and says so."""
    from tlt_trainers.trl import trainer as trainer_module

    with captured_warnings(trainer_module.logger) as calls:
        trainer = trl_parts(tmp_path, generation_kwargs={"no_repeat_ngram_size": 2})
    assert trainer._tlt_stock_reason is not None
    warmup = [c for c in calls if "warm-up" in c]
    assert len(warmup) == 1 and "no_repeat_ngram_size" in warmup[0], calls


def test_dropped_vllm_weight_warnings_are_announced_once():
    from tlt_trainers.vllm import worker

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    announcer = logging.getLogger("vllm.tlt_trainers")
    announcer.addHandler(handler)
    old_level = announcer.level
    announcer.setLevel(logging.INFO)
    worker._DropSharedLayerWarnings.announced = False
    quiet = worker._DropSharedLayerWarnings()

    def record(message):
        return logging.LogRecord("vllm.layerwise", logging.WARNING, __file__, 1, message, None, None)

    try:
        shared = [record("ParallelLMHead: Failed to load weights"), record("VocabParallelEmbedding: Failed to load "
                  "weights"), record("Llama3RotaryEmbedding: Failed to load weights")]
        assert [quiet.filter(r) for r in shared] == [False, False, False]
        assert quiet.filter(record("LlamaDecoderLayer: Failed to load weights"))  # the drafter's own: shown
        assert quiet.filter(record("something else"))
        worker._DropSharedLayerWarnings().filter(shared[0])  # a later reload in the same process: no new line
    finally:
        announcer.removeHandler(handler)
        announcer.setLevel(old_level)
    lines = [line for line in stream.getvalue().splitlines() if line]
    assert len(lines) == 1 and "Failed to load weights" in lines[0] and "ParallelLMHead" in lines[0], lines


def _page(drafts: int, accepted: int) -> str:
    return "\n".join([
        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}.0',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {3 * drafts}.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}.0',
    ])


def test_unreadable_metrics_never_give_a_negative_delta(monkeypatch):
    pytest.importorskip("verl")
    from verl.checkpoint_engine.base import CheckpointEngineManager

    from tlt_trainers.verl import vllm_manager

    monkeypatch.setattr(CheckpointEngineManager, "__init__", lambda self, *a, **k: None)
    manager = vllm_manager.TLTCheckpointEngineManager()
    manager.replicas = [SimpleNamespace(server_address="a:1"), SimpleNamespace(server_address="b:2")]
    pages = {"a:1": [_page(10, 5), _page(20, 12), _page(30, 20)], "b:2": [_page(4, 2), OSError("refused"),
                                                                          _page(12, 9)]}

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def urlopen(url, timeout):
        page = pages[url.split("//")[1].split("/")[0]].pop(0)
        if isinstance(page, Exception):
            raise page
        return Response(page.encode())

    monkeypatch.setattr(vllm_manager.urllib.request, "urlopen", urlopen)
    with captured_warnings(vllm_manager.logger) as calls:
        deltas = [manager.spec_decode_counters() for _ in range(3)]
    assert [d.num_drafts for d in deltas] == [14, 10, 18]  # b's missed interval arrives with its next reading
    assert [d.num_accepted_tokens for d in deltas] == [7, 7, 15]
    assert sum(d.num_drafts for d in deltas) == 30 + 12  # every draft counted once
    assert len(calls) == 1 and "b:2" in calls[0], calls
