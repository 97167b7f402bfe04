"""One settings source: TLTConfig and DrafterSettings reach TRL's TLTGRPOConfig, veRL's tlt: section (class and
YAML), the tlt command and docs/settings.md with the same names, defaults, help and checks."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from tlt_trainers.config import TLTConfig
from tlt_trainers.settings import (
    TRL_ONLY,
    DrafterSettings,
    RolloutServerSettings,
    TLTSettings,
    setting_fields,
    with_settings,
)
from tlt_trainers.settings.generated import VERL_YAML, generated_files

# A value other than the default for every engine setting. A new TLTConfig field fails
# test_every_engine_setting_has_a_value_here until it is added here, and is then checked to reach both trainers.
ENGINE_VALUES = dict(
    speculation="always", num_speculative_tokens=3, default_num_speculative_tokens=5, max_speculative_batch_size=2,
    strategy="chain:3", strategies=("chain:2", "tree:4x2:8"), history_drafting=False, history_max_tokens=1000,
    history_keep_steps=2, min_speedup=1.5, cuda_graphs="off", keep_engine_memory=True, selector_window=64,
    exploration=0.3, cost_cache="off", show_progress=True,
)
DRAFTER_VALUES = dict(
    drafter_name_or_path="some/drafter", drafter_architecture="eagle", draft_vocab_size=0,
    drafter_rebuild_draft_vocab=True, drafter_lr=1e-4,
    drafter_unroll_steps=3,
    drafter_micro_batch_size=4, drafter_precision="float32", drafter_attention="padded", drafter_update_fraction=0.2,
    drafter_update_seconds=10.0, drafter_update_budget="fixed", drafter_payback_share=0.25, drafter_explore_share=0.05,
    drafter_max_idle_seconds=60.0, drafter_max_steps_per_update=7, drafter_buffer_bytes=1 << 20,
    drafter_targets="sampled", drafter_warmup_prompts=16, drafter_warmup_seconds=30.0, drafter_warmup_lr=2e-3,
)
VERL_DRAFTER_VALUES = {k: v for k, v in DRAFTER_VALUES.items() if k not in TRL_ONLY}


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def plain(values: dict) -> dict:
    """Values as a YAML/JSON config holds them (lists, not tuples)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


@pytest.mark.parametrize("cls, values", [(TLTConfig, ENGINE_VALUES), (DrafterSettings, DRAFTER_VALUES)])
def test_every_engine_setting_has_a_value_here(cls, values):
    assert list(values) == names(cls), f"add the new {cls.__name__} field(s) to this test's values"
    defaults = cls()
    for name, value in values.items():
        assert getattr(defaults, name) != value, f"{name}: pick a value other than the default"
    cls(**values)  # valid


# ----------------------------------------------------------------------------------------------- TRL
def grpo_kwargs(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True)


def test_every_setting_reaches_trl(tmp_path):
    trl = pytest.importorskip("trl")
    from tlt_trainers.trl.config import TLT_FIELDS, TLTGRPOConfig, resolve_tlt_settings

    assert list(TLT_FIELDS) == names(TLTConfig) + names(DrafterSettings)
    args = TLTGRPOConfig(**grpo_kwargs(tmp_path), **ENGINE_VALUES, **DRAFTER_VALUES)
    settings = resolve_tlt_settings(args)
    assert settings.tlt_config() == TLTConfig(**ENGINE_VALUES)
    assert settings.drafter_settings() == DrafterSettings(**DRAFTER_VALUES)
    # the defaults are TLTConfig's and DrafterSettings', for a TLTGRPOConfig and a plain GRPOConfig alike
    for args in (TLTGRPOConfig(**grpo_kwargs(tmp_path)), trl.GRPOConfig(**grpo_kwargs(tmp_path))):
        settings = resolve_tlt_settings(args)
        assert settings.tlt_config() == TLTConfig() and settings.drafter_settings() == DrafterSettings()


def test_trl_fields_keep_names_types_and_help():
    pytest.importorskip("trl")
    from tlt_trainers.trl.config import TLTGRPOConfig

    ours = {f.name: f for f in dataclasses.fields(TLTGRPOConfig)}
    for name, _, spec in setting_fields(TLTConfig, DrafterSettings):
        assert ours[name].metadata["help"] == spec.metadata["help"]
        assert ours[name].name in TLTGRPOConfig.__doc__


def test_no_setting_collides_with_a_grpo_config_field():
    pytest.importorskip("trl")
    from trl import GRPOConfig

    grpo = set(names(GRPOConfig))
    assert not grpo & {name for name, _, _ in setting_fields(TLTConfig, DrafterSettings)}
    # and the generator refuses one that would
    @dataclasses.dataclass
    class Base:
        speculation: str = "x"

    with pytest.raises(TypeError, match="'speculation' collides"):
        with_settings(TLTConfig)(type("Derived", (Base,), {}))


