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

A figure passes when it is one of the numeric values of a results file, with its sign and rounded as printed
(``1.65`` holds 1.6511; ``74.1%`` holds 74.1 or 0.741; ``-0.10`` holds -0.1 and ``0.10`` does not). Keys, commands,
dates and the numbers inside a file's strings do not count. "60 of 81" is one pair: 60 and 81 side by side in one
dict or list (or 60 beside a list of 81 items).

The files it may come from are the nearest ones the text names: those named in its paragraph
(``benchmarks/results/X.json``, or a shipped drafter's ``tlt_trainers/shipped/NAME/training.json``); else those
named in its section (which includes the ``<!-- results:X -->`` blocks there). A name may carry a key path to the
part of the file the figure comes from, in prose, inline code or a comment
(``<!-- figures from results/X.json#summary, results/X.json#rows[trainer=tlt] -->``; ``_select`` says the syntax): a
printed table's row (``#table[tlt]``) counts its numbers.

A file with thousands of numbers holds almost any figure by chance. So a figure passes only where the part named
holds at most 10% (``CHANCE_SHARE``) of the values printed at the figure's precision in its decade (for ``0.83``,
the 90 two-decimal values in [0.10, 1.00); for a range, both ends at once), or where the key path names a row (at most
24 numbers, ``ROW_SIZE``). Otherwise the message says the share and the key paths where the figure is, to name one.

A figure that is not a measurement (a threshold, a definition, a figure computed from others, an estimate said to be
one) is let through by a marker in its paragraph that says why: ``<!-- not measured "10%": the test's tolerance -->``.
Keep those rare.
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
                    r"(#[\w.\-\[\]=:+,]*[\w\]])?"
                    r"|<!-- results:(\w+) -->")
SELECTOR_STEP = re.compile(r"\.?([^.\[\]]+)|\[([^\]]*)\]")
CHANCE_SHARE = 0.10  # a scope that holds more than this share of a figure's neighbours cannot trace it...
ROW_SIZE = 24  # ...unless the text names a row: a key path that holds at most this many numbers


def _select(data, selector: str) -> list:
    """The parts of ``data`` a key path names: ``summary.tlt``, ``rows[trainer=tlt].ratio``, ``runs[0]``,
    ``sweep[1.0]``, ``table[generate]``.

    ``.key`` steps into a dict (or into each dict of a list); ``[...]`` on a dict is a key that may hold dots
    (``[1.0]``, ``[5-16]``); on a list ``[i]`` takes an item and ``[field=value]`` every item whose field prints as
    value; on a printed table (a string) ``[label]`` takes the row whose first cell is ``label`` (or starts with
    ``label`` and a space), as its numbers."""
    nodes = [data]
    for key, bracket in SELECTOR_STEP.findall(selector):
        found: list = []
        for node in nodes:
            if key:
                items = node if isinstance(node, list) else [node]
                found += [item[key] for item in items if isinstance(item, dict) and key in item]
            elif isinstance(node, dict):
                found += [node[bracket]] if bracket in node else []
            elif isinstance(node, str):
                found += _table_rows(node, bracket)
            elif isinstance(node, list) and re.fullmatch(r"-?\d+", bracket):
                index = int(bracket)
                found += [node[index]] if -len(node) <= index < len(node) else []
            elif isinstance(node, list) and "=" in bracket:
                field, value = bracket.split("=", 1)
                found += [item for item in node if isinstance(item, dict) and _printed(item.get(field)) == value]
        nodes = found
    return nodes


def _table_rows(table: str, label: str) -> list[list[float]]:
    """The numbers of each row of a printed table (``| generate | 256 | 55.3 |``) whose first cell is the label."""
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and (cells[0] == label or cells[0].startswith(label + " ")):
            rows.append([float(n.replace(",", "").replace("−", "-")) for cell in cells[1:]
                         for n in SIGNED_NUMBER.findall(cell)])
    return rows


SIGNED_NUMBER = re.compile(r"(?<![\w.])[-−]?\d+(?:,\d{3})*(?:\.\d+)?")


def _printed(value) -> str | None:
    if isinstance(value, bool):
        return str(value).lower()
    return None if value is None else str(value)


