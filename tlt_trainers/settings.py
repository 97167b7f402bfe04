"""Every TLT setting, declared once.

Three dataclasses hold them, each field with its ``help`` and each class with its checks in ``__post_init__``:

* :class:`~tlt_trainers.config.TLTConfig`: how the rollout engine speculates;
* :class:`DrafterSettings`: the drafter a trainer starts from and how it is trained during RL;
* :class:`RolloutServerSettings`: veRL's rollout servers (the trainer's own settings hold these in TRL).

Everything else is derived from them: ``TLTGRPOConfig`` (TRL), the ``tlt:`` section of veRL's config
(``TLTSection`` and the YAML), the ``tlt`` command's drafter flags and ``docs/settings.md``, so a setting has
one name, one default and one check everywhere. ``python -m tlt_trainers.settings`` rewrites the generated files
(the YAML's ``tlt:`` block and ``docs/settings.md``); ``--check`` only reports whether they are up to date.

This module imports neither trl nor verl.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from .config import TLTConfig
from .drafter.registry import kind_names


@dataclass
class DrafterSettings:
    """The drafter a trainer starts from and how it trains it during RL (online) and before (warm-up)."""

    drafter_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Drafter to start from: a folder written by save_pretrained (or by `tlt warmup-drafter`), "
                  "a public drafter in another tool's layout (the EAGLE authors' EAGLE-1/EAGLE-3, SpecForge/SGLang, "
                  "the speculators library's, the TLT authors' RL drafters: docs/export_formats.md), or the Hub "
                  "repo id of either. None: the drafter shipped with tlt-trainers for this policy and "
                  "drafter_architecture where there is one (SmolLM2-135M-Instruct, however it was loaded: EAGLE-3 "
                  "for 'auto' and 'eagle3', a block drafter for 'block', none where the rollout serves EAGLE-1 only), "
                  "else a fresh drafter of "
                  "drafter_architecture sized for the policy, which learns from the rollouts. "
                  "'fresh': always a fresh drafter."},
    )
    drafter_architecture: str = field(
        default="auto",
        metadata={"help": "Architecture of a fresh drafter: 'eagle3' (reads a fusion of a low, a middle and a high "
                  "layer of the policy and predicts tokens with its own head: EAGLE-3), 'eagle' (reads the last "
                  "hidden state: EAGLE-1), or 'auto': EAGLE-3 where the policy has at least 6 layers and the "
                  "rollout engine serves it (TLT's engine, TRL's colocated vLLM; TRL's vLLM server mode and veRL's "
                  "vLLM rollout serve EAGLE-1), else EAGLE-1; 'block': a block drafter (DFlash: a whole block of "
                  "drafts from one pass over the policy's fused layers; TLT's engine, and TRL's colocated vLLM as "
                  "vLLM's 'dflash'). A loaded drafter keeps its own architecture."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Tokens a fresh drafter proposes from, picked as the most frequent ones of the first "
                  "rollouts: a smaller output layer drafts faster and is learnt sooner. None: 4096 when the "
                  "policy's vocabulary exceeds 8192 tokens, else the full vocabulary; 0: the full vocabulary."},
    )
    drafter_rebuild_draft_vocab: bool = field(
        default=False,
        metadata={"help": "Re-pick a loaded drafter's draft vocabulary from the most frequent tokens of the first "
                  "rollouts, as for a fresh drafter (head rows of tokens it keeps stay trained). False: a drafter "
                  "loaded from drafter_name_or_path (ours, or a public EAGLE / EAGLE-3 / speculators checkpoint) "
                  "keeps the vocabulary it was published with."},
    )
    drafter_lr: float = field(
        default=3e-4, metadata={"help": "AdamW learning rate of the drafter's training during RL."}
    )
    drafter_unroll_steps: int = field(
        default=2,
        metadata={"help": "Chained draft steps trained per position: the drafter learns to continue from its own "
                  "drafts, as it does when proposing a chain (1: the plain EAGLE loss)."},
    )
    drafter_micro_batch_size: int = field(
        default=8, metadata={"help": "Sequences per drafter training micro-step."}
    )
    drafter_precision: str = field(
        default="auto",
        metadata={"help": "Drafter training precision: 'auto' (bfloat16 autocast where the device multiplies "
                  "bfloat16 natively: CUDA, CPUs with AVX512-BF16 or AMX; float32 elsewhere), 'bfloat16' or "
                  "'float32'. Weights and optimizer state stay float32."},
    )
    drafter_attention: str = field(
        default="auto",
        metadata={"help": "How EAGLE-3 drafter training lays out a micro-batch: 'packed' (sequences end to end, no "
                  "padding; flash-attn's variable-length attention on CUDA with `pip install \"tlt-trainers[flash]\"`, "
                  "a per-sequence torch loop elsewhere), 'padded', or 'auto' (packed, except on CUDA without "
                  "flash-attn). The loss is the same either way; EAGLE-1 drafters always train padded."},
    )
    drafter_update_fraction: float = field(
        default=0.1,
        metadata={"help": "When no rank or rollout replica had idle time to train in (a single one, or all "
                  "finished together), the drafter trains after each rollout for this fraction of the rollout's "
                  "time, at least one micro-step and at most drafter_update_seconds. 0 switches this off."},
    )
    drafter_update_seconds: float = field(
        default=30.0,
        metadata={"help": "Most seconds of drafter training after a rollout (see drafter_update_fraction): it "
                  "delays the policy update. 0 switches this off."},
    )
    drafter_max_idle_seconds: float = field(
        default=120.0,
        metadata={"help": "With several ranks (TRL) or rollout replicas (veRL), one that has finished its share "
                  "of a rollout trains the drafter while the others still generate, for at most this many "
                  "seconds: the time would otherwise be spent waiting. 0 switches this off."},
    )
    drafter_max_steps_per_update: int | None = field(
        default=None,
        metadata={"help": "Most drafter micro-steps per update (0: no training during RL). None: only the time "
                  "budgets above apply."},
    )
    drafter_buffer_bytes: int = field(
        default=512 << 20,
        metadata={"help": "Byte cap of the buffer of recent rollouts (tokens and the policy's hidden states) the "
                  "drafter trains on; the oldest sequences are dropped first, so the drafter follows the policy."},
    )
    drafter_warmup_prompts: int = field(
        default=0,
        metadata={"help": "Before RL starts, sample the policy's answers to this many prompts of the train dataset "
                  "and fit the drafter to them, so that drafts are accepted from the first steps. 0: no warm-up; "
                  "the drafter learns from the first rollouts."},
    )
    drafter_warmup_seconds: float = field(
        default=120.0, metadata={"help": "Training time of the drafter warm-up."}
    )
    drafter_warmup_lr: float = field(
        default=1e-3,
        metadata={"help": "AdamW learning rate of the drafter warm-up: higher than drafter_lr, since the warm-up "
                  "trains a drafter far from the policy on a fixed set of answers."},
    )

    def __post_init__(self) -> None:
        if self.drafter_architecture != "auto" and self.drafter_architecture not in kind_names():
            raise ValueError(f"drafter_architecture={self.drafter_architecture!r}: choose one of "
                             f"{('auto', *kind_names())}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be None (automatic), 0 (the full "
                             "vocabulary) or a positive size.")
        for name in ("drafter_lr", "drafter_warmup_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0.")
        for name in ("drafter_unroll_steps", "drafter_micro_batch_size", "drafter_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        for name in ("drafter_update_fraction", "drafter_update_seconds", "drafter_max_idle_seconds",
                     "drafter_warmup_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 switches that training off).")
        if self.drafter_precision not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"drafter_precision={self.drafter_precision!r}: choose 'auto', 'float32' or 'bfloat16'.")
        if self.drafter_attention not in ("auto", "packed", "padded"):
            raise ValueError(f"drafter_attention={self.drafter_attention!r}: choose 'auto', 'packed' or 'padded'.")
        if self.drafter_max_steps_per_update is not None and self.drafter_max_steps_per_update < 0:
            raise ValueError(f"drafter_max_steps_per_update={self.drafter_max_steps_per_update} must be >= 0 or "
                             "None (time budgets only).")
        if self.drafter_warmup_prompts < 0:
            raise ValueError(f"drafter_warmup_prompts={self.drafter_warmup_prompts} must be >= 0 (0: no warm-up).")


ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RolloutServerSettings:
    """veRL's rollout servers (one per replica). TRL's trainer generates in its own processes and uses its own
    settings for these (``seed``, the accelerator's device, the model's dtype)."""

    batch_wait_ms: float = field(
        default=20.0,
        metadata={"help": "A rollout server gathers the requests that arrive within this many milliseconds into "
                  "one batch: veRL's agent loops send requests one by one, and rows decoded together share each "
                  "forward pass."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Policy dtype in the rollout server: 'auto' (float32 on CPU, bfloat16 on CUDA), "
                  "'float32', 'bfloat16' or 'float16'.", "choices": list(ROLLOUT_DTYPES)},
    )
    device: str = field(
        default="auto",
        metadata={"help": "Device of the rollout server: 'auto' takes cuda when available, else cpu; or a torch "
                  "device such as 'cuda:1'."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the rollout sampling (replica r uses seed + r) and of a fresh drafter, the same "
                  "on every replica."},
    )

    def __post_init__(self) -> None:
        if self.batch_wait_ms < 0:
            raise ValueError(f"tlt.batch_wait_ms={self.batch_wait_ms} must be >= 0.")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"tlt.dtype={self.dtype!r} must be one of {', '.join(ROLLOUT_DTYPES)}.")


# Settings only TRL's trainer has: veRL's rollout servers start from a saved drafter instead of warming one up.
TRL_ONLY = ("drafter_warmup_prompts", "drafter_warmup_seconds", "drafter_warmup_lr")
TRAINER_SETTINGS = (TLTConfig, DrafterSettings)  # TLTGRPOConfig's settings
VERL_SETTINGS = (TLTConfig, DrafterSettings, RolloutServerSettings)  # the tlt: section's (less TRL_ONLY)


# ----------------------------------------------------------------------------------------------- derivation
def setting_types(cls: type) -> dict[str, Any]:
    """The fields' types of a settings dataclass as objects (its annotations are strings), as the derived
    classes declare them: a tuple of strings becomes a list (argument parsers, JSON and YAML know lists)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _listed(hints[f.name]) for f in dataclasses.fields(cls)}


