"""The ``gpusched`` command line: parse, resolve options, call the session, map exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from gpusched import session
from gpusched.options import (
    PLAN_OPTIONS,
    UsageError,
    add_options,
    find_pyproject,
    load_table,
    resolve,
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting 2, so a usage error exits 4 like pytest's."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpusched", description="GPU-aware scheduling of pytest suites")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="collect, pack onto cards, run, report",
        usage="gpusched run [PATHS] [options] [-- PYTEST ARGS]",
    )
    run.add_argument("paths", nargs="*", help="files or directories (default: pytest's testpaths)")
    add_options(run)
    plan = sub.add_parser("plan", help="dry run: requirements and predicted schedule")
    plan.add_argument("paths", nargs="*")
    add_options(plan, PLAN_OPTIONS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, pytest_args = args[:split], args[split + 1 :]
    try:
        namespace = build_parser().parse_args(args)
        pyproject = find_pyproject(Path.cwd())
        names = PLAN_OPTIONS if namespace.command == "plan" else None
        settings = resolve(
            vars(namespace),
            os.environ,
            load_table(pyproject),
            names,
            str(pyproject) if pyproject else "pyproject.toml",
        )
        if namespace.command == "plan":
            return session.plan(namespace.paths, settings, pytest_args)
        return session.run(namespace.paths, settings, pytest_args)
    except UsageError as exc:
        print(f"gpusched: error: {exc}", file=sys.stderr)
        return session.EXIT_USAGE
    except KeyboardInterrupt:
        print("gpusched: interrupted", file=sys.stderr)
        return session.EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print("gpusched: internal error", file=sys.stderr)
        return session.EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
