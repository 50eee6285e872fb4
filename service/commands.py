"""The ``vbs`` command: one console script, one subcommand per job.

It lives at the top of the import graph (service -> workers -> planner) so that it can import
every subcommand module directly: a broken install fails here, loudly, instead of showing up
as a missing subcommand. Building the parser imports no torch (``vbs solve`` starts fast);
each command imports what it needs when it runs. Every VbsError ends the command with one
line saying what was wrong and what to do, and exit code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

from planner import cli, cli_plan, cli_solve
from service import cli as service_cli
from workers import cli_bench, cli_plan as plan_cli

# Every subcommand module, in the order of ``vbs --help``.
SUBCOMMANDS = (cli, cli_solve, plan_cli, cli_plan, cli_bench, service_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vbs", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
