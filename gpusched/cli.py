"""The ``gpusched`` command line: parse, resolve options, call the session, map exit codes.

``run`` and ``plan`` go to the session; ``shard`` and ``matrix`` collect the
suite, read the duration history and ask the pure ``gpusched.scheduling.shard`` which
files each CI runner gets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from gpusched import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, STATE_DIR, __version__
from gpusched.collection.collect import CollectionFailed
from gpusched.execution.forkclient import EarlyServer, start_early_server
from gpusched.options import (
    PLAN_OPTIONS,
    UsageError,
    add_options,
    check_paths,
    find_pyproject,
    load_table,
    resolve,
)
from gpusched.scheduling.shard import (
    ShardError,
    SuiteFile,
    matrix,
    oversized,
    parse_sizes,
    runner_classes,
    select,
    suite_sizes,
)

SHARD_HELP = {
    "gpus_per_runner": "cards on this runner: it runs the files of the runner class of that size",
    "shards": "split each runner class into K shards balanced by the duration history",
    "index": "which shard this runner runs, 0 to K-1",
    "runner_sizes": "card counts of the CI runners, e.g. 0,1,2,8 (default: the GPU counts "
    "found in the suite); a runner with N cards runs files needing more than the next "
    "smaller size, up to N",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting 2, so a usage error exits 4 like pytest's.

    The message carries no prefix: ``main`` prints every usage error once, as
    ``gpusched: error: <message>``; the hint names the (sub)command's help.
    """

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message}; see '{self.prog} --help'")


def version_line() -> str:
    """What ``gpusched --version`` prints: the installed distribution's version."""
    return f"gpusched {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpusched", description="GPU-aware scheduling of pytest suites")
    parser.add_argument("--version", action="version", version=version_line())
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
    shard = sub.add_parser(
        "shard",
        help="CI: the files for one runner with N cards (printed, or run with --run)",
        usage="gpusched shard [PATHS] --gpus-per-runner N [--shards K --index I] [--run] "
        "[options] [-- PYTEST ARGS]",
    )
    shard.add_argument(
        "paths", nargs="*", help="files or directories (default: pytest's testpaths)"
    )
    shard.add_argument(
        "--gpus-per-runner",
        type=int,
        required=True,
        metavar="N",
        help=SHARD_HELP["gpus_per_runner"],
    )
    shard.add_argument("--shards", type=int, default=1, metavar="K", help=SHARD_HELP["shards"])
    shard.add_argument("--index", type=int, default=0, metavar="I", help=SHARD_HELP["index"])
    shard.add_argument("--runner-sizes", metavar="SIZES", help=SHARD_HELP["runner_sizes"])
    shard.add_argument("--run", action="store_true", help="run the shard's files (gpusched run)")
    add_options(shard)
    mat = sub.add_parser(
        "matrix", help="CI: a JSON job matrix, one entry per runner class and shard"
    )
    mat.add_argument("paths", nargs="*", help="files or directories (default: pytest's testpaths)")
    mat.add_argument(
        "--shards", type=int, default=1, metavar="K", help="at most K shards per runner class"
    )
    mat.add_argument("--runner-sizes", metavar="SIZES", help=SHARD_HELP["runner_sizes"])
    add_options(mat, PLAN_OPTIONS)
    return parser


def suite_files(
    paths: Sequence[str], settings: dict, pytest_args: Sequence[str]
) -> dict[str, SuiteFile]:
    """Every file of the suite by absolute path, with its requirement and expected seconds.

    Files that failed collection or were skipped whole count as CPU files, so
    they still land in a shard and are reported there.
    """
    from gpusched import session
    from gpusched.history import HISTORY_FILE, expected_durations, history_key, load_durations

    prepared = session.prepare(paths, settings, pytest_args)
    rootdir = prepared.collection.rootdir
    files = {
        job.path: SuiteFile(history_key(job.path, rootdir), job.gpus, job.expected)
        for job in prepared.jobs
    }
    others = [e.path for e in [*prepared.collection.errors, *prepared.collection.skipped]]
    others = [path for path in dict.fromkeys(others) if path not in files]
    if others:
        history, _ = load_durations(STATE_DIR / HISTORY_FILE, settings["durations_seed"])
        keys = [history_key(path, rootdir) for path in others]
        expected = expected_durations(history, keys)
        files.update(
            {path: SuiteFile(key, 0, expected[key]) for path, key in zip(others, keys, strict=True)}
        )
    for warning in prepared.warnings:
        print(f"gpusched: warning: {warning}", file=sys.stderr)
    return files