def _listed(tp):
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        listed = [_listed(a) for a in args]
        out = listed[0]
        for a in listed[1:]:
            out = out | a
        return out
    return tp


def _default(spec: dataclasses.Field):
    return spec.default_factory() if spec.default is MISSING else spec.default


def setting_fields(*classes: type, exclude: Iterable[str] = ()) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) of the settings of ``classes``, in order, for a derived dataclass: same defaults
    (tuples as lists), same ``help``."""
    skip, out = set(exclude), []
    for cls in classes:
        hints = setting_types(cls)
        for spec in dataclasses.fields(cls):
            if spec.name in skip:
                continue
            value = _default(spec)
            if isinstance(value, (tuple, list)):
                copy = list(value)
                made = field(default_factory=lambda copy=copy: list(copy), metadata=spec.metadata)
            else:
                made = field(default=value, metadata=spec.metadata)
            out.append((spec.name, hints[spec.name], made))
    return out


def with_settings(*classes: type, exclude: Iterable[str] = ()):
    """Class decorator, applied under ``@dataclass``: adds the settings of ``classes`` as fields.

    A name that a base class already has as a field is an error: the setting would silently change the meaning of
    the base class's field (or be shadowed by it)."""
    def decorate(cls):
        taken = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
        annotations = cls.__dict__.get("__annotations__")
        if annotations is None:
            annotations = {}
            cls.__annotations__ = annotations
        for name, tp, spec in setting_fields(*classes, exclude=exclude):
            if name in taken or name in annotations:
                raise TypeError(f"{cls.__name__}: the TLT setting {name!r} collides with a field of the same name "
                                "in a base class; rename the setting.")
            annotations[name] = tp
            setattr(cls, name, spec)
        cls._tlt_sources = tuple(classes)
        cls._tlt_excluded = tuple(exclude)
        return cls
    return decorate


