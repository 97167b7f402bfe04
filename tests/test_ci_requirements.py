"""TLT_REQUIRE (tests/conftest.py, set by .ci/run where vLLM and veRL are installed): a skip that names a required
package fails, and a required package that does not import stops the session. Run on the suite's own conftest, in a
subprocess, with stand-ins for vLLM (``json``: always imports; ``no_such_package_tlt``: never)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
TESTS = '''
import pytest

def test_skips_naming_json():
    pytest.skip("json does not import here")

def test_skips_for_another_reason():
    pytest.skip("needs a CUDA device")

def test_runs():
    assert True
'''


def run(tmp_path: Path, required: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {**os.environ, "TLT_REQUIRE": required}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_naming_a_required_package_fails(tmp_path):
    done = run(tmp_path, "json")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 failed, 1 passed, 1 skipped" in done.stdout, done.stdout[-3000:]
    assert "TLT_REQUIRE=json says json is installed here" in done.stdout


def test_without_tlt_require_the_skip_stays_a_skip(tmp_path):
    done = run(tmp_path, "")
    assert done.returncode == 0 and "1 passed, 2 skipped" in done.stdout, done.stdout[-3000:]


def test_a_required_package_that_does_not_import_stops_the_session(tmp_path):
    done = run(tmp_path, "no_such_package_tlt")
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "`import no_such_package_tlt` fails here" in done.stdout + done.stderr
