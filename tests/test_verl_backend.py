"""The veRL adapter on CPU with a local Ray: config composition, and the tlt backend generating through veRL's
real LLMServerManager, load balancer, AgentLoopManager and agent-loop workers.

Needs the ``[verl]`` extra (skipped without it). Tiny random Llama with a character tokenizer, saved to disk,
since veRL loads models and tokenizers by path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tiny_models import EOS, PAD, save_with_char_tokenizer, tiny_model  # noqa: E402
from verl_runs import CHAT_TEMPLATE  # noqa: E402

from tlt_trainers.verl import TLTSection, check_tlt_config  # noqa: E402

QUESTIONS = ["1+2", "3*4-5", "7+8+9", "(2+3)*4", "10-6", "9*9"]


def compose_config(*overrides: str):
    with initialize_config_module(config_module="tlt_trainers.verl.config", version_base=None):
        return compose(config_name="tlt_ppo_trainer", overrides=list(overrides))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_model("llama", vocab_size=64, seed=5, logit_scale=4.0)
    model.generation_config.eos_token_id = EOS
    return save_with_char_tokenizer(model, path, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def backend_config(model_dir, replicas: int = 1, *overrides: str):
    return compose_config(
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={replicas}",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.rollout.response_length=24",
        "actor_rollout_ref.rollout.prompt_length=32",
        "data.max_prompt_length=32",
        "data.max_response_length=24",
        *overrides,
    )


def prompts_batch(n_repeat: int = 1):
    from verl.protocol import DataProto

    questions = [q for q in QUESTIONS for _ in range(n_repeat)]
    raw = np.empty(len(questions), dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in questions]
    return DataProto.from_dict(non_tensors={"raw_prompt": raw, "index": np.arange(len(questions)),
                                            "data_source": np.array(["arith"] * len(questions), dtype=object)})


# ----------------------------------------------------------------------------- config
def test_config_composes_with_tlt_backend():
    config = compose_config("tlt.speculation=always", "tlt.num_speculative_tokens=3")
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "tlt"
    assert rollout.agent.agent_loop_manager_class.endswith("TLTAgentLoopManager")
    assert config.trainer.use_v1 is False
    section = TLTSection.from_mapping(OmegaConf.to_container(rollout.custom, resolve=True)["tlt"])
    assert section.speculation == "always" and section.num_speculative_tokens == 3
    assert check_tlt_config(config) == section
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size is not None  # veRL's defaults are all there


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="Unknown key"):
        TLTSection.from_mapping({"speculaton": "always"})
    with pytest.raises(ValueError, match="speculation"):
        TLTSection.from_mapping({"speculation": "sometimes"})
    with pytest.raises(ValueError, match="rollout.name=tlt"):
        check_tlt_config(compose_config("actor_rollout_ref.rollout.name=sglang"))
    with pytest.raises(ValueError, match="agent_loop_manager_class=null"):  # vLLM: rollout_backend=vllm sets it
        check_tlt_config(compose_config("actor_rollout_ref.rollout.name=vllm"))
    with pytest.raises(ValueError, match="use_v1=false"):
        check_tlt_config(compose_config("trainer.use_v1=true"))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        check_tlt_config(compose_config("actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    with pytest.raises(ValueError, match="batch_wait_ms"):
        check_tlt_config(compose_config("tlt.batch_wait_ms=-1"))


# ----------------------------------------------------------------------------- backend through veRL
def make_managers(config):
    from verl.workers.rollout.llm_server import LLMServerManager

    from tlt_trainers.verl.manager import TLTAgentLoopManager

    servers = LLMServerManager.create(config=config)
    agents = TLTAgentLoopManager.create(config=config, llm_client=servers.get_client())
    return servers, agents


@pytest.fixture
def rollout_actors(local_ray):
    """Kills the test's named server actors and agent-loop workers afterwards (names are reused by the next test)."""
    made = []
    yield made
    for agents in made:
        for actor in [*(agents._servers or []), *agents.agent_loop_workers]:
            ray.kill(actor)


def reference_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=PAD)
    completion = out[0, len(prompt_ids):].tolist()
    return completion[: completion.index(EOS) + 1] if EOS in completion else completion


