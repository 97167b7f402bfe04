"""The package's import graph, measured from the source: modules, lines, layers, cycles and imports that run up.

Each top-level part of ``tlt_trainers`` belongs to one layer of ``LAYERS`` (lowest first); a module may import its
own layer and the layers below it. An import from a lower layer to a higher one runs up; a set of modules that
import each other (directly or around a loop, imports inside functions included) is a cycle. Both are reported,
and ``tests/test_layering.py`` keeps them at zero.

    python scripts/import_graph.py            # a summary table and every cycle and upward import
    python scripts/import_graph.py --json     # the same as JSON
    python scripts/import_graph.py --root DIR # another checkout (to compare with an earlier commit)
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

PACKAGE = "tlt_trainers"

# Lowest first. A part is a top-level module or subpackage of tlt_trainers ("" is the package root).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("metric_names", "sampling", "modeling"),
    ("kernels",),
    ("drafter",),
    ("proposers", "shipped"),
    ("config", "pretrained", "kinds", "adaptive"),
    ("rollout",),
    ("warmup", "online"),
    ("settings", "vllm"),
    ("trl", "verl", "cli", ""),
)


def layer_of(part: str) -> int:
    for index, parts in enumerate(LAYERS):
        if part in parts:
            return index
    raise KeyError(f"{PACKAGE}.{part} is in no layer: add it to LAYERS in {__file__}")


def part_of(module: str) -> str:
    names = module.split(".")
    return names[1] if len(names) > 1 else ""


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, bool]:
    """Modules of the package that ``name`` imports -> whether every import of it sits inside a function.

    Imports under ``if TYPE_CHECKING:`` are left out: they name types for checkers and never run."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    found: dict[str, bool] = {}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # the submodules it names, else the module it names them from
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            targets = submodules or [target]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found[target] = found.get(target, True) and id(node) in lazy_nodes
    return found


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def measure(root: pathlib.Path) -> dict:
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    upward = [{"from": a, "to": b, "lazy": lazy} for a, targets in sorted(graph.items())
              for b, lazy in sorted(targets.items()) if layer_of(part_of(a)) < layer_of(part_of(b))]
    lines = {name: len(path.read_text().splitlines()) for name, path in known.items()}
    per_layer = []
    for index, parts in enumerate(LAYERS):
        members = [m for m in known if layer_of(part_of(m)) == index]
        present = [part or "(root)" for part in parts if any(part_of(m) == part for m in members)]
        per_layer.append({"layer": index + 1, "parts": present, "modules": len(members),
                          "lines": sum(lines[m] for m in members)})
    return {"root": str(root), "modules": len(known), "lines": sum(lines.values()),
            "imports": sum(len(t) for t in graph.values()),
            "lazy_imports": sum(lazy for t in graph.values() for lazy in t.values()),
            "layers": per_layer, "cycles": cycles(graph), "upward": upward,
            "largest": sorted(((lines[m], m) for m in known), reverse=True)[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = measure(args.root)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"| modules | lines | imports (inside functions) | cycles | upward imports |\n|---|---|---|---|---|\n"
          f"| {report['modules']} | {report['lines']} | {report['imports']} ({report['lazy_imports']}) | "
          f"{len(report['cycles'])} | {len(report['upward'])} |\n")
    print("| layer | parts | modules | lines |\n|---|---|---|---|")
    for layer in report["layers"]:
        print(f"| {layer['layer']} | {', '.join(layer['parts'])} | {layer['modules']} | {layer['lines']} |")
    for cycle in report["cycles"]:
        print("cycle:", " <-> ".join(cycle))
    for arrow in report["upward"]:
        print(f"upward: {arrow['from']} -> {arrow['to']}" + (" (inside a function)" if arrow["lazy"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
