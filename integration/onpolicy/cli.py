"""The `onpolicy` command. Subcommands: `upstream` (the patch-series tool), `validate` (the
contract check of a run config, printing the resolved plan)."""

from __future__ import annotations

import argparse
import json
import sys

USAGE = (
    "usage: onpolicy upstream {fetch,apply,export,check,rebase,status} ...\n"
    "       onpolicy validate --config FILE [--set KEY=VALUE ...] [--json]"
)


def validate_main(argv: list[str]) -> int:
    """Print the resolved plan of a valid config; exit 2 with the failing rule otherwise."""
    ap = argparse.ArgumentParser(
        prog="onpolicy validate",
        description="Check a run config against qwen3_moe_true_on_policy_v1 and print the plan.",
    )
    ap.add_argument("--config", required=True, help="TOML run config, e.g. configs/tiny-cpu.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (TOML value), e.g. --set training.tp=4 or "
                    "--set model.hf_path=/data/Qwen3-30B-A3B; wins over the file")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    from onpolicy.contract import (
        ContractError,
        format_plan,
        load_config,
        parse_override,
        plan_dict,
        resolve_plan,
    )

    try:
        overrides = dict(parse_override(item) for item in args.set)
        cfg = load_config(args.config, overrides)
        plan = resolve_plan(cfg)
    except ContractError as e:
        print(f"onpolicy validate: {args.config}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_plan(cfg, plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "upstream":
        from onpolicy.upstream.cli import main as upstream_main

        return upstream_main(argv[1:])
    if argv[0] == "validate":
        return validate_main(argv[1:])
    print(f"onpolicy: unknown command {argv[0]!r} (known: upstream, validate)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
