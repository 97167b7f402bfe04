"""examples/tlt_colab.ipynb executed top to bottom as a user runs it (slow: the real SmolLM2-135M, on CPU).

Its parameters cell reads TLT_NOTEBOOK_ARGS and TLT_NOTEBOOK_OUTPUT_DIR: here the embedded model with the smallest
run examples/reproduce.py takes (2 GRPO steps of 1 prompt x 2 samples, 8 new tokens), results in a temp dir. Its
set-up cell installs nothing where the package and its extras are installed (CI), so this also checks that it does
not break there. The notebook is executed from examples/ of this checkout, as when opened from a clone. About a
minute on 2 CPU cores.
"""

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "tlt_colab.ipynb"
QUICK = "--model smollm2-135m --steps 2 --prompts-per-step 1 --num-generations 2 --max-completion-length 8"


def _text(output) -> str:
    if output["output_type"] == "stream":
        return output["text"]
    if output["output_type"] == "error":
        return "\n".join(output["traceback"])
    return output.get("data", {}).get("text/plain", "")


def test_colab_notebook_runs_on_the_embedded_model(tmp_path, monkeypatch):
    for module in ("nbclient", "nbformat", "ipykernel", "trl", "matplotlib", "reasoning_gym"):
        pytest.importorskip(module)
    import nbformat
    from nbclient import NotebookClient

    out = tmp_path / "colab"
    monkeypatch.setenv("TLT_NOTEBOOK_ARGS", QUICK)
    monkeypatch.setenv("TLT_NOTEBOOK_OUTPUT_DIR", str(out))
    monkeypatch.setenv("PIP_NO_INPUT", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # One intra-op thread, as tests/conftest.py gives the tests' own torch: on a machine where other processes hold
    # the cores, OpenMP threads spinning for their share made this run 5-10x slower (60 s of rollout for 16 tokens).
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("TLT_TEST_THREADS", "1"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    finally:  # kept for a look at what each cell printed
        nbformat.write(notebook, tmp_path / "executed.ipynb")

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), "the first code cell is the parameters cell"
    printed = {i: "".join(_text(o) for o in cell.outputs) for i, cell in enumerate(code)}
    setup, run, results, drafter = printed[1], printed[2], code[3], printed[4]
    assert "installing" not in setup, f"the set-up cell installed on a machine that has everything:\n{setup}"
    assert "examples/reproduce.py" in run and "wrote " in run, run[-3000:]

    # The results cell shows the summary table, the per-step table, the ratios and the figure.
    markdown = [o["data"]["text/markdown"] for o in results.outputs if "text/markdown" in o.get("data", {})]
    assert len(markdown) == 2, results.outputs
    summary, steps = markdown
    assert "| step seconds |" in summary and "| rollout seconds (generation) |" in summary, summary
    assert "| drafter update seconds (after the rollout) |" in summary, summary
    assert steps.count("\n| 1 |") == 1 and "\n| 2 |" in steps and "| whole training |" in steps, steps
    ratios = "".join(_text(o) for o in results.outputs if o["output_type"] == "stream")
    assert "end-to-end step time, stock / TLT:" in ratios and "rollout time, stock / TLT:" in ratios, ratios
    images = [o for o in results.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and len(images[0]["data"]["image/png"]) > 10_000
    assert (out / "reproduce.png").stat().st_size > 10_000 and (out / "reproduce.json").is_file()

    # The figure drew the steps the tables print; TLT's rollout seconds are generation only, as TLT logs them
    # (its log counts from the start of TRL's _generate, a little earlier), its drafter update apart.
    data = json.loads((out / "reproduce.json").read_text())
    for key in ("step_seconds", "rollout_seconds"):
        for name, run in data["runs"].items():
            assert data["plotted"][key]["lines"][name]["values"] == [s[key] for s in run["steps"]]
    for s in data["runs"]["tlt"]["steps"]:
        logged = s["logged"]["tlt/rollout_seconds"]
        assert 0.8 * logged - 0.5 <= s["rollout_seconds"] <= logged + 1e-3, s
        assert s["drafter_update_seconds"] >= s["logged"]["tlt/drafter_update_seconds"] > 0, s

    # The TLT run's drafter is where the notebook says, and loads back.
    assert (out / "tlt" / "drafter" / "config.json").is_file()
    assert (out / "tlt" / "drafter" / "model.safetensors").is_file()
    assert "M parameters, for HuggingFaceTB/SmolLM2-135M-Instruct" in drafter, drafter
