"""Every measured figure in the docs comes from a results file.

    python benchmarks/doc_figures.py          # list the figures no results file holds (exit 1 if any)

(``python benchmarks/update_docs.py --check`` runs the same check.)

Scanned: README.md, docs/*.md and the shipped drafters' model cards (tlt_trainers/shipped/*/README.md), prose only:
fenced code, inline code, link targets, HTML comments and the generated ``<!-- results:NAME -->`` blocks are skipped.

A figure is a number in prose that reads as a measurement:

- a number with a unit of speed or size: ``1.65x``, ``74.1%``, ``18.6 s``, ``40 minutes``, ``950 tokens/s``,
  ``14.5M``, ``1.2 GB``;
- any number with decimals: ``2.04 tokens per forward``, ``p = 0.33``, except a lone one after a package name (a
  version: ``torch 2.13``), a setting's name (``temperature 0.6``, ``lr 0.001``, ``default 1.25``, ``within 0.1``)
  or a comparison sign;
- a count out of a total: ``60 of 81``;
- a range of these, ``0.33-0.71x``, ``2.78-3.01``: both ends must come from one file.

Whole numbers without a unit (``12 steps``, ``batch 4``, ``192 tokens``) are settings and are not checked.

A figure passes when it is one of the numbers of a results file, rounded as printed (``1.65`` holds 1.6511;
``74.1%`` holds 74.1 or 0.741; numbers inside a file's strings, its printed tables, count). The files it may come
from are the nearest ones the text names: the results files named in its paragraph (``benchmarks/results/X.json``,
or a shipped drafter's ``tlt_trainers/shipped/NAME/training.json``); else those named in its section (which
includes the ``<!-- results:X -->`` blocks there); else any ``benchmarks/results/*.json``. A figure that is not a
measurement (a threshold, a definition, an estimate said to be one) is let through by a marker in its paragraph
that says why: ``<!-- not measured "10%": the test's tolerance -->``. Keep those rare.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def documents(root: Path = ROOT) -> list[Path]:
    """README.md, docs/*.md and the shipped model cards."""
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    cards = sorted((root / "tlt_trainers" / "shipped").glob("*/README.md"))
    return readme + sorted((root / "docs").glob("*.md")) + cards


# --- where a figure may come from -------------------------------------------------------------------------------

SOURCE = re.compile(r"((?:benchmarks/)?results/[\w.-]+\.json|tlt_trainers/shipped/[\w.-]+/training\.json)"
                    r"|<!-- results:(\w+) -->")
NUMBER_IN_TEXT = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _numbers(data, out: list[float]) -> None:
    if isinstance(data, bool) or data is None:
        return
    if isinstance(data, (int, float)):
        if math.isfinite(data):  # a NaN would break the sort
            out.append(abs(float(data)))
    elif isinstance(data, str):
        out.extend(float(m) for m in NUMBER_IN_TEXT.findall(data))
    elif isinstance(data, dict):
        for key, value in data.items():
            _numbers(key, out)
            _numbers(value, out)
    elif isinstance(data, list):
        for value in data:
            _numbers(value, out)


class Sources:
    """The numbers of each results file, loaded once."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self._numbers: dict[str, list[float]] = {}

    def all(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in (self.root / "benchmarks" / "results").glob("*.json"))

    @staticmethod
    def placeholder(mention: str) -> bool:
        """``benchmarks/results/NAME.json`` in a sentence about the files: no file meant."""
        return Path(mention).stem.isupper()

    def normalise(self, mention: str) -> str:
        return mention if mention.startswith(("benchmarks/", "tlt_trainers/")) else f"benchmarks/{mention}"

    def exists(self, name: str) -> bool:
        return (self.root / name).is_file()

    def numbers(self, name: str) -> list[float]:
        if name not in self._numbers:
            values: list[float] = []
            _numbers(json.loads((self.root / name).read_text()), values)
            self._numbers[name] = sorted(values)
        return self._numbers[name]

    def holds_figure(self, name: str, figure: Figure) -> bool:
        """Whether every end of the figure is one of the file's numbers under one of its readings."""
        return all(any(self.holds(name, [reading]) for reading in end) for end in figure.ends)

    def holds(self, name: str, values: list[tuple[float, float]]) -> bool:
        """Whether every (value, half-width) is one of the file's numbers, rounded as printed."""
        numbers = self.numbers(name)
        for value, tolerance in values:
            i = bisect.bisect_left(numbers, value - tolerance - 1e-9)
            if i == len(numbers) or numbers[i] > value + tolerance + 1e-9:
                return False
        return True


