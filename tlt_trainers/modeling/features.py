"""The features a drafter reads, taken from a policy forward that runs anyway.

EAGLE-1 reads the decoder's final hidden state; EAGLE-3 reads the residual streams entering a few of the policy's
layers (vLLM's numbering: id 0 is the embedding output, id k >= 1 the output of decoder layer k - 1), concatenated.
Both come from forward hooks, so the verify passes, a trainer's no-grad log-prob pass or veRL's old-log-prob pass
hand them over without a second forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def _decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no .layers: EAGLE-3 features need a decoder with a list of "
                         "layers (Llama-style); use the EAGLE-1 drafter for this model.")
    return layers


def _tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.last_hidden_state


@contextlib.contextmanager
def capture_features(decoder: nn.Module, layers: tuple[int, ...] | None) -> Iterator[list[tuple]]:
    """Collect ``(features, final)`` for every forward of ``decoder`` within the block, detached.

    ``final`` is the decoder's last hidden state [B, L, H]; ``features`` is ``final`` when ``layers`` is None,
    else the hidden states entering ``layers`` concatenated [B, L, len(layers) * H].
    """
    captured: list[tuple] = []
    pending: dict[int, torch.Tensor] = {}
    handles = []

    def keep(layer_id):
        def hook(module, args, output):
            pending[layer_id] = _tensor(output).detach()
        return hook

    def finish(module, args, kwargs, output):
        final = _tensor(output).detach()
        if layers is None:
            captured.append((final, final))
            return
        missing = [k for k in layers if k not in pending]
        if missing:
            raise RuntimeError(f"The policy's forward skipped layers {missing}; cannot build EAGLE-3 features.")
        captured.append((torch.cat([pending[k] for k in layers], dim=-1), final))
        pending.clear()

    try:
        if layers is not None:
            modules = _decoder_layers(decoder)
            for layer_id in sorted(set(layers)):
                if not 0 <= layer_id <= len(modules):
                    raise ValueError(f"Feature layer {layer_id} is outside the policy's 0..{len(modules)}.")
                module = decoder.get_input_embeddings() if layer_id == 0 else modules[layer_id - 1]
                handles.append(module.register_forward_hook(keep(layer_id)))
        handles.append(decoder.register_forward_hook(finish, with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
