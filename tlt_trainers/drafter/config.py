"""Configuration of a drafter (EAGLE-1, EAGLE-3, a block drafter or another registered kind), stored as config.json
next to its weights; ``architecture`` names the kind (:mod:`.registry`)."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .registry import is_registered, kind_of, registered

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Fields added after format 2, left out of config.json while at their defaults.
_LATER_FIELDS = {"qkv_bias": False, "rope_scaling": None, "num_hidden_layers": 1, "block_size": None,
                 "mask_token_id": None}


@dataclass
class EagleDrafterConfig:
    """Shapes of the drafter and the facts about its target it must agree with."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # A scaled RoPE as transformers' ``rope_parameters`` / ``rope_scaling`` name it (``{"rope_type": "llama3",
    # "factor": 8.0, ...}``); None: plain RoPE with ``rope_theta``. Public drafters for Llama-3.1 policies carry one.
    rope_scaling: dict | None = None
    fc_bias: bool = False
    # Biases on the q/k/v projections (Qwen2's attention; the TLT authors' EAGLE drafters for Qwen2.5 have them).
    qkv_bias: bool = False
    input_layernorm: bool = False
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    architecture: str = "EagleDrafter"
    format_version: int = 2
    # EAGLE-3 only: the policy's layers whose hidden states the drafter fuses (vLLM's numbering: id k is the
    # residual stream entering decoder layer k, i.e. the output of layer k - 1), and where its layer norms the
    # fused feature relative to the residual branch.
    aux_layer_ids: list[int] | None = None
    norm_before_residual: bool = False
    # Block drafter (DFlash) only: its decoder layers, the tokens of one block (the last committed token and
    # ``block_size - 1`` masked slots, drafted in one pass), and the policy token id that names the masked slot in
    # exports (vLLM substitutes the drafter's own mask embedding for it; the engine never embeds that id).
    num_hidden_layers: int = 1
    block_size: int | None = None
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        # The kind's class checks the settings that are its own (EAGLE-3's fused layers, a block's size, ...).
        kind_of(self.architecture).drafter_class.check_config(self)
        if self.rope_scaling is not None:
            from .rope import check_rope_scaling

            check_rope_scaling(self.rope_scaling)
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in (0, vocab_size={self.vocab_size}] or None."
            )

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    def to_dict(self) -> dict:
        """The fields, less those added after format 2 while they hold their defaults (so that a drafter that does
        not use them loads in releases that predate them)."""
        data = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def with_defaults(cls, data: dict) -> dict:
        """``data`` (a saved config) with every field it leaves out at its default."""
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        return defaults | dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> EagleDrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown EagleDrafterConfig fields {unknown}: was this drafter saved by a newer version?")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        absent = sorted(required - set(data))
        if absent:
            raise ValueError(f"EagleDrafterConfig is missing required fields {absent}.")
        return cls(**data)

    def save(self, directory: str | Path) -> None:
        self.save_to(Path(directory, CONFIG_NAME))

    def save_to(self, file: str | Path) -> None:
        Path(file).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> EagleDrafterConfig:
        path = Path(directory, CONFIG_NAME)
        if not path.is_file():
            raise FileNotFoundError(f"No drafter config at {path}; save one with EagleDrafter.save_pretrained(dir).")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); re-save the drafter with save_pretrained.") from err
        architecture = data.get("architecture") if isinstance(data, dict) else None
        if not isinstance(architecture, str) or not is_registered(architecture):
            raise ValueError(f"{path} is not a drafter config of this package (architecture={architecture!r}, "
                             f"known: {sorted(registered())}).")
        return cls.from_dict(data)
