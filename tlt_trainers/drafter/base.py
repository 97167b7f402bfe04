"""The interface every drafter implements: what the engine, the proposers and the cost profile call.

A drafter reads the policy's features (hidden states the verify passes produce anyway) and scores tokens over its
draft vocabulary. Autoregressive drafters (:class:`AutoregressiveDrafter`) read the tokens that followed the
features, predict their next feature and draft one token per pass: EAGLE-1
(:class:`~tlt_trainers.drafter.eagle.EagleDrafter`: the policy's last hidden state in, the policy's LM head out)
and EAGLE-3 (:class:`~tlt_trainers.drafter.eagle3.Eagle3Drafter`: low, middle and high layers fused, its own head),
which the engine and the online trainer take without knowing which. A block drafter
(:class:`~tlt_trainers.drafter.block.BlockDrafter`, DFlash) drafts a whole block in one pass.

What every drafter shares lives here too: the binding to the policy's embedding (held by reference, never a
parameter of the drafter), the draft vocabulary, and save/load/push, which dispatch on ``config.architecture``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..modeling.kv_cache import RowKV
from ..modeling.target import compute_dtype
from .config import CONFIG_NAME, WEIGHTS_NAME, EagleDrafterConfig
from .files import StagedFiles, load_weights, staged_save
from .hub import download_drafter, push_drafter
from .registry import is_registered, kind_of, read_other_layout


class _TargetModules:
    """Plain holder so that the policy's modules are not registered as the drafter's submodules."""

    def __init__(self, embed: nn.Module, head: nn.Module):
        self.embed, self.head = embed, head


def _is_own_layout(directory: Path) -> bool:
    """Whether ``directory`` holds a drafter saved by this package (else another tool's layout, or nothing)."""
    import json

    try:  # our configs name a registered architecture and a format_version
        data = json.loads(Path(directory, CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return True  # missing or broken: EagleDrafterConfig.load says what is wrong
    return not isinstance(data, dict) or is_registered(str(data.get("architecture"))) or "format_version" in data


class Drafter(nn.Module, ABC):
    """A drafter bound to a policy: ``forward`` predicts features, ``logits`` scores them.

    ``d2t`` maps draft-vocabulary ids to the policy's token ids (None when the drafter scores the full
    vocabulary); verification always runs over the full vocabulary, so a small draft vocabulary stays lossless.
    """

    config: EagleDrafterConfig
    d2t: torch.Tensor | None

    @classmethod
    def check_config(cls, config: EagleDrafterConfig) -> None:
        """Refuse a config this kind cannot be built from (called when the config is made); none by default."""

    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        if config.architecture != type(self).__name__:
            raise ValueError(f"A {config.architecture} config cannot build a {type(self).__name__}; load it with "
                             "Drafter.from_pretrained, which picks the class from the config.")
        self.config = config
        if config.uses_draft_vocab:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self._target: _TargetModules | None = None

    # ----------------------------------------------------------------- what the engine asks
    @property
    @abstractmethod
    def feature_size(self) -> int:
        """Width of the policy features the drafter reads per token (the hidden size for EAGLE-1, 3x for EAGLE-3)."""

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The policy layers whose hidden states make the features (vLLM's aux-layer numbering), concatenated in
        this order; None: the policy's final (normed) hidden state."""
        return None

    @property
    def draft_vocab_size(self) -> int:
        """Number of tokens the drafter scores (``len(d2t)``, or the policy's vocabulary)."""
        return self.config.draft_vocab_size if self.config.uses_draft_vocab else self.config.vocab_size

    @abstractmethod
    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary for predicted features [..., H]."""

    def refresh_caches(self) -> None:
        """Bring what the drafter caches from the policy's weights up to date, in place (the engine calls it before
        replaying a step graph, which reads those caches by address). Nothing to do unless a kind caches."""

    def new_kv(self, capacity: int) -> RowKV:
        """An empty per-row KV cache of ``capacity`` slots for the drafter's own attention."""
        return RowKV(capacity)

    @property
    def drafts_blocks(self) -> bool:
        """Whether one pass drafts a whole block (its kind proposes ``block:K``, as
        :class:`~tlt_trainers.drafter.block.BlockDrafter` does) rather than one token (``chain:K`` and trees)."""
        return kind_of(self).drafts_blocks

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the policy's token ids."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    # ----------------------------------------------------------------- binding to the policy
    def _check_policy(self, model: nn.Module) -> None:
        """Refuse a policy this drafter was not made for (beyond hidden size and vocabulary)."""

    def bind(self, model: nn.Module) -> Drafter:
        """Attach the policy's embedding and LM head (by reference); check that shapes agree."""
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(model).__name__} exposes no input/output embeddings; cannot attach a drafter.")
        name = type(self).__name__
        target_hidden = embed.weight.shape[1]
        if target_hidden != self.config.hidden_size:
            raise ValueError(
                f"Drafter hidden_size={self.config.hidden_size} does not match the policy's {target_hidden}: this "
                f"drafter was made for another model. Create one with {name}.from_target(model)."
            )
        if head.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"Drafter vocab_size={self.config.vocab_size} does not match the policy's LM head "
                f"({head.weight.shape[0]} tokens): load the drafter trained for this model or use "
                f"{name}.from_target(model)."
            )
        self._check_policy(model)
        self._target = _TargetModules(embed, head)
        self._head_cache = None
        return self

    def ensure_bound(self, model: nn.Module) -> Drafter:
        """Bind to ``model`` unless already bound to its head, and check that device and dtype agree."""
        if self._target is None or self.target.head is not model.get_output_embeddings():
            self.bind(model)
        mine, theirs = next(self.parameters()), model.get_output_embeddings().weight
        dtype = compute_dtype(model)
        if mine.device != theirs.device or mine.dtype != dtype:
            raise ValueError(
                f"Drafter is on {mine.device}/{mine.dtype} but the policy on {theirs.device}/{dtype}: "
                "call drafter.to(device=..., dtype=...) to match."
            )
        return self

    @property
    def target(self) -> _TargetModules:
        if self._target is None:
            raise RuntimeError("This drafter is not bound to a policy: call drafter.bind(model) or pass target=model.")
        return self._target

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The policy's embedding of ``tokens`` (no gradient: the drafter never changes the policy)."""
        with torch.no_grad():
            return self.target.embed(tokens)

    # ----------------------------------------------------------------- draft vocabulary
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over ``token_ids`` (target ids, e.g. the most frequent tokens); verification stays full-vocabulary."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != self.draft_vocab_size or not self.config.uses_draft_vocab:
            raise ValueError(
                f"set_draft_vocab needs exactly draft_vocab_size={self.draft_vocab_size} ids and a drafter created "
                "with draft_vocab_size < vocab_size."
            )
        in_range = 0 <= token_ids.min() and token_ids.max() < self.config.vocab_size
        if not in_range or token_ids.unique().numel() != len(token_ids):
            raise ValueError("Draft vocabulary ids must be distinct token ids of the policy's vocabulary.")
        self.d2t.copy_(token_ids.sort().values.to(self.d2t.device))  # in place: caches see its new version

    def target_to_draft(self) -> torch.Tensor:
        """[vocab] map from the policy's token ids to draft ids, -1 for tokens outside the draft vocabulary."""
        vocab = self.config.vocab_size
        if self.d2t is None:
            return torch.arange(vocab)
        t2d = torch.full((vocab,), -1, dtype=torch.long, device=self.d2t.device)
        t2d[self.d2t] = torch.arange(len(self.d2t), device=self.d2t.device)
        return t2d

    # ----------------------------------------------------------------- persistence
    def save_pretrained(self, save_directory: str | os.PathLike, model_card: dict | None = None) -> None:
        """config.json + model.safetensors: the drafter's own weights and d2t, never the policy's.

        ``model_card``: keyword arguments of :func:`tlt_trainers.drafter.model_card.write_model_card` (``policy_name``,
        ``acceptance``, ...); when given, a README.md model card is written next to the weights.
        """
        path = Path(save_directory)
        with staged_save(path) as files:  # a failed write leaves the previous drafter there intact
            self.save_files(files)
        if model_card is not None:
            from .model_card import write_model_card

            write_model_card(self, path, **model_card)

    def save_files(self, files: StagedFiles) -> None:
        """Write config.json and the weights into a save in progress (:func:`.files.staged_save`)."""
        self.config.save_to(files.path(CONFIG_NAME))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(files.path(WEIGHTS_NAME)),
                  metadata={"format": "pt", "architecture": self.config.architecture})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: nn.Module | None = None, **hub_kwargs) -> Drafter:
        """Load from a directory (or a Hub repo id, downloaded with huggingface_hub) and bind to ``target``.

        The class comes from the saved ``architecture`` (``Drafter.from_pretrained`` loads either kind; a subclass
        refuses the other one). A folder in another tool's layout (the EAGLE authors' EAGLE-1/EAGLE-3, SpecForge /
        SGLang, the ``speculators`` library, the TLT authors' RL drafters: see
        :mod:`tlt_trainers.drafter.layouts`) is converted, which needs the policy as ``target`` to check it against.
        """
        directory = Path(path)
        if not directory.is_dir():
            text = str(path)
            if directory.exists() or directory.is_absolute() or text.startswith(".") or text.count("/") > 1:
                raise FileNotFoundError(
                    f"No drafter directory at {text}; pass a folder written by save_pretrained "
                    "or a Hub repo id ('namespace/name')."
                )
            directory = download_drafter(str(path), **hub_kwargs)
        if not _is_own_layout(directory):
            if target is None:
                raise ValueError(f"The drafter at {path} is in another tool's layout; pass target=policy so that it "
                                 "can be converted and checked against the policy.")
            drafter = read_other_layout(directory, target)
            if not isinstance(drafter, cls):
                raise ValueError(f"The drafter at {path} is an {type(drafter).__name__} and {cls.__name__}."
                                 "from_pretrained loads only its own kind: load it with Drafter.from_pretrained.")
            return drafter
        config = EagleDrafterConfig.load(directory)
        kind = kind_of(config.architecture).drafter_class
        if not issubclass(kind, cls):
            raise ValueError(f"The drafter at {directory} is an {config.architecture} and {cls.__name__}."
                             "from_pretrained loads only its own kind: load it with Drafter.from_pretrained.")
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing; the drafter at {directory} is incomplete.")
        drafter = kind(config)
        state = load_weights(weights)
        try:
            missing, unexpected = drafter.load_state_dict(state, strict=False)
        except RuntimeError as err:  # a tensor whose shape disagrees with config.json
            raise ValueError(f"Drafter weights at {weights} do not match its config: {err}") from err
        if missing or unexpected:
            raise ValueError(
                f"Drafter weights at {weights} do not match its config (missing {missing}, unexpected {unexpected})."
            )
        if target is not None:
            drafter.to(device=target.get_output_embeddings().weight.device, dtype=compute_dtype(target))
            drafter.bind(target)
        return drafter

    def export(self, out_dir: str | os.PathLike, layout: str, verifier_name_or_path=None, **export_kwargs) -> Path:
        """Write this drafter in ``layout``, one of its kind's export layouts (its record's ``exports``; the built-in
        kinds': 'speculators', 'vllm', 'sglang'). 'speculators' / 'vllm' is what vLLM serves from the folder or its
        Hub id (EAGLE-3: the speculators layout; EAGLE-1: vLLM's ``eagle`` layout, and 'speculators' the speculators
        library's EAGLE-1, which vLLM does not serve; a block drafter: vLLM's DFlash layout), 'sglang' what SGLang
        serves. ``export_kwargs`` go to the exporter (``num_speculative_tokens``, ``full_vocab_head``, ``dtype``,
        ...)."""
        return kind_of(self).export(self, out_dir, layout, verifier_name_or_path, **export_kwargs)

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, model_card: dict | None = None, layout: str = "tlt",
                    verifier_name_or_path: str | nn.Module | None = None, **export_kwargs) -> str:
        """Upload the drafter with a README.md model card as a model repo; returns the commit URL.

        ``layout``: 'tlt' (default: save_pretrained's folder, which every tlt-trainers trainer resumes from) or an
        export layout of :meth:`export`: 'speculators' (EAGLE-3: ``vllm serve <repo_id>`` serves the verifier the
        config names with this drafter, straight from the Hub id; or ``--speculative-config '{"method": "eagle3",
        "model": "<repo_id>", ...}'``), 'vllm', 'sglang'.
        Every layout loads back with ``Drafter.from_pretrained(repo_id, target=policy)``.
        ``verifier_name_or_path``: the policy's Hub id (exports name their verifier; default: the one the drafter was
        made for). ``model_card``: keyword arguments of ``write_model_card`` (``policy_name`` defaults to the policy
        the drafter was made for, ``repo_id`` to this repo).
        """
        return push_drafter(self, repo_id, private=private, token=token, commit_message=commit_message,
                            model_card=model_card, layout=layout, verifier_name_or_path=verifier_name_or_path,
                            **export_kwargs)


