"""The `onpolicy` command. Subcommands: `upstream` (the patch-series tool), `validate` (the
contract check of a run config, printing the resolved plan), `parity` (SGLang samples, Megatron
scores the same tokens; prints equal / compared log-probs per layout pair), `convert` (HF <->
Megatron torch-dist checkpoints, and resharding between layouts), `e2e` (the GRPO run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

USAGE = (
    "usage: onpolicy upstream {fetch,apply,export,check,rebase,status} ...\n"
    "       onpolicy validate --config FILE [--set KEY=VALUE ...] [--json]\n"
    "       onpolicy parity --config FILE [--set KEY=VALUE ...] [--pairs ROLLOUT:TRAINING ...]\n"
    "       onpolicy convert hf-to-dist --hf DIR --config FILE [--set KEY=VALUE ...] --out ROOT\n"
    "                        [--iteration N]\n"
    "       onpolicy convert dist-to-hf --ckpt ROOT_OR_ITER --out DIR\n"
    "       onpolicy convert reshard --ckpt ROOT_OR_ITER --config FILE [--set KEY=VALUE ...]\n"
    "                        --out ROOT [--iteration N] [--model-only]\n"
    "       onpolicy e2e --config FILE [--set SECTION.KEY=VALUE ...] [--steps N] [--out DIR]\n"
    "                    [--address RAY_ADDRESS] [--resume] [--bisect]"
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
        parse_override,
        plan_dict,
        resolve_plan,
    )
    from onpolicy.grpo.config import load_e2e_config

    try:
        overrides = dict(parse_override(item) for item in args.set)
        # The whole file, loop tables included, checked exactly as `onpolicy e2e` checks it.
        cfg = load_e2e_config(args.config, overrides).cfg
        plan = resolve_plan(cfg)
    except ContractError as e:
        print(f"onpolicy validate: {args.config}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_plan(cfg, plan))
    return 0


def parity_main(argv: list[str]) -> int:
    """Exit 0 when every pair is bitwise equal, 1 on a mismatch, 2 for a refused config or
    pair, 3 when a rollout or trainer process died (the other pairs' table is still printed)."""
    ap = argparse.ArgumentParser(
        prog="onpolicy parity",
        description="SGLang samples, Megatron scores the same tokens from the same checkpoint; "
        "every generated token's two log-probs must have the same bits.",
    )
    ap.add_argument("--config", required=True, help="TOML run config, e.g. configs/tiny-cpu.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (TOML value); wins over the file")  # fmt: skip
    ap.add_argument("--pairs", nargs="+", metavar="ROLLOUT:TRAINING",
                    help="layout pairs, e.g. tp2-ep2:world8-tp2-pp2-ep2-sp tp1:tp2-sp "
                    "(rollout: tp, ep, stock = SGLang's stock path, the negative control; "
                    "training: world, tp, pp, ep, etp, sp); default: the "
                    "config's rollout and training layouts")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    ap.add_argument("--prompt-lengths", type=int, nargs="+", metavar="N",
                    help="each prompt's length (in place of --prompts)")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--row-digests", action="store_true",
                    help="also compare each position's whole log-prob row, by digest")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    ap.add_argument("--workdir", default="runs/parity", help="checkpoint, rollouts, logs")
    args = ap.parse_args(argv)
    from onpolicy.compare import format_table
    from onpolicy.contract import ContractError, load_config, parse_override
    from onpolicy.parity import ParityRun, WorkerError, config_pair, parse_pair, run_pairs

    try:
        overrides = dict(parse_override(item) for item in args.set)
        lengths = tuple(args.prompt_lengths or ())
        if (args.prompts < 1 or args.new_tokens < 1 or not args.temperature > 0
                or any(n < 1 for n in lengths)):  # fmt: skip
            raise ContractError(
                "parity_sampling",
                f"--prompts {args.prompts}, --new-tokens {args.new_tokens}, --temperature "
                f"{args.temperature}, --prompt-lengths {list(lengths)}: each must be positive",
                "pass at least one prompt and one new token, and a temperature above 0",
            )
        pairs = [parse_pair(s) for s in args.pairs or []]
        pairs = pairs or [config_pair(load_config(args.config, overrides))]
        run = ParityRun(config=args.config, overrides=overrides, workdir=Path(args.workdir),
                        prompts=args.prompts, new_tokens=args.new_tokens,
                        temperature=args.temperature, seed=args.seed,
                        prompt_lengths=lengths or None,
                        row_digests=args.row_digests)  # fmt: skip
        results = run_pairs(run, pairs, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ContractError as e:
        print(f"onpolicy parity: {args.config}: {e}", file=sys.stderr)
        return 2
    done = [r for r in results if not isinstance(r, WorkerError)]
    if done:  # the pairs whose processes ran, even where another pair's died
        print(format_table(done))
    for p, r in zip(pairs, results, strict=True):
        if isinstance(r, WorkerError):
            print(f"onpolicy parity: {p.name}: {r}", file=sys.stderr)
    if len(done) < len(results):
        return 3
    return 0 if all(r.ok for r in done) else 1


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
    if argv[0] == "parity":
        return parity_main(argv[1:])
    if argv[0] == "convert":
        from onpolicy.checkpoint.convert import main as convert_main

        return convert_main(argv[1:])
    if argv[0] == "e2e":
        from onpolicy.grpo.e2e import main as e2e_main

        return e2e_main(argv[1:])
    print(f"onpolicy: unknown command {argv[0]!r} (known: upstream, validate, parity, convert, "
          "e2e)", file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(main())
