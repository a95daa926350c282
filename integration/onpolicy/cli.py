"""The `onpolicy` command. Subcommands: `upstream` (the patch-series tool)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: onpolicy upstream {fetch,apply,export,check,rebase,status} ...")
        return 0 if argv else 2
    if argv[0] == "upstream":
        from onpolicy.upstream.cli import main as upstream_main

        return upstream_main(argv[1:])
    print(f"onpolicy: unknown command {argv[0]!r} (known: upstream)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