class AutoregressiveDrafter(Drafter):
    """A drafter that drafts one token per pass, reading its own prediction for the next (EAGLE-1, EAGLE-3):
    chains and trees of drafts, trained with training-time test."""

    stacks_layers: bool = False  # whether the kind may have more than one decoder layer (EAGLE-3 does, as vLLM)

    @classmethod
    def check_config(cls, config: EagleDrafterConfig) -> None:
        if config.block_size is not None:
            raise ValueError("block_size is a BlockDrafter setting; EAGLE drafters draft token by token.")
        if config.num_hidden_layers < 1 or (config.num_hidden_layers != 1 and not cls.stacks_layers):
            raise ValueError(f"num_hidden_layers={config.num_hidden_layers}: {cls.__name__} has one decoder layer"
                             + (" or more" if cls.stacks_layers else " (Eagle3Drafter and BlockDrafter stack more)")
                             + ".")

    @abstractmethod
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, kv: RowKV | None = None, slots: torch.Tensor | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """Predicted features [B, q, H] from features ``hidden`` [B, q, F] (or its own predictions [B, q, H]) and
        the tokens that followed them.

        ``mask`` is additive [B, 1, q, kv]; with ``kv`` the new keys are written at ``slots`` [B, q].
        """

    @abstractmethod
    def forward_unrolled(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                         valid: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: predictions [B, L, H] at each of ``depth`` chained draft steps (see EagleDrafter)."""
