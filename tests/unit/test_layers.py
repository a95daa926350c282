"""The package's layering: no module imports from a layer above its own, and no import cycles
(imports inside functions count too: a lazy import is still a dependency).

    kernels < models, contract < collectives < train, rollout < checkpoint < weights
            < parity, grpo < cli, bench

The root helpers (bits, fsutil, layout, rendezvous, segments, capture, compare) sit with
kernels at the bottom: they import nothing above it. `upstream` (the patch-series tool) stands
alone: it imports nothing else of the package, and only the CLI imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import onpolicy

ROOT = Path(onpolicy.__file__).parent

LAYER = {
    "kernels": 0, "bits": 0, "fsutil": 0, "layout": 0, "rendezvous": 0, "segments": 0,
    "capture": 0, "compare": 0, "upstream": 0,
    "models": 1, "contract": 1,
    "collectives": 2,
    "train": 3, "rollout": 3,
    "checkpoint": 4,
    "weights": 5,
    "parity": 6, "grpo": 6,
    "cli": 7, "bench": 7, "__init__": 0,
}  # fmt: skip
"""Each top-level module or package of onpolicy, by layer (0 lowest)."""


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, name: str, mods: dict[str, Path]) -> set[str]:
    """onpolicy modules `path` imports anywhere in its body, resolved to files."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] or [base]
        else:
            continue
        for t in targets:
            if t.startswith("onpolicy"):
                r = _resolve(t, mods)
                if r and r != name:
                    found.add(r)
    return found


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, name, mods) for name, path in mods.items()}


def test_every_top_level_module_has_a_layer():
    assert {_top(n) for n in _graph()} <= set(LAYER), set(map(_top, _graph())) - set(LAYER)


def test_no_import_from_a_layer_above():
    bad = [f"{a} (layer {LAYER[_top(a)]}) imports {b} (layer {LAYER[_top(b)]})"
           for a, deps in _graph().items() for b in deps
           if LAYER[_top(b)] > LAYER[_top(a)]]  # fmt: skip
    assert not bad, "\n".join(sorted(bad))


def test_upstream_tool_stands_alone():
    bad = [f"{a} imports {b}" for a, deps in _graph().items() for b in deps
           if (_top(a) == "upstream") != (_top(b) == "upstream")
           and not (a == "onpolicy.cli" and _top(b) == "upstream")]  # fmt: skip
    assert not bad, "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_checks_can_fail():
    """A planted upward import and a planted cycle are found."""
    g = {"onpolicy.kernels.x": {"onpolicy.grpo.y"}, "onpolicy.grpo.y": {"onpolicy.kernels.x"}}
    assert _cycles(g) == [["onpolicy.grpo.y", "onpolicy.kernels.x"]]
    assert LAYER[_top("onpolicy.grpo.y")] > LAYER[_top("onpolicy.kernels.x")]
