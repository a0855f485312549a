"""The ``sptransform`` command line.

Each subcommand lives in a module with ``register(subparsers)``, which adds its
parser and sets ``run`` (``args -> exit code``) as its default. To add one, add
its module to ``SUBCOMMANDS``. Argument types and limits shared by the
subcommands are in ``sptransform.cli.args``.

Every bad call (an argparse error such as an unknown flag or a value its type
refuses, or a ``ValueError`` raised by ``run``) prints one
``sptransform <command>: error: ...`` line on stderr and returns 2;
``main`` returns instead of raising ``SystemExit`` (``--help`` returns 0).
"""

from __future__ import annotations

import sys

from sptransform.cli import flops, memory, plan, schedule, verify
from sptransform.cli.args import CliParser, UsageError, one_line

SUBCOMMANDS = (
    plan,
    flops,
    memory,
    schedule,
    verify,
)


def build_parser() -> CliParser:
    parser = CliParser(
        prog="sptransform", description="Plan and inspect tensor/sequence/pipeline-parallel training.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def _error(prog: str, message: str) -> int:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit code; bad input prints one line and returns 2."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            prog = f"{parser.prog} {args.command}"
            raise UsageError(prog, f"unrecognized arguments: {' '.join(extra)} (see {prog} --help)")
    except UsageError as error:
        return _error(error.prog, error.message)
    except SystemExit as stop:  # --help printed its text
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 2
    try:
        return args.run(args)
    except ValueError as error:
        return _error(f"{parser.prog} {args.command}", str(error))


if __name__ == "__main__":
    sys.exit(main())