# --- what a figure is -------------------------------------------------------------------------------------------

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = (r"x(?!\s*\d)|×|%|ms|µs|us|s|secs?|seconds?|min|minutes?|hours?|h|tokens?/s|tok/s|it/s|"
        r"[KMGT]i?B|[kKMB](?=\s|[),;:.]|$)")
FIGURE = re.compile(rf"(?<![\w.\-/])(?P<n>\d+) of (?P<m>\d+)(?![\w.])"
                    rf"|(?<![\w.\-/+=#])(?P<a>{NUM})"
                    rf"(?:(?P<join>\s*(?:-|–|to)\s*)(?P<b>{NUM}))?"
                    rf"(?:\s*(?P<unit>{UNIT}))?(?!\d|\.\d|\w)")
# A lone number without a unit after these is a version or a setting, not a measurement: vLLM 0.31, torch 2.13,
# temperature 0.6, lr 0.001, (default 1.25), a margin or a tolerance (within 0.1).
NOT_MEASURED_BEFORE = re.compile(
    r"(?i)(?:\b(?:vllm(?:-cpu)?|torch|pytorch|transformers|trl|verl|python|cuda|triton|sglang|speculators|ray|numpy|"
    r"flash-attn|release|version|v|temperatures?|T|lr|learning rate|top-p|top-k|default|margin|tolerance|threshold|"
    r"within)|[<>=≤≥])\s*(?:[<>=]=?\s*)?$")
SCALE = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9}


def _parse(text: str, unit: str | None) -> list[tuple[float, float]]:
    """The number as candidates (value, half-width of its rounding): 74.1% is 74.1 or 0.741."""
    digits = text.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value, tolerance = float(digits), 0.5 * 10 ** -decimals
    if unit in SCALE:
        return [(value * SCALE[unit], tolerance * SCALE[unit])]
    if unit == "%":
        return [(value, tolerance), (value / 100, tolerance / 100)]
    return [(value, tolerance)]


@dataclass
class Figure:
    line: int
    text: str
    ends: list[list[tuple[float, float]]]  # per end of a range, its candidate readings


def figures(line: str, number: int = 0) -> list[Figure]:
    """The measured-looking figures of one line of prose (already stripped of code and links)."""
    found = []
    for m in FIGURE.finditer(line):
        if m.group("n"):
            n, total = int(m.group("n")), int(m.group("m"))
            if n <= total:
                found.append(Figure(number, m.group(0), [[(n, 0.0)], [(total, 0.0)]]))
            continue
        a, b, unit = m.group("a"), m.group("b"), m.group("unit")
        if b is None and (unit is None or unit in SCALE) and NOT_MEASURED_BEFORE.search(line[: m.start()]):
            continue  # vLLM 0.31, temperature 0.6: a version or a setting
        if unit is None and "." not in a and (b is None or "." not in b):
            continue  # a whole number without a unit: a setting, a count
        text = m.group(0).strip()
        if unit in ("x", "×") and not re.search(r"\d[x×]$", text):
            continue  # 2 x vocab x hidden: a product of sizes, not a ratio
        if b is not None and m.group("join").strip() == "-" and "." not in a + b and unit is None:
            continue  # 2026-12: a date or an id
        ends = [_parse(a, unit)] + ([_parse(b, unit)] if b is not None else [])
        found.append(Figure(number, text, ends))
    return found


# --- reading a document -----------------------------------------------------------------------------------------

MARKER = re.compile(r'<!--\s*not measured\s+"([^"]+)"\s*:\s*(\S.*?)\s*-->')
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"(`+).*?\1", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
URL = re.compile(r"https?://\S+")
FENCE = re.compile(r"^\s*(```|~~~)")
BLOCK_START = re.compile(r"<!-- results:(\w+) -->")
HEADING = re.compile(r"^#{1,6}\s")
LIST_ITEM = re.compile(r"^\s*(?:[*+-]|\d+[.)])\s")


@dataclass
class Paragraph:
    lines: list[tuple[int, str]]  # (line number, its prose: code, comments and link targets blanked)
    sources: set[str]
    markers: dict[str, str]
    section: int


def _named(line: str) -> set[str]:
    return {m.group(1) or f"results/{m.group(2)}.json" for m in SOURCE.finditer(line)}


