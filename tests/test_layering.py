"""The package's layers hold: no import cycle and no import from a lower layer to a higher one
(``scripts/import_graph.py`` measures both from the source)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_cycle_and_no_upward_import(import_graph):
    report = import_graph.measure(ROOT)
    assert report["modules"] > 50
    assert report["cycles"] == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in report["cycles"])
    assert report["upward"] == [], "imports that run up: " + "; ".join(f"{a['from']} -> {a['to']}"
                                                                      for a in report["upward"])


def test_the_measure_sees_cycles_and_upward_imports(import_graph, tmp_path):
    package = tmp_path / "tlt_trainers"
    for part in ("sampling", "kernels"):
        (package / part).mkdir(parents=True)
        (package / part / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "sampling" / "a.py").write_text("from . import b\n\ndef f():\n    from ..kernels import k\n")
    (package / "sampling" / "b.py").write_text("from .a import f\n")
    (package / "kernels" / "k.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from ..sampling import a\n")
    report = import_graph.measure(tmp_path)
    assert report["cycles"] == [["tlt_trainers.sampling.a", "tlt_trainers.sampling.b"]]
    assert report["upward"] == [{"from": "tlt_trainers.sampling.a", "to": "tlt_trainers.kernels.k", "lazy": True}]
