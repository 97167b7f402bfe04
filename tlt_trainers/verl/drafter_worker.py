"""veRL's actor worker with TLT's drafter (``rollout.name=vllm``): the drafter trains on the actor's own forward.

veRL's vLLM rollout returns tokens only, so the policy's hidden states the drafter learns from come from the actor:
the old-log-prob pass (``compute_log_prob``, one no-grad forward over every rollout, which RayPPOTrainer runs anyway)
is observed with a forward hook on the policy's decoder, and every sequence's tokens and last hidden states enter
the drafter's buffer, copied per sequence as each micro-batch goes by. No extra policy forward. The reference pass
that veRL runs through the actor with LoRA (adapter off, ``no_lora_adapter``) is not captured: those are the base
model's features. FSDP actors only (``configure_vllm_rollout`` refuses others while the drafter is on).

Actor rank 0 owns the drafter and its trainer (other ranks return nothing): it sees its own data-parallel share of
each batch. The drafter reads the policy's embedding and LM head; rank 0 keeps a plain copy of those two tensors,
taken from the weights veRL streams to the rollout at every policy sync (the stream every rank walks anyway, so no
extra gather), which are exactly the weights the rollout and the old-log-prob pass used. The rest of that
``PolicyShell`` stays on the meta device.

The trainer (``TLTPPOTrainer``) calls, each dispatched to every rank (``Dispatch.ONE_TO_ALL``):
``tlt_train_drafter(seconds)`` after the old-log-prob pass, ``tlt_drafter_weights()`` from the checkpoint manager
after each policy sync (the blob it pushes to vLLM, or none when vLLM already holds that version),
``tlt_save_drafter(dir)`` / ``tlt_load_drafter(dir)`` with the trainer's checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from ..drafter.export import export_vllm, vllm_weights
from ..kinds.setup import rollout_drafter
from ..online import train_slice
from ..vllm.sync import _torch_dtype
from .settings import TLTSection
from .vllm import drafter_export_dir, drafter_trains, num_speculative_tokens

logger = logging.getLogger(__name__)


class PolicyShell(nn.Module):
    """The policy as the drafter sees it: the real architecture on the meta device, except the input embedding and
    LM head, which hold real copies (filled by :meth:`load`). Enough for ``EagleDrafter`` and ``DrafterTrainer``,
    which read only the config, the embedding and the head."""

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(model).__name__} has no input/output embeddings: the drafter needs a causal LM.")
        tied = head.weight is embed.weight
        self.names = {name: "embed" for name, p in model.named_parameters(remove_duplicate=False)
                      if p is embed.weight}
        self.names.update({name: "head" for name, p in model.named_parameters(remove_duplicate=False)
                           if p is head.weight and not tied})
        embed.to_empty(device=device).to(dtype)
        if tied:
            head.weight = embed.weight
        else:
            head.to_empty(device=device).to(dtype)
        with torch.no_grad():
            embed.weight.zero_()
            head.weight.zero_()
        self.model, self.tied = model, tied
        self.config = model.config
        self.seen: set[str] = set()
        self._pending_checks: list = []

    def defer_weight_check(self, check) -> None:
        """Run ``check()`` once the policy's embedding and head have arrived with veRL's first weight sync (a
        published drafter's copies of them are checked against the policy's; the shell holds zeros until then)."""
        self._pending_checks.append(check)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def get_decoder(self) -> nn.Module:
        return self.model.get_decoder()

    def watch(self, params: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass veRL's weight stream through, copying the embedding and LM head as they go by."""
        self.seen = set()
        for name, tensor in params:
            role = self.names.get(name)
            if role is not None:
                self.load(role, tensor)
                self.seen.add(role)
            yield name, tensor
        if self._pending_checks and set(self.names.values()) <= self.seen:
            checks, self._pending_checks = self._pending_checks, []
            for check in checks:
                check()

    @torch.no_grad()
    def load(self, role: str, tensor: torch.Tensor) -> None:
        module = self.get_input_embeddings() if role == "embed" else self.get_output_embeddings()
        if hasattr(tensor, "full_tensor"):  # a DTensor
            tensor = tensor.full_tensor()
        module.weight.copy_(tensor.to(module.weight.device, module.weight.dtype))