def _values(data, out: list[float]) -> None:
    """The numbers of ``data`` with their signs: its numeric values only, not its keys or the numbers in its strings."""
    if isinstance(data, bool) or data is None:
        return
    if isinstance(data, (int, float)):
        if math.isfinite(data):  # a NaN would break the sort
            out.append(float(data))
    elif isinstance(data, dict):
        for value in data.values():
            _values(value, out)
    elif isinstance(data, list):
        for value in data:
            _values(value, out)


def _pairs(data, out: set[tuple[float, float]]) -> None:
    """Every (n, m) that one dict or list holds side by side (``{"accepted": 60, "drafts": 81}``), and every (n, m)
    where a list of m items sits beside n (``{"passed": 3, "runs": [...]}``): what ``60 of 81`` may come from."""
    if isinstance(data, dict):
        children = list(data.values())
    elif isinstance(data, list):
        children = data
    else:
        return
    numbers = [float(v) for v in children if isinstance(v, (int, float)) and not isinstance(v, bool)]
    lengths = [float(len(v)) for v in children if isinstance(v, list)]
    out.update((n, m) for n in numbers for m in numbers + lengths)
    for child in children:
        _pairs(child, out)


@dataclass(frozen=True)
class Scope:
    """A results file, or the part of it a key path names (``benchmarks/results/X.json#rows[trainer=tlt]``)."""

    file: str
    selector: str = ""

    def __str__(self) -> str:
        return self.file + (f"#{self.selector}" if self.selector else "")


class Sources:
    """The numbers of each results file (or of the part a key path names), loaded once."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self._data: dict[str, object] = {}
        self._numbers: dict[Scope, list[float]] = {}
        self._pairs: dict[Scope, set[tuple[float, float]]] = {}

    def all(self) -> list[Scope]:
        return [Scope(str(p.relative_to(self.root)))
                for p in sorted((self.root / "benchmarks" / "results").glob("*.json"))]

    @staticmethod
    def placeholder(mention: str) -> bool:
        """``benchmarks/results/NAME.json`` in a sentence about the files: no file meant."""
        return Path(mention.split("#")[0]).stem.isupper()

    def scope(self, mention: str) -> Scope:
        file, _, selector = mention.partition("#")
        file = file if file.startswith(("benchmarks/", "tlt_trainers/")) else f"benchmarks/{file}"
        return Scope(file, selector)

    def exists(self, scope: Scope) -> bool:
        return (self.root / scope.file).is_file()

    def selects(self, scope: Scope) -> bool:
        """Whether the key path names a part of the file that holds numbers."""
        return bool(self.numbers(scope))

    def _parts(self, scope: Scope) -> list:
        if scope.file not in self._data:
            self._data[scope.file] = json.loads((self.root / scope.file).read_text())
        data = self._data[scope.file]
        return _select(data, scope.selector) if scope.selector else [data]

    def numbers(self, scope: Scope) -> list[float]:
        if scope not in self._numbers:
            values: list[float] = []
            _values(self._parts(scope), values)
            self._numbers[scope] = sorted(values)
        return self._numbers[scope]

    def is_row(self, scope: Scope) -> bool:
        """Whether the key path names a row: a part of the file small enough that a figure naming it is checked
        against a handful of numbers, not the file's thousands."""
        return bool(scope.selector) and len(self.numbers(scope)) <= ROW_SIZE

    def pairs(self, scope: Scope) -> set[tuple[float, float]]:
        if scope not in self._pairs:
            found: set[tuple[float, float]] = set()
            _pairs(self._parts(scope), found)
            self._pairs[scope] = found
        return self._pairs[scope]

    def holds_figure(self, scope: Scope, figure: Figure) -> bool:
        """Whether every end of the figure is one of the scope's numbers under one of its readings (an "N of M" as one
        pair held side by side)."""
        if figure.pair:
            return figure.pair in self.pairs(scope)
        return all(any(self.holds(scope, [reading]) for reading in end) for end in figure.ends)

    def holds(self, scope: Scope, values: list[tuple[float, float]]) -> bool:
        """Whether every (value, half-width) is one of the scope's numbers, rounded as printed."""
        numbers = self.numbers(scope)
        for value, tolerance in values:
            i = bisect.bisect_left(numbers, value - tolerance - 1e-9)
            if i == len(numbers) or numbers[i] > value + tolerance + 1e-9:
                return False
        return True

    def chance(self, scope: Scope, figure: Figure) -> float:
        """The share of the figure's neighbours that the scope would hold as well: of the values printed at the
        figure's precision in its decade (``0.83`` has the 90 two-decimal values in [0.10, 1.00), ``12.5 s`` the 900
        one-decimal ones in [10, 100)), the share some number of the scope rounds to. For a range, the product of
        its ends' shares (both must hold); for an end, the highest share among its readings that the scope holds; 0
        for an "N of M", which is checked as one pair."""
        if figure.pair:
            return 0.0
        chance = 1.0
        for end in figure.ends:
            chance *= max([self._neighbour_share(scope, value, tolerance) for value, tolerance in end
                           if self.holds(scope, [(value, tolerance)])], default=0.0)
        return chance

    def _neighbour_share(self, scope: Scope, value: float, tolerance: float) -> float:
        step = 2 * tolerance
        if step <= 0:
            return 0.0
        magnitude = abs(value)
        low = 10 ** math.floor(math.log10(magnitude)) if magnitude >= step else 0.0
        high = max(10 * low, step * 10)
        if (high - low) / step > 1e6:
            return 0.0
        sign = -1.0 if value < 0 else 1.0
        numbers = self.numbers(scope)
        lo = bisect.bisect_left(numbers, min(sign * low, sign * high) - tolerance)
        hi = bisect.bisect_right(numbers, max(sign * low, sign * high) + tolerance)
        grid = {round(abs(n) / step) for n in numbers[lo:hi]}
        points = {g for g in grid if low - 1e-12 <= g * step < high - 1e-12}
        return len(points) / max(1, round((high - low) / step))