def _is_sequence(tp) -> bool:
    """Whether a settings type is a sequence (``tuple[X, ...]``, or a list in a derived class), maybe optional."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(typing.get_origin(option) in (tuple, list) for option in options)


def source_values(obj: Any, cls: type) -> dict[str, Any]:
    """The values of ``cls``'s fields that ``obj`` has (by attribute), sequences as the tuples ``cls`` declares;
    the fields ``obj`` lacks keep ``cls``'s defaults."""
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in dataclasses.fields(cls):
        if not hasattr(obj, spec.name):
            continue
        value = getattr(obj, spec.name)
        if value is not None and _is_sequence(hints[spec.name]):
            value = (value,) if isinstance(value, str) else tuple(value)
        values[spec.name] = value
    return values


def check_settings(obj: Any) -> None:
    """Store the sequences of ``obj`` (a derived class's instance) as lists (a single string as a list of one,
    OmegaConf's ListConfig as a list) and run the checks of every settings class it takes fields from."""
    cls = type(obj)
    for name, tp, _ in setting_fields(*cls._tlt_sources, exclude=cls._tlt_excluded):
        value = getattr(obj, name)
        if value is not None and _is_sequence(tp):
            setattr(obj, name, [value] if isinstance(value, str) else list(value))
    for source in cls._tlt_sources:
        source(**source_values(obj, source))