def sequences_from_forward(kwargs: dict, hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens [n], features [n - 1, H]) per sequence of one decoder forward, padded or packed.

    Padded (veRL without remove-padding): ``input_ids`` [B, L] with a 2-D ``attention_mask``. Packed (remove-padding):
    ``input_ids`` [1, N] of concatenated sequences whose ``position_ids`` restart at 0.
    """
    ids = kwargs.get("input_ids")
    if ids is None or hidden is None:
        return []
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    pairs = []
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == ids.shape:
        for row in range(ids.shape[0]):
            keep = mask[row].bool()
            pairs.append((ids[row][keep], hidden[row][keep]))
    elif ids.shape[0] == 1 and isinstance(positions, torch.Tensor):
        flat = positions.reshape(-1, positions.shape[-1])[0]  # mrope: the first (temporal) row
        starts = (flat == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for start, end in zip(starts[:-1], starts[1:]):
            pairs.append((ids[0, start:end], hidden[0, start:end]))
    else:
        for row in range(ids.shape[0]):
            pairs.append((ids[row], hidden[row]))
    return [(tokens, features[:-1]) for tokens, features in pairs if tokens.numel() >= 2]


class DrafterOwner:
    """Actor rank 0's drafter: its policy shell, trainer, vLLM export, checkpoints."""

    def __init__(self, hf_config, section: TLTSection, device: torch.device, export_dir: str | None,
                 num_speculative_tokens: int, verifier: str | None):
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.shell = PolicyShell(hf_config, device, dtype)
        if section.draft_vocab_size is None:  # vLLM's EAGLE-1 drafts over the full vocabulary
            section = dataclasses.replace(section, draft_vocab_size=0)
        self.settings = section
        self.drafter, self.trainer, self.draft_vocab_ready = rollout_drafter(self.shell, section, section.seed,
                                                                             engine="vllm-eagle1")
        self.full_vocab_head = self.drafter.config.uses_draft_vocab
        self.version = 0  # bumps with every training call that stepped and every load
        self.export_dir = export_dir
        if export_dir is not None:  # where vLLM's EAGLE loader reads the drafter at start-up
            export_vllm(self.drafter, export_dir, verifier, num_speculative_tokens=num_speculative_tokens,
                        full_vocab_head=self.full_vocab_head)

    @property
    def trains(self) -> bool:
        """Whether the drafter trains during RL (0 for drafter_update_seconds, drafter_update_fraction or
        drafter_max_steps_per_update switches it off; then no features are captured either)."""
        return drafter_trains(self.settings)

    def add(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Buffer each sequence as its own copy (``pairs`` may be views into a micro-batch's hidden states, which
        must not stay alive with the buffer), cut to the buffer's window first."""
        dtype = self.shell.get_output_embeddings().weight.dtype
        window = self.trainer.buffer.max_tokens
        for tokens, features in pairs:
            start = max(0, features.shape[0] - window)
            self.trainer.add_features(tokens[start:].detach().clone(),
                                      features[start:].detach().to(dtype=dtype, copy=True))

    def train(self, max_seconds: float) -> dict:
        """At least one micro-step, then until ``max_seconds`` (or drafter_max_steps_per_update) are spent. The
        trainer does not call this when training is switched off (:attr:`trains`)."""
        trainer = self.trainer
        max_steps = self.settings.drafter_max_steps_per_update
        if len(trainer.buffer) == 0 or max_steps == 0:
            return {"steps": 0}
        if self.shell.seen != ({"embed"} if self.shell.tied else {"embed", "head"}):
            raise RuntimeError(f"The drafter has not received the policy's embedding and LM head from veRL's weight "
                               f"sync (saw {sorted(self.shell.seen)} of the names {sorted(self.shell.names)}); "
                               "TLT's drafter needs full (merged) weights: set actor_rollout_ref.model.lora.merge=True "
                               "with LoRA.")
        metrics = train_slice(trainer, max_seconds, max_steps=max_steps, at_least_one=True,
                              rebuild_draft_vocab=not self.draft_vocab_ready)
        self.draft_vocab_ready = True
        if metrics.get("steps", 0):
            self.version += 1
        return metrics

    def weights(self, dtype: torch.dtype | None) -> bytes:
        from safetensors.torch import save

        return save(vllm_weights(self.drafter, full_vocab_head=self.full_vocab_head, dtype=dtype))

    def save(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)  # weights, optimizer, step; a drafter of other settings is an error
        self.draft_vocab_ready = True
        self.version += 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _reference_pass(data) -> bool:
    """Whether this ``compute_log_prob`` call is veRL's reference pass rather than the old-log-prob pass: with LoRA the
    reference policy is the actor without its adapter (``ref_in_actor``), and ``_compute_ref_log_prob`` marks the
    call ``no_lora_adapter=True``, the flag that makes the actor drop the adapter (``infer_batch``). Its features are
    the base model's, not the policy's."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    if isinstance(data, TensorDict):
        return bool(tu.get(data, "no_lora_adapter", default=False))
    return bool((getattr(data, "meta_info", None) or {}).get("no_lora_adapter", False))


def _hf_config(worker):
    """The policy's Hugging Face config as veRL built it for the actor (override_config applied), else read from the
    model's path."""
    hf_config = getattr(getattr(worker.actor, "model_config", None), "hf_config", None)
    if hf_config is not None:
        return hf_config
    from transformers import AutoConfig

    model_config = worker.config.model
    path = model_config.get("local_path") or model_config.path
    return AutoConfig.from_pretrained(path, trust_remote_code=bool(model_config.get("trust_remote_code")))


class TLTActorRolloutRefWorker(ActorRolloutRefWorker):
    """veRL's hybrid actor/rollout/ref worker, plus the drafter on actor rank 0 (see the module's docstring)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        self._tlt: DrafterOwner | None = None
        if "actor" not in self.role:
            return
        from .replica import section_of

        section = section_of(self.config.rollout)
        if section.speculation == "never":
            return
        engine = self.actor.engine
        if _rank() == 0:
            from verl.utils.device import get_device_name

            model_config = self.config.model
            path = model_config.get("local_path") or model_config.path
            device = torch.device(get_device_name())
            self._tlt = DrafterOwner(_hf_config(self), section, device, drafter_export_dir(self.config.rollout),
                                     num_speculative_tokens(section), path)
        original = engine.get_per_tensor_param
        owner = self._tlt

        def get_per_tensor_param(*args, **kwargs):
            params, peft_config = original(*args, **kwargs)
            return (owner.shell.watch(params) if owner is not None else params), peft_config

        engine.get_per_tensor_param = get_per_tensor_param  # every rank walks the stream; rank 0 keeps two tensors

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data):
        owner = getattr(self, "_tlt", None)
        if owner is None or not owner.trains or _reference_pass(data):
            return super().compute_log_prob(data)

        def hook(module, args, kwargs, output):  # one micro-batch: its sequences are copied into the buffer now
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            owner.add(sequences_from_forward(kwargs, hidden.detach()))

        handle = self.actor.engine.module.get_decoder().register_forward_hook(hook, with_kwargs=True)
        try:
            return super().compute_log_prob(data)
        finally:
            handle.remove()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_train_drafter(self, max_seconds: float) -> dict:
        owner = getattr(self, "_tlt", None)
        if owner is None:
            return {}
        metrics = owner.train(max_seconds)
        metrics.update(buffer_sequences=len(owner.trainer.buffer), total_steps=owner.trainer.step)
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_drafter_weights(self, dtype: str | None = None,
                            unless_version: int | None = None) -> tuple[int, bytes | None] | None:
        """(version, safetensors blob of vLLM's drafter tensors) on rank 0, the blob None when the drafter is still at
        ``unless_version``; None elsewhere or without a drafter."""
        owner = getattr(self, "_tlt", None)
        if owner is None:
            return None
        if unless_version is not None and owner.version == unless_version:
            return owner.version, None
        return owner.version, owner.weights(_torch_dtype(dtype) if dtype else None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_save_drafter(self, directory: str) -> bool:
        owner = getattr(self, "_tlt", None)
        if owner is None:
            return False
        owner.save(directory)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_load_drafter(self, directory: str) -> bool:
        owner = getattr(self, "_tlt", None)
        if owner is None or not os.path.isdir(directory):
            return False
        owner.load(directory)
        return True