@pytest.mark.parametrize("architecture", ["auto", "block"])
def test_greedy_rollout_through_agent_loop_matches_generate(model_dir, rollout_actors, architecture):
    config = backend_config(model_dir, 1, "actor_rollout_ref.rollout.temperature=0",
                            "tlt.speculation=always", "tlt.num_speculative_tokens=3",
                            f"tlt.drafter_architecture={architecture}")
    servers, agents = make_managers(config)
    rollout_actors.append(agents)
    assert [type(r).__name__ for r in servers.get_replicas()] == ["TLTReplica"]
    output = agents.generate_sequences(prompts_batch())
    assert len(output) == len(QUESTIONS)
    prompts, responses = output.batch["prompts"], output.batch["responses"]
    mask = output.batch["attention_mask"]
    for row in range(len(QUESTIONS)):
        prompt_ids = prompts[row][mask[row, : prompts.shape[1]].bool()].tolist()
        response = responses[row][output.batch["response_mask"][row].bool()].tolist()
        assert response == reference_greedy(model_dir, prompt_ids, 24), f"row {row} differs from generate"
    if architecture == "block":  # the replica drafts with a block drafter (its learnt mask embedding)
        assert "mask_embedding" in ray.get(agents.servers[0].drafter_state.remote())["state"]
    metrics = agents.pop_metrics()
    # speculation=always with chains of 3: every step with room for a draft speculates (a step with one token left
    # decodes plainly: one such step in a 24-token rollout), each emitting between 1 and 4 tokens
    assert metrics["tlt/speculative_step_fraction"] > 0.9
    assert 1.0 <= metrics["tlt/acceptance_length"] <= 4.0
    assert metrics["tlt/drafter_steps"] >= 1
    # The replica trained either while an agent-loop worker was still post-processing (idle) or after the rollout.
    if metrics["tlt/drafter_trigger_idle"]:
        assert metrics["tlt/drafter_idle_seconds"] > 0
    else:
        assert metrics["tlt/drafter_update_seconds"] > 0


def test_sampled_rollout_trains_and_syncs_drafters_across_replicas(model_dir, rollout_actors, tmp_path):
    config = backend_config(model_dir, 2, "actor_rollout_ref.rollout.temperature=1.0",
                            "tlt.speculation=always", "tlt.num_speculative_tokens=2", "tlt.seed=3")
    servers, agents = make_managers(config)
    rollout_actors.append(agents)
    handles = agents.servers
    assert len(handles) == 2
    for _ in range(2):
        output = agents.generate_sequences(prompts_batch(n_repeat=2))
        assert len(output) == 2 * len(QUESTIONS)
        metrics = agents.pop_metrics()
        assert metrics["tlt/drafter_steps"] >= 1
    states = ray.get([h.drafter_state.remote() for h in handles])
    for name, tensor in states[0]["state"].items():  # every replica drafts with the same (merged) drafter
        assert torch.equal(tensor, states[1]["state"][name]), name
    served = ray.get([h.rollout_stats.remote() for h in handles])
    assert all(s["rows"] == 0 for s in served)  # counters were reset by the manager after each rollout

    # The drafter checkpoint TLTPPOTrainer writes into global_step_N/drafter, and its restore on resume.
    folder = str(tmp_path / "global_step_2" / "drafter")
    assert ray.get(handles[0].save_drafter.remote(folder))
    zeroed = {**states[1], "state": {k: torch.zeros_like(v) for k, v in states[1]["state"].items()}}
    ray.get(handles[1].load_drafter_state.remote(zeroed))
    assert ray.get(handles[1].load_drafter.remote(folder))
    restored = ray.get(handles[1].drafter_state.remote())
    for name, tensor in states[0]["state"].items():
        assert torch.equal(tensor, restored["state"][name]), name
    assert restored["total_steps"] == states[0]["total_steps"]


@pytest.mark.parametrize("keep", [False, True], ids=["given-back", "kept"])
def test_the_rollout_gives_the_engines_memory_back(model_dir, rollout_actors, keep):
    """After a training rollout the manager has each server free its engine's graph session (``cuda_graphs="static"``:
    the CPU stand-in for CUDA graphs) before the drafter update and the step, unless tlt.keep_engine_memory."""
    config = backend_config(model_dir, 1, "actor_rollout_ref.rollout.temperature=1.0", "tlt.speculation=always",
                            "tlt.num_speculative_tokens=2", "tlt.cuda_graphs=static",
                            f"tlt.keep_engine_memory={str(keep).lower()}")
    servers, agents = make_managers(config)
    rollout_actors.append(agents)
    output = agents.generate_sequences(prompts_batch())
    assert len(output) == len(QUESTIONS)
    assert agents.pop_metrics()["tlt/speculative_step_fraction"] > 0  # the rollout ran through the tlt server
    held = ray.get(agents.servers[0].engine_memory.remote())
    assert held > 0 if keep else held == 0


def test_vllm_engine_kwargs_point_at_an_exported_drafter(tmp_path):
    from tlt_trainers import EagleDrafter
    from tlt_trainers.verl.vllm import vllm_engine_kwargs

    policy = tiny_model("llama", vocab_size=64, seed=1)
    kwargs = vllm_engine_kwargs(EagleDrafter.from_target(policy), tmp_path / "drafter_vllm", policy,
                                num_speculative_tokens=4)
    spec = kwargs["speculative_config"]
    assert spec["method"] == "eagle" and spec["num_speculative_tokens"] == 4
    assert (tmp_path / "drafter_vllm" / "config.json").is_file()
