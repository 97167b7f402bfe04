import os
import sys
from pathlib import Path

# Without CUDA, Triton kernels run in Triton's interpreter (tests/test_kernels_triton.py). Triton reads the flag
# when it is first imported (its own tl.* helpers are compiled or interpreted then), so it is set before anything
# imports it; vLLM's CPU backend does not run Triton kernels, so its tests are unaffected.
if os.environ.get("TRITON_INTERPRET") is None and "triton" not in sys.modules:
    import torch.cuda

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import contextlib  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from intra-op threads, and OpenMP spinning makes them crawl when another process
# (a benchmark, a second pytest) holds the cores. Tests on the real model set their own thread count.
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _own_cost_cache(tmp_path_factory, monkeypatch):
    """Each test starts without measured costs (the adaptive engine's persistent cache, ``TLTConfig.cost_cache``):
    what one test measured must not steer another's choices. Subprocesses inherit the variable."""
    monkeypatch.setenv("TLT_COST_CACHE", str(tmp_path_factory.mktemp("tlt_costs")))


@pytest.fixture(scope="module")
def sampling_model():
    """The small-vocabulary, sharp model of the two-sample distribution tests (trees and history)."""
    from tiny_models import tiny_model

    return tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3)


# ---------------------------------------------------------------- our deprecated calls as errors
# ``--our-deprecations-as-errors`` (.ci/run passes it): a FutureWarning or DeprecationWarning is raised as an error
# where the deprecated call is made by tlt_trainers, and left a warning where transformers, TRL or the tests make it.
# A ``-W error::FutureWarning`` filter (or one on the warning's module) cannot tell them apart: transformers'
# ``deprecate_kwarg`` (stacklevel=2) names the frame that called the deprecated function, which for a model's
# ``forward`` is torch's ``Module._call_impl`` whoever called the model, and its deprecated aliases
# (``gradient_checkpointing_enable``, TrainingArguments fields; stacklevel=1) name their own line. So, inside
# ``warnings.showwarning`` (the public hook, called while the warning call is still on the stack), the frame the
# warning names is found on the live stack; where that is the warning function itself, its caller is taken instead;
# module-call plumbing and decorators (torch's ``Module.__call__``, accelerate hooks, the wrappers in
# ``transformers.utils`` around a model's ``forward``) are skipped; the module of the first frame left made the call,
# and tlt_trainers makes it ours. It covers each test's setup (fixtures of every scope), call and teardown;
# an error swallowed by an ``except`` on its way up still fails the test. Subprocesses (torchrun, TRL scripts) are
# not covered.

_PLUMBING = ("torch", "accelerate", "functools", "contextlib", "transformers.utils")


def _plumbing(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return any(name == p or name.startswith(p + ".") for p in _PLUMBING)


def pytest_addoption(parser):
    parser.addoption("--our-deprecations-as-errors", action="store_true", default=False,
                     help="Raise FutureWarning/DeprecationWarning as errors where tlt_trainers makes the call.")


def deprecated_call_site(filename: str, lineno: int, frame) -> str | None:
    """The module that made the call a warning is about. ``frame``: the one inside ``showwarning``'s caller;
    ``filename:lineno``: where ``warnings`` attributed the warning. None when that frame is not on the stack."""
    while frame is not None and frame.f_code.co_filename == warnings.__file__:
        frame = frame.f_back
    warner = frame  # the frame that called warnings.warn
    while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == lineno):
        frame = frame.f_back
    if frame is None:
        return None
    if frame is warner:  # stacklevel=1: the warning names the deprecated function itself; its caller made the call
        frame = frame.f_back
    while frame is not None and _plumbing(frame):
        frame = frame.f_back
    return None if frame is None else frame.f_globals.get("__name__")


@contextlib.contextmanager
def _our_deprecations_as_errors(config):
    if not config.getoption("--our-deprecations-as-errors"):
        yield
        return
    ours = []

    with warnings.catch_warnings():
        # Every occurrence reaches showwarning: DeprecationWarning is ignored by default, and a FutureWarning shown
        # once per location would hide ours behind the same message from transformers' own call of the same model.
        warnings.simplefilter("always", DeprecationWarning)
        warnings.simplefilter("always", FutureWarning)
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, (DeprecationWarning, FutureWarning)):
                caller = deprecated_call_site(filename, lineno, sys._getframe(1))
                if caller is not None and caller.split(".")[0] == "tlt_trainers":
                    ours.append(f"{category.__name__} from a call in {caller}: {message}")
                    raise category(f"{message} [the deprecated call is made by {caller}]")
            return shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        try:
            yield
        finally:
            warnings.showwarning = shown
    if ours:
        pytest.fail("tlt_trainers made deprecated calls (an except on the way up hid the error):\n" + "\n".join(ours))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _our_deprecations_as_errors(item.config):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _our_deprecations_as_errors(item.config):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _our_deprecations_as_errors(item.config):
        return (yield)


# ---------------------------------------------------------------- what CI installed must run, not skip
# TLT_REQUIRE=vllm,verl (.ci/run sets it in the legs that install them): the session stops at once when one of them
# does not import (checked in a subprocess: importing vLLM here would change this process's logging and threads), and
# a test that skips for a reason naming one of them fails instead. Without it, a stray torchvision that breaks
# `import vllm` turned every vLLM test into a skip and CI went green with no vLLM coverage.
REQUIRED = tuple(name for name in os.environ.get("TLT_REQUIRE", "").split(",") if name)


def pytest_sessionstart(session):
    import subprocess

    for name in REQUIRED:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.exit(f"TLT_REQUIRE={','.join(REQUIRED)}: `import {name}` fails here, so its tests would only skip:\n"
                        f"{done.stderr.strip()[-1500:]}\nFix the install (see .ci/run), or unset TLT_REQUIRE.",
                        returncode=3)


def required_skip(reason: str) -> str | None:
    """The TLT_REQUIRE'd package a skip's reason names, if any."""
    lowered = reason.lower()
    return next((name for name in REQUIRED if name.lower() in lowered), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        name = required_skip(reason)
        if name is not None:
            report.outcome = "failed"
            report.longrepr = (f"skipped ({reason}), but TLT_REQUIRE={','.join(REQUIRED)} says {name} is installed "
                               "here: the test must run")
