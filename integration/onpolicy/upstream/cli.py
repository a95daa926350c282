"""`onpolicy upstream <cmd>` / `python -m onpolicy.upstream <cmd>`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onpolicy.upstream import tree
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import fetch, load_pin
from onpolicy.upstream.series import lint, load_series

NAMES = ("megatron-lm", "sglang")


def find_root(start: Path | None = None) -> Path:
    """The repo root: the nearest folder holding patches/ and third_party/."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "patches").is_dir() and (d / "third_party").is_dir():
            return d
    raise UpstreamError(f"no repo root (a folder with patches/ and third_party/) above {here}")


def check(root: Path, name: str) -> list[str]:
    problems = lint(load_series(root, name))
    if not problems:
        problems += [
            f"{name}/{f}: re-export differs; run apply + export and commit the result"
            for f in tree.reexport_diff(root, name)
        ]
    return problems


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="onpolicy upstream", description=__doc__)
    ap.add_argument("--root", type=Path, default=None, help="repo root (default: search upward)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, text in [
        ("fetch", "download the pinned archive into build/downloads and verify its sha256"),
        ("apply", "build build/upstream/<name>/ with one commit per patch (strict, no fuzz)"),
        ("export", "write the commits of build/upstream/<name>/ back to patches/<name>/"),
        ("check", "lint the series and verify a re-export is byte-identical"),
        ("status", "pin, patch count and state of the patched tree"),
    ]:
        p = sub.add_parser(cmd, help=text)
        p.add_argument("names", nargs="*", default=list(NAMES), help="series (default: all)")
        if cmd == "apply":
            p.add_argument(
                "--force", action="store_true", help="rebuild, discarding any unexported work"
            )
    p = sub.add_parser("rebase", help="3-way apply the series onto another pinned version")
    p.add_argument("name", help="series name, e.g. megatron-lm or sglang")
    p.add_argument("version")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        root = args.root.resolve() if args.root else find_root()
        if args.cmd == "rebase":
            dest, rows = tree.rebase(root, args.name, args.version)
            width = max(len(r.patch) for r in rows) if rows else 5
            print(f"{'patch':<{width}}  result    files")
            for r in rows:
                print(f"{r.patch:<{width}}  {r.result:<8}  {', '.join(r.files)}")
            print(f"result: {dest} (branch rebase); fix conflicts, then copy it to "
                  f"build/upstream/{args.name} and export")  # fmt: skip
            return 1 if any(r.result == "conflict" for r in rows) else 0
        failed = False
        for name in args.names:
            if args.cmd == "fetch":
                print(fetch(root, load_pin(root, name)))
            elif args.cmd == "apply":
                dest = tree.apply(root, name, force=args.force)
                n = len(load_series(root, name).patches)
                print(f"{name}: applied {n} patches -> {dest}")
            elif args.cmd == "export":
                files = tree.export(root, name)
                print(f"{name}: exported {len(files)} patches")
            elif args.cmd == "check":
                problems = check(root, name)
                for p in problems:
                    print(p, file=sys.stderr)
                failed |= bool(problems)
                print(f"{name}: {'FAILED' if problems else 'ok'}")
            elif args.cmd == "status":
                print(tree.status(root, name))
        return 1 if failed else 0
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