# --- what a figure is -------------------------------------------------------------------------------------------

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = (r"x(?!\s*\d)|×|%|ms|µs|us|s|secs?|seconds?|min|minutes?|hours?|h|tokens?/s|tok/s|it/s|"
        r"[KMGT]i?B|[kKMB](?=\s|[),;:.]|$)")
FIGURE = re.compile(rf"(?<![\w.\-/])(?P<n>\d+) of (?P<m>\d+)(?![\w.])"
                    rf"|(?:(?<![^\s|(])(?P<minus>[-−])|(?<![\w.\-/+=#−]))(?P<a>{NUM})"
                    rf"(?:(?P<join>\s*(?:-|–|to)\s*)(?P<b>{NUM}))?"
                    rf"(?:\s*(?P<unit>{UNIT}))?(?!\d|\.\d|\w)")
# A lone number without a unit after these is a version or a setting, not a measurement: vLLM 0.31, torch 2.13,
# temperature 0.6, lr 0.001, (default 1.25), a margin or a tolerance (within 0.1).
NOT_MEASURED_BEFORE = re.compile(
    r"(?i)(?:\b(?:vllm(?:-cpu)?|torch|pytorch|transformers|trl|verl|python|cuda|triton|sglang|speculators|ray|numpy|"
    r"flash-attn|release|version|v|temperatures?|T|lr|learning rate|top-p|top-k|default|margin|tolerance|threshold|"
    r"within|under|below|above|over|at least|at most)|[<>=≤≥])\s*(?:[<>=]=?\s*)?$")
SCALE = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9}


def _parse(text: str, unit: str | None, negative: bool = False) -> list[tuple[float, float]]:
    """The number as candidates (value, half-width of its rounding): 74.1% is 74.1 or 0.741; -0.10 is negative."""
    digits = text.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value, tolerance = float(digits) * (-1 if negative else 1), 0.5 * 10 ** -decimals
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
    pair: tuple[float, float] | None = None  # "60 of 81", held side by side