def _names(cls: type) -> list[str]:
    return [name for name, _, _ in setting_fields(*cls._tlt_sources, exclude=cls._tlt_excluded)]


@dataclass
@with_settings(*TRAINER_SETTINGS)
class TLTSettings:
    """The TLT settings of a trainer (engine and drafter), read from a TLTGRPOConfig, a plain GRPOConfig (TLT
    defaults) or any object with these attributes; checked on construction."""

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_object(cls, obj: Any) -> TLTSettings:
        """The settings ``obj`` has as attributes; the defaults for those it lacks."""
        return cls(**{name: getattr(obj, name) for name in _names(cls) if hasattr(obj, name)})

    def tlt_config(self) -> TLTConfig:
        """The engine's settings."""
        return TLTConfig(**source_values(self, TLTConfig))

    def drafter_settings(self) -> DrafterSettings:
        return DrafterSettings(**source_values(self, DrafterSettings))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TITLES = {"TLTConfig": "Speculative rollout", "DrafterSettings": "Drafter",
           "RolloutServerSettings": "Rollout servers"}


def _python_value(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parameters_doc(classes: Iterable[type], indent: str = "", exclude: Iterable[str] = ()) -> str:
    """The settings of ``classes`` in the "Parameters:" style of TRL's config docstrings."""
    skip, blocks = set(exclude), []
    for cls in classes:
        hints = setting_types(cls)
        lines = [f"{indent}> {_TITLES.get(cls.__name__, cls.__name__)} (`{cls.__name__}`)", "",
                 f"{indent}Parameters:"]
        for spec in dataclasses.fields(cls):
            if spec.name in skip:
                continue
            default = _default(spec)
            shown = "*optional*" if default is None else f"*optional*, defaults to `{_python_value(default)}`"
            lines.append(f"{indent}    {spec.name} (`{_type_name(hints[spec.name])}`, {shown}):")
            lines += textwrap.wrap(spec.metadata["help"], 112 - len(indent), initial_indent=indent + " " * 8,
                                   subsequent_indent=indent + " " * 8)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def add_setting_arguments(parser: argparse.ArgumentParser, cls: type, names: Iterable[str],
                          defaults: Mapping[str, Any] | None = None,
                          aliases: Mapping[str, Iterable[str]] | None = None) -> None:
    """Command-line flags for settings of ``cls``: ``--name-with-dashes`` (``dest`` the setting's name), typed and
    documented from the dataclass. ``defaults`` overrides a default for the command (say why in its help);
    ``aliases`` adds older flag names."""
    defaults, aliases = dict(defaults or {}), dict(aliases or {})
    specs = {f.name: f for f in dataclasses.fields(cls)}
    hints = setting_types(cls)
    for name in names:
        spec, tp = specs[name], hints[name]
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in args if a is not type(None))
        default = defaults.get(name, _default(spec))
        kwargs: dict[str, Any] = {"dest": name, "default": default}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is list:
            kwargs.update(nargs="+", type=typing.get_args(tp)[0])
        else:
            kwargs["type"] = tp
        if "choices" in spec.metadata:
            kwargs["choices"] = spec.metadata["choices"]
        kwargs["help"] = f"{spec.metadata.get('help', '')} (default: {default})".replace("%", "%%")
        flags = [f"--{name.replace('_', '-')}", *aliases.get(name, ())]
        parser.add_argument(*flags, **kwargs)


# ----------------------------------------------------------------------------------------------- generated files
ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "settings.md"
VERL_YAML = ROOT / "tlt_trainers" / "verl" / "config" / "tlt_ppo_trainer.yaml"
GENERATED = "generated by `python -m tlt_trainers.settings` from the settings dataclasses; edit those"

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")
_YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n", "~"}