def test_trl_checks_are_the_dataclasses(tmp_path):
    pytest.importorskip("trl")
    from tlt_trainers.trl.config import TLTGRPOConfig

    for bad, message in [(dict(speculation="sometimes"), "speculation='sometimes'"),
                         (dict(min_speedup=0.5), "min_speedup=0.5"), (dict(strategies=["chain:x"]), "chain:x"),
                         (dict(drafter_lr=0.0), "drafter_lr=0.0"), (dict(drafter_warmup_prompts=-1), "warmup")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            TLTGRPOConfig(**grpo_kwargs(tmp_path), **bad)


def test_trl_command_line_and_pickle(tmp_path):
    pytest.importorskip("trl")
    """TrlParser / HfArgumentParser build flags from the generated fields; the Trainer pickles its args."""
    from transformers import HfArgumentParser

    from tlt_trainers.trl.config import TLTGRPOConfig, resolve_tlt_settings

    (args,) = HfArgumentParser(TLTGRPOConfig).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "--bf16", "false",
        "--strategies", "chain:2", "history:8", "--no_history_drafting", "--min_speedup", "1.1", "--cuda_graphs", "off",
    ], return_remaining_strings=False)
    config = resolve_tlt_settings(args).tlt_config()
    assert config.strategies == ("chain:2", "history:8") and not config.history_drafting
    assert config.min_speedup == 1.1 and config.cuda_graphs == "off"
    again = pickle.loads(pickle.dumps(args))
    assert type(again) is TLTGRPOConfig and again.strategies == args.strategies


# ----------------------------------------------------------------------------------------------- veRL
def test_every_setting_reaches_verl():
    pytest.importorskip("verl")
    from tlt_trainers.verl import TLTSection

    assert names(TLTSection) == (names(TLTConfig) + [n for n in names(DrafterSettings) if n not in TRL_ONLY]
                                 + names(RolloutServerSettings))
    section = TLTSection.from_mapping(plain({**ENGINE_VALUES, **VERL_DRAFTER_VALUES}))
    assert section.tlt_config() == TLTConfig(**ENGINE_VALUES)
    assert section.drafter_settings() == DrafterSettings(**VERL_DRAFTER_VALUES)
    assert TLTSection.from_mapping(section.to_dict()) == section  # as it travels to the rollout servers
    assert TLTSection().tlt_config() == TLTConfig() and TLTSection().drafter_settings() == DrafterSettings()
    with pytest.raises(ValueError, match="tlt warmup-drafter"):
        TLTSection.from_mapping({"drafter_warmup_prompts": 8})
    with pytest.raises(ValueError, match="min_speedup"):
        TLTSection(min_speedup=0.9)


def test_hydra_overrides_reach_the_engine():
    pytest.importorskip("verl")
    from hydra import compose, initialize_config_module

    from tlt_trainers.verl import check_tlt_config

    def override(value) -> str:
        if isinstance(value, tuple):
            return "[" + ",".join(value) + "]"
        return str(value).lower() if isinstance(value, bool) else str(value)

    overrides = [f"tlt.{k}={override(v)}" for k, v in {**ENGINE_VALUES, **VERL_DRAFTER_VALUES}.items()]
    with initialize_config_module(config_module="tlt_trainers.verl.config", version_base=None):
        config = compose(config_name="tlt_ppo_trainer", overrides=overrides)
    section = check_tlt_config(config)
    assert section.tlt_config() == TLTConfig(**ENGINE_VALUES)
    assert section.drafter_settings() == DrafterSettings(**VERL_DRAFTER_VALUES)


def test_yaml_section_matches_the_dataclasses():
    yaml = pytest.importorskip("yaml")
    section = yaml.safe_load(VERL_YAML.read_text())["tlt"]
    expected = {name: spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
                for name, _, spec in setting_fields(TLTConfig, DrafterSettings, RolloutServerSettings,
                                                    exclude=TRL_ONLY)}
    assert list(section) == list(expected)  # same keys, same order
    for name, value in expected.items():
        assert section[name] == value and type(section[name]) is type(value), name


# ----------------------------------------------------------------------------------------------- CLI, docs, help
def test_cli_flags_are_the_drafter_settings():
    from tlt_trainers.cli import build_parser

    args = build_parser().parse_args(["warmup-drafter", "--out", "x"])
    assert args.draft_vocab_size is None and args.drafter_unroll_steps == DrafterSettings().drafter_unroll_steps
    assert args.drafter_warmup_lr == DrafterSettings().drafter_warmup_lr
    assert args.drafter_warmup_seconds == 300.0  # the command's own default (a standalone warm-up)
    args = build_parser().parse_args(["warmup-drafter", "--out", "x", "--lr", "0.01", "--unroll-steps", "3",
                                      "--train-seconds", "5", "--draft-vocab-size", "0"])
    assert (args.drafter_warmup_lr, args.drafter_unroll_steps, args.drafter_warmup_seconds,
            args.draft_vocab_size) == (0.01, 3, 5.0, 0)


def test_help_says_what_without_measurements():
    for name, _, spec in setting_fields(TLTConfig, DrafterSettings, RolloutServerSettings):
        text = spec.metadata.get("help", "")
        assert len(text) > 20, f"{name} needs a help string"
        assert not re.search(r"\d+(\.\d+)?\s*%|\b20\d\d-\d\d|\bmeasured on\b", text), f"{name}: {text}"


def test_trainer_settings_namespace():
    settings = TLTSettings.from_object(type("Args", (), {"speculation": "never", "drafter_lr": 1e-4})())
    assert settings.tlt_config().speculation == "never" and settings.drafter_lr == 1e-4
    assert settings.to_dict()["history_drafting"] is True


def test_generated_files_are_up_to_date():
    for path, text in generated_files().items():
        assert path.read_text() == text, f"{path.name} is out of date: run python -m tlt_trainers.settings"


def test_settings_import_neither_trainer():
    import subprocess
    import sys

    code = ("import sys, tlt_trainers.settings, tlt_trainers.cli; "
            "print(sorted(m for m in ('trl', 'verl', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
