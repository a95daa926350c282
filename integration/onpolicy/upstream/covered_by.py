"""The `Covered-By:` header of a patch: its grammar, and the check that every test it names exists.

    Covered-By: item[, item ...]
    item   = target [" (" note ")"]
    target = path | path "::" name ["::" name ...] ["[" param-id "]"]

`path` is relative to the repo root and must be a file. Each `name` after it walks into the
file's module-level classes and must end at a function that is a test (`test*`) or a nox
session (`@nox.session`), so `noxfile.py::build` is accepted. Files are parsed with `ast`,
never imported. The pytest parameter id and the note are free text, not checked; commas
inside them do not split items. A long header continues on lines indented by whitespace.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TARGET = re.compile(r"(?P<path>[^\s:\[\]()]+)(?:::(?P<names>\w+(?:::\w+)*)(?:\[[^\s\]]+\])?)?")
ITEM = re.compile(r"(?P<target>\S+)(?:\s+\((?P<note>.*)\))?", re.S)
SYNTAX = "use path, path::function or path::function[param-id], each optionally followed by (note)"


def header_value(head_lines: list[str]) -> str | None:
    """The text of the Covered-By header with its indented continuation lines, or None."""
    for i, line in enumerate(head_lines):
        if line.startswith("Covered-By:"):
            parts = [line.removeprefix("Covered-By:")]
            for more in head_lines[i + 1 :]:
                if not more[:1].isspace():
                    break
                parts.append(more)
            return " ".join(p.strip() for p in parts).strip()
    return None


def split_items(value: str) -> list[str]:
    """Items at commas outside parentheses and brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(value[start:i].strip())
            start = i + 1
    items.append(value[start:].strip())
    return items


def problems(root: Path, value: str) -> list[str]:
    """What is wrong with a Covered-By value, one message per bad item (empty when good)."""
    if not value:
        return ["Covered-By names no test"]
    out, trees = [], {}
    for item in split_items(value):
        m = ITEM.fullmatch(item)
        t = TARGET.fullmatch(m["target"]) if m else None
        if t is None:
            out.append(f"Covered-By item {item!r} is malformed; {SYNTAX}")
            continue
        missing = _missing(root, t["path"], t["names"], trees)
        if missing:
            out.append(f"Covered-By item {item!r}: {missing}")
    return out


def _missing(root: Path, rel: str, names: str | None, trees: dict) -> str | None:
    path = (root / rel).resolve()
    if Path(rel).is_absolute() or not path.is_relative_to(root.resolve()):
        return f"{rel} is not a path inside the repo"
    if path.is_dir():
        return f"{rel} is a folder, not a file"
    if not path.is_file():
        return f"file {rel} does not exist"
    if names is None:
        return None
    if rel not in trees:
        try:
            trees[rel] = ast.parse(path.read_bytes(), filename=rel)
        except (SyntaxError, ValueError) as e:
            trees[rel] = e
    tree = trees[rel]
    if isinstance(tree, Exception):
        return f"{rel} does not parse ({tree})"
    scope, where, chain = tree.body, rel, names.split("::")
    for k, name in enumerate(chain):
        kinds = (ast.ClassDef,) if k < len(chain) - 1 else (ast.FunctionDef, ast.AsyncFunctionDef)
        node = next((n for n in scope if isinstance(n, kinds) and n.name == name), None)
        if node is None:
            what = "class" if k < len(chain) - 1 else "function"
            return f"{where} defines no {what} {name}"
        scope, where = getattr(node, "body", []), f"{where}::{name}"
    if not (node.name.startswith("test") or _is_nox_session(node)):
        return f"{where} is neither a test (test*) nor a nox session"
    return None


def _is_nox_session(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("nox.session", "session"):
            return True
    return False