def figures(line: str, number: int = 0, before: str = "") -> list[Figure]:
    """The measured-looking figures of one line of prose (already stripped of code and links); ``before`` is the
    paragraph's line above it, for a version or setting named at the end of that line (``vLLM\n0.31``)."""
    found = []
    for m in FIGURE.finditer(line):
        if m.group("n"):
            n, total = int(m.group("n")), int(m.group("m"))
            if n <= total:
                found.append(Figure(number, m.group(0), [[(n, 0.0)], [(total, 0.0)]], (float(n), float(total))))
            continue
        a, b, unit = m.group("a"), m.group("b"), m.group("unit")
        setting = NOT_MEASURED_BEFORE.search(f"{before} {line[: m.start()]}")
        if b is None and (unit is None or unit in SCALE) and setting:
            continue  # vLLM 0.31, temperature 0.6: a version or a setting
        if unit is None and "." not in a and (b is None or "." not in b):
            continue  # a whole number without a unit: a setting, a count
        text = m.group(0).strip()
        if unit in ("x", "×") and not re.search(r"\d[x×]$", text):
            continue  # 2 x vocab x hidden: a product of sizes, not a ratio
        if b is not None and m.group("join").strip() == "-" and "." not in a + b and unit is None:
            continue  # 2026-12: a date or an id
        ends = [_parse(a, unit, bool(m.group("minus")))] + ([_parse(b, unit)] if b is not None else [])
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
    return {(m.group(1) + (m.group(2) or "")) if m.group(1) else f"results/{m.group(3)}.json"
            for m in SOURCE.finditer(line)}


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
    """One message per figure of ``text`` that the results files named for it do not hold (or hold only as a file
    that would hold its neighbours too), per results file or key path named that does not exist, and per marker that
    names no figure of its paragraph."""
    problems = []
    paras, sections = paragraphs(text)
    for para in paras:
        named = sorted({sources.scope(s) for s in para.sources or sections[para.section] if not sources.placeholder(s)},
                       key=str)
        scope = []
        for name in named:
            if not sources.exists(name):
                problems.append(f"{where}:{para.lines[0][0]}: names {name.file}, which does not exist")
            elif name.selector and not sources.selects(name):
                problems.append(f"{where}:{para.lines[0][0]}: names {name}, whose key path holds no number")
            else:
                scope.append(name)
        used = set()
        for (number, prose), (_, above) in zip(para.lines, [(0, "")] + para.lines):
            for fig in figures(prose, number, above):
                if fig.text in para.markers:
                    used.add(fig.text)
                    continue
                holding = [name for name in scope if sources.holds_figure(name, fig)]
                if any(sources.is_row(name) or sources.chance(name, fig) <= CHANCE_SHARE for name in holding):
                    continue
                if holding:
                    problems.append(f"{where}:{number}: \"{fig.text}\" {_by_chance(fig, holding, sources)}")
                else:
                    problems.append(f"{where}:{number}: \"{fig.text}\" "
                                    f"{_whence(fig, named, bool(para.sources), sources)}")
        for marked in sorted(set(para.markers) - used):
            problems.append(f"{where}:{para.lines[0][0]}: <!-- not measured \"{marked}\" --> names no figure of its "
                            "paragraph")
    return problems


def _by_chance(fig: Figure, holding: list[Scope], sources: Sources) -> str:
    """A figure its files hold, but as they would hold most numbers near it: say where it is, so the text names it."""
    scope = holding[0]
    share = sources.chance(scope, fig)
    places = where_held(sources, scope, fig)
    shown = ", ".join(f"#{place}" for place in places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
    return (f"is in {scope}, which would hold {share:.0%} of the numbers printed like it nearby (more than "
            f"{CHANCE_SHARE:.0%}): name the key path or row it comes from ({scope.file}{shown and ' ' + shown})")


def where_held(sources: Sources, scope: Scope, fig: Figure) -> list[str]:
    """The key paths of the scope's numbers that the figure's first end reads as."""
    found = []

    def walk(node, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            if any(abs(node - value) <= tolerance + 1e-9 for value, tolerance in fig.ends[0]):
                found.append(path)

    for part in sources._parts(scope):
        walk(part, scope.selector)
    return found


def _whence(fig: Figure, named: list[Scope], in_paragraph: bool, sources: Sources) -> str:
    """What is wrong with an untraced figure, and what to do."""
    holding = [str(name) for name in sources.all()
               if sources.holds_figure(name, fig) and sources.chance(name, fig) <= CHANCE_SHARE]
    if named:
        what = (f"is not in {', '.join(map(str, named))} (named in its "
                f"{'paragraph' if in_paragraph else 'section'})")
    else:
        what = "has no results file named in its paragraph or section"
    if not holding:
        todo = "no results file holds it where it would not hold its neighbours too: drop the number, or measure it "\
               "and save the result"
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
