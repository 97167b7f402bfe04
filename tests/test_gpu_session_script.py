"""benchmarks/gpu_session.sh fits a GPU session, refuses to start when it would not, and on a machine without CUDA
measures nothing, quickly, and says so (its CPU smoke run: exit 77).

A lent GPU machine runs one command for at most 600 s, and a session has 15 minutes of device time with the machine's
start, so the session's timeouts, each with its kill grace, must add up to at most 480 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
LIMIT = 480
PARTS = ("probe", "tests", "gpu_speed", "self_checks")
NOTHING = "no CUDA device: nothing measured"

no_gpu = pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                            reason="a GPU is here: the session would measure it (this file checks the CPU smoke run)")


def session(out: Path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}  # this interpreter, not PATH's python3
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def printed_total(stdout: str) -> int:
    match = re.search(r"^gpu_session: timeouts .* = (\d+) s \(limit (\d+) s\)$", stdout, re.M)
    assert match, f"the session does not print its timeouts' sum first:\n{stdout}"
    assert int(match.group(2)) == LIMIT
    return int(match.group(1))


def test_default_timeouts_add_up_to_at_most_480_s():
    """Read from the script itself: the defaults of every part's timeout and the kill grace, and every timeout goes
    through run() (one `timeout` invocation in the script), so no part escapes the sum."""
    text = SCRIPT.read_text()
    defaults = dict(re.findall(r"^(T_\w+|KILL_GRACE)=\$\{\1:-(\d+)\}$", text, re.M))
    assert set(defaults) == {"T_PROBE", "T_TESTS", "T_SPEED", "T_CHECK", "KILL_GRACE"}, defaults
    parts = [int(v) for k, v in defaults.items() if k.startswith("T_")]
    assert sum(parts) + len(parts) * int(defaults["KILL_GRACE"]) <= LIMIT
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    invocations = [line for line in code if re.search(r"(?<![-\w])timeout\s", line)]
    assert len(invocations) == 1 and "timeout -k" in invocations[0], invocations


@no_gpu
def test_cpu_smoke_run_measures_nothing_and_says_so(tmp_path):
    done = session(tmp_path)
    out = done.stdout
    assert done.returncode == 77, out + done.stderr
    total = printed_total(out)
    assert total <= LIMIT
    for part in PARTS[1:]:
        assert re.search(rf"^{part}: NOTHING MEASURED \(exit 77, .*\): {NOTHING}$", out, re.M), out
    assert re.search(r"^gpu_session: NOTHING MEASURED: no CUDA device after \d+ s", out, re.M), out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == 77 and summary["timeouts_total_s"] == total
    assert [p["part"] for p in summary["parts"]] == list(PARTS)
    assert sum(p["limit_s"] + p["kill_grace_s"] for p in summary["parts"]) == total
    assert (tmp_path / "summary.txt").read_text().count(NOTHING) == len(PARTS) - 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_a_gpu_that_torch_cannot_see_fails(tmp_path):
    """nvidia-smi answers (here a stand-in that does) but torch sees no CUDA device (a CPU build of torch, a driver
    mismatch): that is a failure, not a machine without a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (stand-in)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    done = session(tmp_path / "out", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "nvidia-smi sees a GPU but torch sees no CUDA device" in done.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["verdict"] == "FAILED"


def test_timeouts_over_480_s_are_refused_before_anything_runs(tmp_path):
    done = session(tmp_path, T_SPEED="400")
    assert done.returncode == 2, done.stdout + done.stderr
    assert printed_total(done.stdout) > LIMIT
    assert "REFUSED" in done.stdout and "nothing was run" in done.stdout
    assert not (tmp_path / "summary.txt").exists() and not (tmp_path / "probe.log").exists()
