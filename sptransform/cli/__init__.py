"""The ``sptransform`` command line.

Each subcommand lives in a module with ``register(subparsers)``, which adds its
parser and sets ``run`` (``args -> exit code``) as its default. To add one, add
its module to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from sptransform.cli import flops, memory, plan, schedule, verify

SUBCOMMANDS = (
    plan,
    flops,
    memory,
    schedule,
    verify,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sptransform", description="Plan and inspect tensor/sequence/pipeline-parallel training.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad input (a ``ValueError``) prints one line and exits with 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"sptransform {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
