"""The drafter served by a vLLM server (``trl vllm-serve`` / ``vllm serve``), refreshed over HTTP after each update.

Start the server with the drafter's export as its EAGLE speculator and the reload extension (``tlt
vllm-serve-args`` exports a drafter for the policy and prints these flags)::

    trl vllm-serve --model POLICY --speculative_config '{"method": "eagle", "model": DIR,
        "num_speculative_tokens": 3}' --worker-extension-cls tlt_trainers.vllm.worker.DrafterReloadExtension

:class:`VLLMServerDrafterSync` checks that the server runs such a drafter (``/server_info``, then the extension's
``tlt_drafter_info`` through ``/collective_rpc``), and ``push`` writes the drafter's weights as one safetensors
file into a folder the server can read and has every worker reload them in place (``/collective_rpc`` takes only
strings, so the weights travel as a path: the server and the trainer share a filesystem, as on one machine).
``counters`` reads vLLM's speculative-decoding counters from ``/metrics``. Both endpoints exist when the server
runs with ``VLLM_SERVER_DEV_MODE=1``, which ``trl vllm-serve`` sets.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from ..drafter.eagle import EagleDrafter
from ..drafter.export import vllm_weights
from .config import EXTENSION
from .metrics import SpecDecodeCounters, parse_spec_decode_metrics
from .sync import PushTiming, _torch_dtype, write_weights


def serve_command(policy: str | os.PathLike, drafter_dir: str | os.PathLike, num_speculative_tokens: int = 3,
                  engine_extra: dict[str, Any] | None = None, **speculative_extra: Any) -> str:
    """The ``trl vllm-serve`` command that serves ``policy`` with the drafter exported in ``drafter_dir``
    (``speculative_extra``: other fields of vLLM's speculative config; ``engine_extra``: other engine arguments,
    passed through to ``vllm serve`` as flags, e.g. the adaptive schedule's ``scheduler_cls`` and
    ``additional_config`` from :func:`~tlt_trainers.vllm.config.speculation_schedule`)."""
    spec = {"method": "eagle", "model": str(drafter_dir), "num_speculative_tokens": int(num_speculative_tokens),
            **speculative_extra}
    flags = []
    for name, value in (engine_extra or {}).items():
        flags += ["--" + name.replace("_", "-"), value if isinstance(value, str) else json.dumps(value)]
    return shlex.join(["trl", "vllm-serve", "--model", str(policy), "--speculative_config", json.dumps(spec),
                       "--worker-extension-cls", EXTENSION, *flags])


class VLLMServerDrafterSync:
    """Push an :class:`EagleDrafter`'s weights to a running vLLM server and read its acceptance counters.

        sync = VLLMServerDrafterSync("http://127.0.0.1:8000", drafter, directory="runs/x/tlt_vllm_drafter")
        timing = sync.push()            # every worker of the server now drafts with the new weights
        sync.counters()                 # SpecDecodeCounters from /metrics (cumulative)

    ``directory`` must be readable by the server's workers under the same path.
    """

    def __init__(self, base_url: str, drafter: EagleDrafter, directory: str | os.PathLike, *,
                 full_vocab_head: bool = True, timeout: float = 120.0):
        import requests

        self._http = requests.Session()
        self.base_url = base_url.rstrip("/")
        self.drafter = drafter
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.full_vocab_head = full_vocab_head
        self.timeout = timeout
        self.version = 0
        self.engine_info = self._check_server()

    # ------------------------------------------------------------------ checks
    def _fix(self) -> str:
        return ("Start the server with the drafter and the reload extension: `tlt vllm-serve-args --model POLICY --out "
                "DIR` exports a drafter for the policy and prints the command, which is "
                f"`{serve_command('POLICY', 'DIR')}`.")

    def _check_server(self) -> list[dict]:
        response = self._http.get(f"{self.base_url}/server_info", params={"config_format": "json"},
                                  timeout=self.timeout)
        if response.status_code == 404:
            raise ValueError(f"The vLLM server at {self.base_url} has no /server_info: it runs without "
                             "VLLM_SERVER_DEV_MODE=1, which TLT needs to reach its workers (`trl vllm-serve` sets it; "
                             f"with `vllm serve`, export VLLM_SERVER_DEV_MODE=1). {self._fix()}")
        response.raise_for_status()
        config = response.json().get("vllm_config") or {}
        spec = config.get("speculative_config") or {}
        if not spec or spec.get("method") not in ("eagle", "EagleLlamaForCausalLM"):
            raise ValueError(f"The vLLM server at {self.base_url} does not speculate with an EAGLE drafter "
                             f"(speculative_config={spec or None}). {self._fix()}")
        extension = (config.get("parallel_config") or {}).get("worker_extension_cls") or ""
        if not _is_reload_extension(extension):
            raise ValueError(f"The vLLM server at {self.base_url} runs without TLT's drafter-reload extension "
                             f"(worker_extension_cls={extension!r}), so drafter updates cannot reach it. {self._fix()}")
        info = self._rpc("tlt_drafter_info")
        c, first = self.drafter.config, info[0]
        if (first["hidden_size"], first["vocab_size"]) != (c.hidden_size, c.vocab_size):
            raise ValueError(f"The server's drafter has hidden_size={first['hidden_size']}, vocab_size="
                             f"{first['vocab_size']}; this drafter {c.hidden_size}, {c.vocab_size}: the server serves "
                             f"another model. {self._fix()}")
        return info

    def _rpc(self, method: str, **kwargs: str) -> list[Any]:
        response = self._http.post(f"{self.base_url}/collective_rpc", json={"method": method, "kwargs": kwargs},
                                   timeout=self.timeout)
        if response.status_code == 404:
            raise ValueError(f"The vLLM server at {self.base_url} has no /collective_rpc: start it with "
                             f"VLLM_SERVER_DEV_MODE=1 (`trl vllm-serve` sets it). {self._fix()}")
        if response.status_code != 200:
            raise RuntimeError(f"{method} failed on the vLLM server at {self.base_url} ({response.status_code}): "
                               f"{response.text[:2000]}")
        return response.json()["results"]

    # ------------------------------------------------------------------ updates
    def push(self, drafter: EagleDrafter | None = None) -> PushTiming:
        """Write ``drafter``'s weights (default: the one given) into ``directory`` and reload them in every worker of
        the server; then reset its prefix cache (cached drafter KV entries came from the old weights)."""
        drafter = self.drafter if drafter is None else drafter
        start = time.perf_counter()
        dtype = _torch_dtype(self.engine_info[0]["dtype"])
        tensors = vllm_weights(drafter, full_vocab_head=self.full_vocab_head, dtype=dtype)
        file = write_weights(tensors, self.directory)
        convert = time.perf_counter() - start
        try:
            results = self._rpc("tlt_reload_drafter", path=str(file.resolve()))
        except RuntimeError as err:
            if "No such file" in str(err) or "FileNotFound" in str(err):
                raise RuntimeError(f"The vLLM server cannot read {file.resolve()}: run it on this machine or give the "
                                   "trainer an output_dir on a filesystem the server shares.") from err
            raise
        reset = self._http.post(f"{self.base_url}/reset_prefix_cache", timeout=self.timeout)
        reset.raise_for_status()
        if reset.content and isinstance(reset.json(), dict) and reset.json().get("success") is False:
            raise RuntimeError(f"The vLLM server at {self.base_url} refused to reset its prefix cache: {reset.text}")
        self.version += 1
        return PushTiming(convert_seconds=convert, reload_seconds=max(r["seconds"] for r in results),
                          total_seconds=time.perf_counter() - start, tensors=len(tensors), version=self.version)

    def counters(self) -> SpecDecodeCounters:
        """The server's cumulative speculative-decoding counters (``/metrics``)."""
        response = self._http.get(f"{self.base_url}/metrics", timeout=self.timeout)
        response.raise_for_status()
        counters = parse_spec_decode_metrics(response.text)
        if counters is None:
            raise RuntimeError(f"The vLLM server at {self.base_url} reports no vllm:spec_decode_* counters: it runs "
                               "without speculation or with --disable-log-stats.")
        return counters

    def close(self) -> None:
        self._http.close()


def _is_reload_extension(name: str) -> bool:
    """Whether the worker extension the server names is TLT's reload extension or a subclass of it."""
    if name == EXTENSION:
        return True
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except Exception:  # not importable here (another environment's class): not one TLT can vouch for
        return False
    from .worker import DrafterReloadExtension

    return isinstance(cls, type) and issubclass(cls, DrafterReloadExtension)


__all__ = ["VLLMServerDrafterSync", "parse_spec_decode_metrics", "serve_command"]