def yaml_value(value: Any) -> str:
    """A default as YAML (the subset the settings use)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value if _PLAIN.match(value) and value.lower() not in _YAML_WORDS else '"' + value + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    raise TypeError(f"no YAML form for {value!r}")


def verl_section_yaml() -> str:
    """The ``tlt:`` block of the veRL config: every setting of the section, its help as a comment."""
    lines = [f"# The tlt: section ({GENERATED}).", "# Override any key on the command line: tlt.speculation=always",
             "tlt:"]
    for name, _, spec in setting_fields(*VERL_SETTINGS, exclude=TRL_ONLY):
        for text in textwrap.wrap(spec.metadata["help"], 114):
            lines.append(f"  # {text}")
        lines.append(f"  {name}: {yaml_value(_default(spec))}")
    return "\n".join(lines) + "\n"


def with_verl_section(text: str) -> str:
    """``text`` (the veRL YAML) with its ``tlt:`` block (and the comment above it) replaced by the generated one."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "tlt:"), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + verl_section_yaml()
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "#", "\n")), len(lines))
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + verl_section_yaml() + ("\n" + tail if tail else "")


def _type_name(tp) -> str:
    text = repr(tp) if not isinstance(tp, type) else tp.__name__
    return text.replace("typing.", "").replace("NoneType", "None")


def _markdown_rows(classes, exclude=()) -> list[str]:
    rows = []
    for cls in classes:
        hints = setting_types(cls)
        for spec in dataclasses.fields(cls):
            if spec.name in exclude:
                continue
            rows.append(f"- **`{spec.name}`** (`{_type_name(hints[spec.name])}`, default "
                        f"`{_python_value(_default(spec))}`): {spec.metadata['help']}")
    return rows


def settings_markdown() -> str:
    """The text of docs/settings.md."""
    trl_only = ", ".join(f"`{n}`" for n in TRL_ONLY)
    parts = [
        "# Settings",
        "",
        f"<!-- {GENERATED}: tlt_trainers/config.py (TLTConfig) and tlt_trainers/settings.py. -->",
        "",
        "Every TLT setting has one name, one default and one check, whichever trainer you use:",
        "",
        "- TRL: a field of `TLTGRPOConfig`, e.g. `TLTGRPOConfig(..., speculation=\"always\", drafter_lr=1e-4)` "
        "(a plain `GRPOConfig` runs with the defaults below); on a command line parsed by `TrlParser`, "
        "`--speculation always`.",
        "- veRL: a key of the `tlt:` section of `tlt_trainers/verl/config/tlt_ppo_trainer.yaml`, e.g. "
        "`tlt.speculation=always tlt.strategies=[chain:2,history:8]`.",
        "- The engine alone: `SpeculativeGenerator(model, drafter, TLTConfig(...))` takes the engine settings.",
        "",
        "## Speculative rollout (the engine, `TLTConfig`)",
        "",
        *_markdown_rows([TLTConfig]),
        "",
        "## Drafter (`DrafterSettings`)",
        "",
        f"{trl_only} are TRL's only: veRL's rollout servers do not warm a drafter up (start them from one saved "
        "by `tlt warmup-drafter` with `drafter_name_or_path`). `tlt warmup-drafter` takes `--draft-vocab-size`, "
        "`--drafter-unroll-steps`, `--drafter-warmup-lr` and `--drafter-warmup-seconds`.",
        "",
        *_markdown_rows([DrafterSettings]),
        "",
        "## veRL rollout servers (`RolloutServerSettings`, `tlt:` section only)",
        "",
        *_markdown_rows([RolloutServerSettings]),
        "",
    ]
    return "\n".join(parts)


def generated_files() -> dict[Path, str]:
    """Each generated file and the text it should have."""
    return {DOCS: settings_markdown(), VERL_YAML: with_verl_section(VERL_YAML.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tlt_trainers.settings",
                                     description="Rewrite the files generated from the settings dataclasses.")
    parser.add_argument("--check", action="store_true", help="only report stale files (exit status 1)")
    args = parser.parse_args(argv)
    stale = [path for path, text in generated_files().items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python -m tlt_trainers.settings")
        return 1 if stale else 0
    for path, text in generated_files().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