def paragraphs(text: str) -> tuple[list[Paragraph], dict[int, set[str]]]:
    """The prose paragraphs of a markdown text, and the sources named in each section (its heading to the next)."""
    lines = text.splitlines()
    start = 0
    if lines and lines[0].strip() == "---":  # YAML front matter of a model card
        start = next((i + 1 for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
    paras, sections = [], {0: set()}
    section, current, fence, block = 0, None, None, None
    for i in range(start, len(lines)):
        raw = lines[i]
        if HEADING.match(raw) and not fence and not block:
            section += 1
            sections[section] = _named(raw)  # the results file a heading names is its section's source
            current = None
        sections[section] |= {f"results/{name}.json" for name in BLOCK_START.findall(raw)}  # and its results blocks
        if fence:
            fence = None if raw.strip().startswith(fence) else fence
            current = None
            continue
        if block:
            block = None if f"<!-- /results:{block} -->" in raw else block
            current = None
            continue
        opened = BLOCK_START.search(raw)
        if FENCE.match(raw) or (opened and f"<!-- /results:{opened.group(1)} -->" not in raw):
            fence = FENCE.match(raw).group(1) if FENCE.match(raw) else None
            block = None if fence else opened.group(1)
            current = None
            continue
        if not raw.strip():
            current = None
            continue
        if current is None or LIST_ITEM.match(raw):  # a list item is a paragraph of its own
            current = Paragraph([], set(), {}, section)
            paras.append(current)
        current.lines.append((i + 1, raw))
        if HEADING.match(raw):
            current = None
    for para in paras:  # code spans, comments and links may run over lines
        text = "\n".join(line for _, line in para.lines)
        para.sources, para.markers = _named(text), dict(MARKER.findall(text))
        for pattern, keep in ((COMMENT, ""), (INLINE_CODE, ""), (LINK_TARGET, "]"), (URL, "")):
            text = pattern.sub(lambda m, keep=keep: keep + " " + "\n" * m.group(0).count("\n"), text)
        para.lines = list(zip((number for number, _ in para.lines), text.split("\n")))
    return paras, sections


def check_text(text: str, where: str, sources: Sources) -> list[str]:
    """One message per figure of ``text`` that the results files named for it do not hold, per results file named
    that does not exist, and per marker that names no figure of its paragraph."""
    problems = []
    paras, sections = paragraphs(text)
    for para in paras:
        named = sorted({sources.normalise(s) for s in para.sources or sections[para.section]
                        if not sources.placeholder(s)})
        for name in named:
            if not sources.exists(name):
                problems.append(f"{where}:{para.lines[0][0]}: names {name}, which does not exist")
        scope = [name for name in named if sources.exists(name)]
        used = set()
        for number, prose in para.lines:
            for fig in figures(prose, number):
                if fig.text in para.markers:
                    used.add(fig.text)
                    continue
                if any(sources.holds_figure(name, fig) for name in scope):
                    continue
                problems.append(f"{where}:{number}: \"{fig.text}\" {_whence(fig, named, bool(para.sources), sources)}")
        for marked in sorted(set(para.markers) - used):
            problems.append(f"{where}:{para.lines[0][0]}: <!-- not measured \"{marked}\" --> names no figure of its "
                            "paragraph")
    return problems


def _whence(fig: Figure, named: list[str], in_paragraph: bool, sources: Sources) -> str:
    """What is wrong with an untraced figure, and what to do."""
    holding = [name for name in sources.all() if sources.holds_figure(name, fig)]
    if named:
        what = f"is not in {', '.join(named)} (named in its {'paragraph' if in_paragraph else 'section'})"
    else:
        what = "has no results file named in its paragraph or section"
    if not holding:
        todo = "no results file holds it: drop the number, or measure it and save the result"
    elif len(holding) <= 3:
        todo = f"{' and '.join(holding)} hold{'s' if len(holding) == 1 else ''} it: name the one it comes from"
    else:
        todo = f"{len(holding)} results files hold it (by chance?): name the one it comes from"
    return f"{what}; {todo}, or mark it <!-- not measured \"{fig.text}\": why -->"


def check(root: Path = ROOT, paths: list[Path] | None = None) -> list[str]:
    sources = Sources(root)
    problems = []
    for path in paths or documents(root):
        problems += check_text(path.read_text(), str(path.relative_to(root)), sources)
    return problems


def main() -> None:
    problems = check()
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} figure(s) in the docs that the results files named for them do not hold")
        sys.exit(1)


if __name__ == "__main__":
    main()
