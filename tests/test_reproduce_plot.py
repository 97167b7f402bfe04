"""examples/reproduce.py: the figure draws the numbers its tables print (every step, and the means over the same
steps), on whole-step x axes; TLT's drafter update, which runs inside the timed rollout call, is left out of the
rollout seconds and timed apart. No model runs: stored results and made-up ones."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORED = ["reproduce_full.json", "reproduce_full_seed1.json"]
# The summary table's row for each panel (results written before the drafter update was timed apart say
# "rollout seconds"; newer ones "rollout seconds (generation)").
ROWS = {"step_seconds": "step seconds", "rollout_seconds": "rollout seconds", "acceptance_length": "acceptance length",
        "reward": "reward"}
COLUMNS = {"stock": 1, "tlt": 2}


@pytest.fixture(scope="module")
def reproduce():
    pytest.importorskip("matplotlib")
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "examples" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(markdown: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.splitlines()
             if line.startswith("|") and not line.startswith("|---")]
    return {row[0]: row for row in cells[1:]}


def summary_row(table: dict, key: str) -> list[str]:
    label = ROWS[key]
    (row,) = [row for name, row in table.items() if name == label or name.startswith(label + " (")]
    return row


def check_figure_against_tables(plotted: dict, results: dict, skip: int, table: str, step_table: str | None):
    summary = rows(table)
    for key in ROWS:
        panel = plotted[key]
        steps_drawn = {s for line in panel["lines"].values() for s in line["steps"]}
        assert panel["xticks"] and all(t == int(t) for t in panel["xticks"]), (key, panel["xticks"])
        assert all(s == int(s) for s in steps_drawn), steps_drawn
        for name, result in results.items():
            line = panel["lines"][name]
            points = [s for s in result["steps"] if s.get(key) is not None]
            assert line["steps"] == [s["step"] for s in points] and line["values"] == [s[key] for s in points], key
            averaged = result["steps"][skip:] or result["steps"]
            mean = line["mean"]["values"]
            assert mean[0] == mean[-1]
            assert line["mean"]["steps"][0] <= averaged[0]["step"] and line["mean"]["steps"][-1] >= averaged[-1]["step"]
            printed = summary_row(summary, key)[COLUMNS[name]]
            assert f"{mean[0]:.3g}" == printed, f"{key} {name}: the figure's mean {mean[0]:.3g}, the table's {printed}"
            assert line["mean"]["label"].endswith(f" {printed}"), line["mean"]["label"]
    if step_table is None:
        return
    per_step = rows(step_table)
    for key, column, spec in (("step_seconds", 1, ".1f"), ("step_seconds", 2, ".1f"), ("rollout_seconds", 4, ".1f"),
                              ("rollout_seconds", 5, ".1f"), ("acceptance_length", 7, ".3f")):
        name = "stock" if column in (1, 4) else "tlt"
        line = plotted[key]["lines"][name]
        for step, value in zip(line["steps"], line["values"]):
            assert format(value, spec) == per_step[str(int(step))][column], (key, name, step)


@pytest.mark.parametrize("name", STORED)
def test_the_stored_runs_figure_draws_their_tables(reproduce, name, tmp_path):
    """The committed figures (docs/images/reproduce_full.png is drawn from reproduce_full.json) show the same
    numbers as the tables stored with them, which the README and docs/benchmarks.md print."""
    data = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    skip = data["settings"]["skip_steps"]
    plotted = reproduce.plot(data["runs"], tmp_path / "figure.png", skip)
    assert (tmp_path / "figure.png").stat().st_size > 10_000
    check_figure_against_tables(plotted, data["runs"], skip, data["table"], None)
    # Its step table (an older layout: step seconds and TLT's acceptance length) agrees too.
    per_step = rows(data["step_table"])
    for key, column, run, spec in (("step_seconds", 1, "stock", ".1f"), ("step_seconds", 2, "tlt", ".1f"),
                                   ("acceptance_length", 4, "tlt", ".3f")):
        line = plotted[key]["lines"][run]
        assert [format(v, spec) for v in line["values"]] == [per_step[str(int(s))][column] for s in line["steps"]]


def made_up_results(steps: int) -> dict:
    runs = {}
    for i, name in enumerate(("stock", "tlt")):
        records = [{"step": s, "step_seconds": 30.0 + 7.3 * s + 3 * i, "rollout_seconds": 10.0 + 1.7 * s - 2 * i,
                    "drafter_update_seconds": 1.1 * i * s, "reward": 0.0625 * (s % 3),
                    "acceptance_length": 1.0 + 0.11 * i * s, "completion_length": 40.0 + s}
                   for s in range(1, steps + 1)]
        runs[name] = {"name": name, "train_seconds": sum(r["step_seconds"] for r in records), "steps": records}
    return runs


@pytest.mark.parametrize("steps,skip", [(3, 1), (2, 1), (1, 1), (12, 1), (5, 0)])
def test_figure_and_tables_show_the_same_numbers(reproduce, steps, skip):
    """A new run's summary table and step table against its figure: each step's values and the means over the same
    steps, on whole-step x ticks (3 steps once gave ticks at 1.25, 1.5, ...)."""
    results = made_up_results(steps)
    summaries = {name: reproduce.summarize(result, skip) for name, result in results.items()}
    plotted = reproduce.plot(results, None, skip)
    table, step_table = reproduce.table(summaries), reproduce.step_table(results)
    check_figure_against_tables(plotted, results, skip, table, step_table)
    assert plotted["rollout_seconds"]["lines"]["tlt"]["drafter_update"]["values"] == [
        s["drafter_update_seconds"] for s in results["tlt"]["steps"]]
    assert "drafter_update" not in plotted["rollout_seconds"]["lines"]["stock"]  # stock has none
    assert summary_row(rows(table), "rollout_seconds")[0] == "rollout seconds (generation)"
    update = rows(table)["drafter update seconds (after the rollout)"]  # its own row
    assert update[1:3] == ["0", f"{summaries['tlt']['drafter_update_seconds']:.3g}"]
    assert all(rows(step_table)[str(s["step"])][6] == f"{s['drafter_update_seconds']:.1f}"
               for s in results["tlt"]["steps"])


def test_rollout_seconds_leave_out_the_drafter_update(reproduce, monkeypatch):
    """TLTGRPOTrainer trains its drafter inside _generate_single_turn, right after generating: the timer counts the
    generation as rollout and the update apart (what TLT logs as tlt/rollout_seconds is generation only too)."""
    assert reproduce.TimedTLT.__mro__[1:3] == (reproduce.RolloutTimer, reproduce.DrafterUpdateTimer)
    clock = [0.0]
    monkeypatch.setattr(reproduce.time, "perf_counter", lambda: clock[0])

    class Policy:
        training = True

    class GeneratesThenUpdates:  # the order of TLTGRPOTrainer._generate_single_turn
        model = Policy()

        def _generate_single_turn(self, prompt_ids):
            clock[0] += 3.0
            self._tlt_after_rollout()
            return prompt_ids

        def _tlt_after_rollout(self):
            clock[0] += 1.25

    class Timed(reproduce.RolloutTimer, reproduce.DrafterUpdateTimer, GeneratesThenUpdates):
        pass

    trainer = Timed()
    assert trainer._generate_single_turn([1]) == [1]
    trainer._generate_single_turn([2])
    assert trainer.rollout_seconds == 6.0 and trainer.drafter_update_seconds == 2.5

    class Stock(reproduce.RolloutTimer, GeneratesThenUpdates):  # no update timer: all of the call is the rollout
        pass

    stock = Stock()
    stock._generate_single_turn([1])
    assert stock.rollout_seconds == 4.25 and stock.drafter_update_seconds == 0.0
