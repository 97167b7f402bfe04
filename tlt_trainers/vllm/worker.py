"""Inside vLLM's worker: replace the EAGLE drafter's weights in a running engine.

Start the engine with ``LLM(..., worker_extension_cls="tlt_trainers.vllm.worker.DrafterReloadExtension")``; vLLM then
adds this class to its worker's bases, and ``llm.collective_rpc("tlt_reload_drafter", args=(weights,))`` runs
:func:`reload_drafter_weights` in every worker. Method names carry a ``tlt_`` prefix because vLLM refuses an
extension whose attributes collide with the worker's own (it has ``reload_weights``).

Why vLLM's layer-by-layer reload, not ``draft_model.load_weights`` alone: after loading, vLLM post-processes some
layers' weights into kernel formats (the CPU backend repacks linear weights and leaves ``layer.weight`` empty), so a
second plain ``load_weights`` finds parameters of size 0. ``initialize_layerwise_reload`` puts the layers back in
checkpoint form (on the meta device), ``load_weights`` fills them and re-runs each layer's processing once all its
tensors arrived, writing the result into the storage the engine already uses; ``finalize_layerwise_reload`` restores
the layers that received nothing (the target's embedding and LM head, which the drafter shares). This is what
vLLM's own ``reload_weights`` does for the target model, applied to the draft model with its own model config.

This module imports vLLM only inside functions, so it imports (and its names can be documented) without vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from ..drafter.config import WEIGHTS_NAME
from ..drafter.export import eagle_state_dict_to_vllm
from ._install import require_vllm

logger = logging.getLogger("vllm.tlt_trainers")  # under vLLM's logger: its handler and level

_VLLM_PREFIXES = ("fc.", "layers.0.")
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def expected_drafter_shapes(hf_config, method: str = "eagle") -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes of a Llama drafter with this (draft) config, as vLLM's
    ``EagleLlamaForCausalLM`` (``method="eagle"``) or ``Eagle3LlamaForCausalLM`` (``"eagle3"``) ``load_weights``
    reads them: every one must come in a reload, with this shape."""
    h, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or h // heads)
    inter = int(hf_config.intermediate_size)
    if method == "dflash":
        return _dflash_shapes(hf_config, h, heads, kv, head_dim, inter)
    if method == "eagle3":
        layers = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or [0, 0, 0]
        draft_vocab = int(getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size)
        shapes = {"fc.weight": (h, len(layers) * int(getattr(hf_config, "target_hidden_size", None) or h)),
                  "midlayer.hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
        shapes |= _layer_shapes("midlayer.", h, heads, kv, head_dim, inter, qkv_input=2 * h)  # [embed; feature]
        for i in range(1, int(getattr(hf_config, "num_hidden_layers", 1) or 1)):  # a deeper drafter's later layers
            shapes |= _layer_shapes(f"layers.{i}.", h, heads, kv, head_dim, inter)
        if draft_vocab != int(hf_config.vocab_size):
            shapes |= {"d2t": (draft_vocab,), "t2d": (int(hf_config.vocab_size),)}
        return shapes
    # EAGLE-1: the first layer has no input norm in vLLM's EagleLlamaForCausalLM
    return {"fc.weight": (h, 2 * h)} | _layer_shapes("layers.0.", h, heads, kv, head_dim, inter, input_norm=False)


def _layer_shapes(prefix: str, h: int, heads: int, kv: int, head_dim: int, inter: int, qkv_input: int | None = None,
                  input_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """One Llama-style decoder layer's tensors under ``prefix``: q/k/v over ``qkv_input`` (default ``h``), o, the
    norms and the gated MLP."""
    x = qkv_input or h
    return ({prefix + "input_layernorm.weight": (h,)} if input_norm else {}) | {
        prefix + "self_attn.q_proj.weight": (heads * head_dim, x),
        prefix + "self_attn.k_proj.weight": (kv * head_dim, x),
        prefix + "self_attn.v_proj.weight": (kv * head_dim, x),
        prefix + "self_attn.o_proj.weight": (h, heads * head_dim),
        prefix + "post_attention_layernorm.weight": (h,),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
    }


def _dflash_shapes(hf_config, h: int, heads: int, kv: int, head_dim: int, inter: int) -> dict[str, tuple[int, ...]]:
    """``DFlashQwen3ForCausalLM``'s checkpoint (what :func:`~tlt_trainers.drafter.export_block.block_weights`
    writes): fc and hidden_norm over the aux layers, Qwen3 layers, norm, own head and, with a draft vocabulary,
    d2t/t2d."""
    dflash = getattr(hf_config, "dflash_config", None) or {}
    aux = len(dflash.get("target_layer_ids") or [0])
    draft_vocab = int(getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size)
    shapes = {"fc.weight": (h, aux * int(getattr(hf_config, "target_hidden_size", None) or h)),
              "hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
    for i in range(int(hf_config.num_hidden_layers)):
        layer = f"layers.{i}."  # Qwen3 layers: q/k norms beside the Llama tensors
        shapes |= _layer_shapes(layer, h, heads, kv, head_dim, inter) | {
            layer + "self_attn.q_norm.weight": (head_dim,), layer + "self_attn.k_norm.weight": (head_dim,)}
    if draft_vocab != int(hf_config.vocab_size):
        shapes |= {"d2t": (draft_vocab,), "t2d": (int(hf_config.vocab_size),)}
    return shapes


def to_vllm_names(weights: dict[str, torch.Tensor], *, embed_scale: float | None = None,
                  full_vocab_head: bool = False, method: str = "eagle") -> dict[str, torch.Tensor]:
    """Weights under vLLM's checkpoint names: given as such (``fc.*``, ``layers.0.*``) they pass unchanged, an
    EagleDrafter state dict (``fc.*``, ``self_attn.*``, ``mlp.*``, ...) goes through the export mapping
    (:func:`~tlt_trainers.drafter.export.eagle_state_dict_to_vllm`; ``embed_scale`` for a scaled policy embedding).
    EAGLE-3 and DFlash weights come as :func:`~tlt_trainers.drafter.export_eagle3.eagle3_weights` and
    :func:`~tlt_trainers.drafter.export_block.block_weights` write them (``d2t`` as offsets) and pass unchanged."""
    if method in ("eagle3", "dflash") or all(name.startswith(_VLLM_PREFIXES) for name in weights):
        return dict(weights)
    return eagle_state_dict_to_vllm(weights, embed_scale=embed_scale, full_vocab_head=full_vocab_head)


class _DropSharedLayerWarnings(logging.Filter):
    """A drafter reload sends only the drafter's own tensors. The draft model also holds modules whose tensors no
    checkpoint carries: the target's embedding and LM head (shared) and the rotary embedding's cos/sin cache
    (shared with the target's layers). vLLM's finalize step puts those back as they were and warns
    "<class>: Failed to load weights" for each; expected here, so dropped for those classes only (the drafter's own
    layers are checked beforehand to receive every tensor)."""

    SHARED = ("VocabParallelEmbedding", "ParallelLMHead")
    announced = False  # once per process: the first drop says what is dropped and why

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Failed to load weights" not in message:
            return True
        owner = message.split(":", 1)[0].strip()
        if not (owner in self.SHARED or owner.endswith("RotaryEmbedding")):
            return True
        if not _DropSharedLayerWarnings.announced:
            _DropSharedLayerWarnings.announced = True
            logger.info("tlt_trainers: a drafter reload sends only the drafter's own tensors; vLLM's \"Failed to load "
                        "weights\" warnings for the modules the drafter shares with the policy (%s, the embedding, "
                        "the LM head and the rotary cache) are expected and not shown (first: %r).",
                        ", ".join(self.SHARED), message)
        return False


def _draft_model_and_config(worker):
    spec = getattr(worker.vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        raise RuntimeError(
            "This vLLM engine runs no drafter: start it with speculative_config=tlt_trainers.vllm.speculative_config("
            "export_dir, k) (VLLMDrafterSync.engine_kwargs() gives it)."
        )
    if spec.method not in ("eagle", "eagle3", "dflash"):
        raise RuntimeError(
            f"This engine speculates with method={spec.method!r}; DrafterReloadExtension reloads the drafters "
            "tlt_trainers exports (method='eagle' for EagleDrafter, 'eagle3' for Eagle3Drafter, 'dflash' for "
            "BlockDrafter)."
        )
    get_draft_model = getattr(worker.model_runner, "get_draft_model", None)
    model = get_draft_model() if callable(get_draft_model) else None
    if model is None:
        raise RuntimeError(f"{type(worker.model_runner).__name__} exposes no draft model (get_draft_model) in this "
                           "vLLM: drafter reload is not supported by this version.")
    return model, spec


def drafter_info(worker) -> dict:
    """What the engine's drafter is: method, folder, shapes and dtype (for the trainer-side checks)."""
    model, spec = _draft_model_and_config(worker)
    hf = spec.draft_model_config.hf_config
    target = worker.vllm_config.model_config
    return {
        "method": spec.method,
        "model": spec.model,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "draft_class": type(model).__name__,
        "hidden_size": int(hf.hidden_size),
        "vocab_size": int(hf.vocab_size),
        "num_hidden_layers": int(hf.num_hidden_layers),
        "dtype": str(spec.draft_model_config.dtype).removeprefix("torch."),
        "target_hidden_size": int(target.hf_text_config.hidden_size),
        "target_vocab_size": int(target.get_vocab_size()),
        "pid": os.getpid(),
    }


def reload_drafter_weights(worker, weights: dict[str, torch.Tensor] | bytes | None = None,
                           path: str | os.PathLike | None = None, *, embed_scale: float | None = None,
                           full_vocab_head: bool = False) -> dict:
    """Load new drafter weights into ``worker``'s running draft model; return ``{"seconds", "tensors"}``.

    ``weights``: vLLM checkpoint names (what :func:`~tlt_trainers.drafter.export.vllm_weights` returns) or an
    EagleDrafter state dict (converted by the export mapping), either as tensors or as one safetensors blob
    (``safetensors.torch.save``: what crosses vLLM's RPC to worker processes, whose msgpack turns tensors in untyped
    arguments into lists). ``path``: an export folder (or its model.safetensors) instead. Every tensor of the
    drafter must come, with its shape: a partial reload would leave layers half old. A reload that fails half way
    puts the last good drafter back (the last one pushed, or the served folder's) and raises saying so. A DFlash
    drafter's mask embedding is not a checkpoint tensor: vLLM reads it from the served folder's mask_embedding.pt, which
    :meth:`~tlt_trainers.vllm.sync.VLLMDrafterSync.push` rewrites first.
    """
    start = time.perf_counter()
    require_vllm()
    if (weights is None) == (path is None):
        raise ValueError("Pass exactly one of weights (a state dict) and path (an export folder).")
    if path is not None:
        from safetensors.torch import load_file

        file = Path(path)
        file = file / WEIGHTS_NAME if file.is_dir() else file
        weights = load_file(str(file))
    elif isinstance(weights, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        weights = load(bytes(weights))
    bad = sorted(name for name, value in weights.items() if not isinstance(value, torch.Tensor))
    if bad:
        raise TypeError(f"Drafter weights must be tensors; {bad[:3]} are not (across processes, send a safetensors "
                        "blob: VLLMDrafterSync.push does).")
    model, spec = _draft_model_and_config(worker)
    weights = to_vllm_names(weights, embed_scale=embed_scale, full_vocab_head=full_vocab_head, method=spec.method)
    expected = expected_drafter_shapes(spec.draft_model_config.hf_config, spec.method)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(f"{name} {tuple(weights[name].shape)} (engine: {expected[name]})"
                   for name in set(expected) & set(weights) if tuple(weights[name].shape) != expected[name])
    if missing or extra or wrong:
        raise ValueError(
            f"These weights do not fit the engine's drafter ({spec.model}): missing {missing}, unexpected {extra}, "
            f"wrong shapes {wrong}. Push a drafter of the same shape as the one the engine started with (same "
            "policy, same EagleDrafterConfig), or restart the engine with the new export."
        )
    dtype = spec.draft_model_config.dtype
    tensors = [(name, tensor.detach().to(dtype=dtype if tensor.is_floating_point() else tensor.dtype).contiguous())
               for name, tensor in weights.items()]

    try:
        _load_into(worker, model, spec, tensors)
    except Exception as err:
        # Some layers may hold the new weights already: put the last good drafter back whole, so the engine goes on
        # drafting with it (the target verifies every token either way; a half-loaded drafter only drafts badly).
        good = getattr(worker, "_tlt_last_good", None)
        source = "the last drafter pushed"
        if good is None:
            from safetensors.torch import load_file

            good = to_vllm_names(load_file(str(Path(spec.model) / WEIGHTS_NAME)), method=spec.method)
            good = [(name, t.to(dtype=dtype if t.is_floating_point() else t.dtype)) for name, t in good.items()]
            source = f"the drafter the engine started with ({spec.model})"
        try:
            _load_into(worker, model, spec, good)
        except Exception as again:
            raise RuntimeError(f"The drafter reload failed ({err!r}) and restoring {source} failed too ({again!r}): "
                               "this engine's drafter is broken; restart the engine.") from err
        raise RuntimeError(f"The drafter reload failed half way ({err!r}); the engine serves {source} again. The "
                           "new weights were not applied: check them (or the engine's log) and push again.") from err
    worker._tlt_last_good = tensors
    return {"seconds": time.perf_counter() - start, "tensors": len(tensors)}


def _load_into(worker, model, spec, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """vLLM's layer-by-layer reload of ``tensors`` into the running draft model (module doc)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    layerwise_logger = logging.getLogger(_LAYERWISE_LOGGER)
    quiet = _DropSharedLayerWarnings()
    layerwise_logger.addFilter(quiet)
    try:
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                model.load_weights(iter(tensors))
            finally:
                finalize_layerwise_reload(model, spec.draft_model_config)
            if spec.method == "dflash":
                refresh_dflash_context_buffers(model, dict(tensors))
    finally:
        layerwise_logger.removeFilter(quiet)


def refresh_dflash_context_buffers(model, weights: dict[str, torch.Tensor]) -> bool:
    """Rebuild a DFlash drafter's context buffers after a reload; True if its fused K/V projection was stale.

    vLLM 0.31's ``DFlashQwen3ForCausalLM.load_weights`` ends by caching what its context pass reads
    (``_build_fused_kv_buffers``, ``qwen3_dflash.py``): every layer's ``qkv_proj.weight`` K/V rows in one fused
    projection, the K-norm weights, the hidden norm and the rotary cos/sin cache. In a layer-by-layer reload that runs
    too early: the rotary cache is still a meta tensor (restored only by ``finalize_layerwise_reload``: "_C::
    rotary_embedding ... Meta tensors" at the next draft), and on vLLM's CPU backend the layers have already been
    repacked into its own format, which leaves ``weight`` empty (the fused projection gets no rows: "size mismatch,
    got input (n), mat (n x h), vec (0)"). Not reported upstream from here (no network); the fix is ours: the buffers
    are rebuilt after the finalize step, and the fused projection, where it lacks rows, from the tensors just loaded
    (vLLM's layout: per layer, K rows then V rows).
    """
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "_build_fused_kv_buffers"):
        return False
    inner._build_fused_kv_buffers()
    layers = range(len(inner.layers))
    rows = [torch.cat([weights[f"layers.{i}.self_attn.k_proj.weight"], weights[f"layers.{i}.self_attn.v_proj.weight"]])
            for i in layers]
    fused = getattr(inner, "_fused_kv_weight", None)
    if fused is None or fused.shape[0] == sum(r.shape[0] for r in rows):
        return False
    inner._fused_kv_weight = torch.cat(rows).to(device=inner.hidden_norm.weight.device, dtype=fused.dtype).contiguous()
    inner._fused_kv_bias = None
    return True


class DrafterReloadExtension:
    """vLLM worker extension (``worker_extension_cls``): ``tlt_drafter_info`` and ``tlt_reload_drafter``, reached
    through ``llm.collective_rpc(name, args=...)``. :class:`~tlt_trainers.vllm.sync.VLLMDrafterSync` calls them."""

    def tlt_drafter_info(self) -> dict:
        return drafter_info(self)

    def tlt_reload_drafter(self, weights: dict[str, torch.Tensor] | bytes | None = None, path: str | None = None,
                           embed_scale: float | None = None, full_vocab_head: bool = False) -> dict:
        return reload_drafter_weights(self, weights, path, embed_scale=embed_scale, full_vocab_head=full_vocab_head)
