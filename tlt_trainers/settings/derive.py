"""What is derived from the settings dataclasses at run time: a class with the fields of several (TLTGRPOConfig,
veRL's ``TLTSection``), the values one of them takes back, the checks, TRL-style docstrings and command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, field
from typing import Any


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


def default_of(spec: dataclasses.Field):
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
            value = default_of(spec)
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



_TITLES = {"TLTConfig": "Speculative rollout", "DrafterSettings": "Drafter",
           "RolloutServerSettings": "Rollout servers"}


def python_literal(value: Any) -> str:
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
            default = default_of(spec)
            shown = "*optional*" if default is None else f"*optional*, defaults to `{python_literal(default)}`"
            lines.append(f"{indent}    {spec.name} (`{type_name(hints[spec.name])}`, {shown}):")
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
        default = defaults.get(name, default_of(spec))
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



def type_name(tp) -> str:
    text = repr(tp) if not isinstance(tp, type) else tp.__name__
    return text.replace("typing.", "").replace("NoneType", "None")