def _classes(files: dict[str, SuiteFile], sizes_text: str | None):
    sizes = parse_sizes(sizes_text) if sizes_text is not None else suite_sizes(files.values())
    classes = runner_classes(sizes)
    big = oversized(files.values(), classes)
    if big:
        print(
            f"gpusched: warning: {len(big)} file(s) need more than {classes[-1].gpus} cards, "
            f"the largest runner size; they go to the {classes[-1].name} runners, whose "
            f"gpusched skips the tests that need more cards than it has: {', '.join(f.key for f in big)}",
            file=sys.stderr,
        )
    return sizes, classes


def shard_command(namespace: argparse.Namespace, settings: dict, pytest_args: list[str]) -> int:
    """``gpusched shard``: print this runner's files, or run them with ``--run``."""
    from gpusched.reporting.report import display_path

    files = suite_files(namespace.paths, settings, pytest_args)
    _, classes = _classes(files, namespace.runner_sizes)
    chosen = select(
        list(files.values()), classes, namespace.gpus_per_runner, namespace.shards, namespace.index
    )
    by_key = {file.key: path for path, file in files.items()}
    paths = [by_key[file.key] for file in chosen]
    if not namespace.run:
        for path in paths:
            print(display_path(path))
        return EXIT_OK
    if not paths:
        print(
            f"gpusched: shard {namespace.index} of {namespace.shards} for "
            f"{namespace.gpus_per_runner}-card runners has no files"
        )
        return EXIT_OK
    return session_for(settings).run(paths, settings, pytest_args)


def session_for(settings: dict) -> ModuleType:
    """The session that runs these settings: across a Ray cluster (the only path that
    imports Ray) or on this node's cards."""
    if settings.get("ray"):
        from gpusched import cluster_session

        return cluster_session
    from gpusched import session

    return session


def matrix_command(namespace: argparse.Namespace, settings: dict, pytest_args: list[str]) -> int:
    """``gpusched matrix``: one JSON line for a GitHub Actions ``strategy.matrix``."""
    files = suite_files(namespace.paths, settings, pytest_args)
    sizes, classes = _classes(files, namespace.runner_sizes)
    entries = matrix(list(files.values()), classes, namespace.shards)
    print(json.dumps({"include": [entry.to_json(sizes) for entry in entries]}))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    early: EarlyServer | None = None
    if "--" in args:
        split = args.index("--")
        args, pytest_args = args[:split], args[split + 1 :]
    try:
        namespace = build_parser().parse_args(args)
        pyproject = find_pyproject(Path.cwd())
        names = PLAN_OPTIONS if namespace.command in ("plan", "matrix") else None
        settings = resolve(
            vars(namespace),
            os.environ,
            load_table(pyproject),
            names,
            str(pyproject) if pyproject else "pyproject.toml",
        )
        if namespace.command == "run":
            check_paths(namespace.paths)  # a typo is an error at once, not after the server starts
            early = start_early_server(namespace.paths, settings, STATE_DIR / "logs")
        if namespace.command == "plan":
            return session_for(settings).plan(namespace.paths, settings, pytest_args)
        if namespace.command == "shard":
            return shard_command(namespace, settings, pytest_args)
        if namespace.command == "matrix":
            return matrix_command(namespace, settings, pytest_args)
        return session_for(settings).run(namespace.paths, settings, pytest_args, early=early)
    except (UsageError, ShardError) as exc:
        print(f"gpusched: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CollectionFailed as exc:  # shard and matrix collect here; run and plan report their own
        kind = "error: " if exc.exit_code == EXIT_USAGE else ""
        print(f"gpusched: {kind}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("gpusched: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print("gpusched: internal error", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if early is not None:
            early.discard()  # the run ended before the session took it over


if __name__ == "__main__":
    sys.exit(main())
