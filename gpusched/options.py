"""The options of ``gpusched run`` and ``plan``: one table, three sources, one resolver.

Each option's help is written once, in ``OPTIONS``, and serves the command
line, the ``[tool.gpusched]`` key of ``pyproject.toml`` and the ``GPUSCHED_*``
variable. Precedence: command line > environment > pyproject > default. A
malformed value is a usage error that names where it came from, never a silent
default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from gpusched.execution.release import DEFAULT_RELEASE_MEMORY, DEFAULT_RELEASE_TIMEOUT
from gpusched.requirements import RequirementError, parse_memory


class UsageError(Exception):
    """Bad input from the user: gpusched exits with code 4 and this message."""


def check_paths(paths: Sequence[str]) -> None:
    """Every path given on the command line exists (``file::test`` names its file)."""
    for path in paths:
        if not os.path.exists(path.split("::")[0]):
            raise UsageError(f"path {path!r} does not exist")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be a number of seconds >= 0")
    return value


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except RequirementError as exc:
        raise ValueError(str(exc)) from None


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _card_list(text: str) -> tuple[str, ...]:
    cards = tuple(part.strip() for part in text.split(",") if part.strip())
    if not cards:
        raise ValueError("names no card (expected e.g. 0,1,3)")
    return cards


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("is not a boolean (use 1/0, true/false)")


def _text(text: str) -> str:
    return text


def _on_off(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("on", "1", "true", "yes"):
        return True
    if lowered in ("off", "0", "false", "no"):
        return False
    raise ValueError("must be on or off")


def _durations_file(text: str) -> str:
    """A readable durations file in the history's format (``--durations-seed``)."""
    from gpusched.history import HistoryError, parse_history

    try:
        parse_history(Path(text).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot be read ({exc})") from None
    except HistoryError as exc:
        raise ValueError(f"is not a durations file ({exc})") from None
    return text


def _module_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        module, colon, attribute = name.partition(":")
        dotted = all(piece.isidentifier() for piece in module.split("."))
        if not dotted or (colon and not attribute.isidentifier()):
            raise ValueError(f"names {name!r}, which is not a module name (or module:name)")
    return names


def _address(text: str) -> str:
    address = text.strip()
    if not address:
        raise ValueError("names no Ray cluster (expected auto or HOST:PORT)")
    return address


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class Option:
    """One option: ``name`` is the attribute, the TOML key and (upper-cased) the variable suffix."""

    name: str
    flags: tuple[str, ...]
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    flag: bool = False  # a switch on the command line; "1"/"0" elsewhere
    path: bool = False  # a file: relative to pyproject.toml's folder when set there

    @property
    def env(self) -> str:
        return "GPUSCHED_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("gpus", ("--gpus",), _card_list, None, "use only these cards, e.g. 0,1,3", "IDS"),
    Option(
        "simulate_gpus",
        ("--simulate-gpus",),
        _text,
        None,
        "fake cards for machines without GPUs: N or N:80GB,80GB,40GB "
        "(children still get CUDA_VISIBLE_DEVICES; nothing touches a driver)",
        "SPEC",
    ),
    Option("timeout", ("--timeout",), _positive_float, None, "kill a file after S seconds", "S"),
    Option(
        "collect_timeout",
        ("--collect-timeout",),
        _positive_float,
        300.0,
        "give up collection after S seconds",
        "S",
    ),
    Option(
        "cpu_slots",
        ("--cpu-slots",),
        _positive_int,
        os.cpu_count() or 1,
        "a node's CPU budget in cores: files, GPU files too, run at once while the CPU "
        "use the history measured for them fits in N (default: the number of cores)",
        "N",
    ),
    Option(
        "kill_grace",
        ("--kill-grace",),
        _positive_float,
        5.0,
        "seconds between SIGTERM and SIGKILL when a file is killed",
        "S",
    ),
    Option(
        "per_test_timeout",
        ("--per-test-timeout",),
        _positive_float,
        None,
        "pytest-timeout limit for each test inside a file (a stack dump, the file goes on)",
        "S",
    ),
    Option(
        "heartbeat",
        ("--heartbeat",),
        _positive_float,
        None,
        "every S seconds, print one line naming each running file and its elapsed time",
        "S",
    ),
    Option(
        "prestart",
        ("--prestart",),
        _non_negative_int,
        4,
        "start up to N GPU files' pytest processes before their cards are free, so "
        "interpreter start-up and plugin imports overlap the files still running "
        "(no conftest or test module loads before the cards are assigned); only when "
        "files start as fresh processes (--fork-server off or its fallback); 0: off",
        "N",
    ),
    Option(
        "fork_server",
        ("--fork-server",),
        _on_off,
        True,
        "on: one process per run imports pytest, its plugins and the preload modules once "
        "and forks each file's process from that clean state (never initialising CUDA); "
        "off: each file starts a fresh python -m pytest (also the fallback where fork is "
        "unsafe); default on",
        "on|off",
    ),
    Option(
        "collect_cache",
        ("--collect-cache",),
        _on_off,
        True,
        "on: the collection does not import files that did not change since the last run "
        "(nor their conftests, ini or selection arguments) and takes what it found then "
        "from .gpusched/collection.json; each such file's own process checks the "
        "prediction and is queued again if its requirement changed; default on",
        "on|off",
    ),
    Option(
        "durations_seed",
        ("--durations-seed",),
        _durations_file,
        None,
        "a durations file in the format of .gpusched/durations.json (e.g. one committed "
        "to the repository) for the files this machine's history does not know, so a "
        "first run or a CI job without a cache packs the longest files first; read, "
        "never written; relative to the current directory (in [tool.gpusched]: to "
        "pyproject.toml's folder)",
        "PATH",
        path=True,
    ),
    Option(
        "preload",
        ("--preload",),
        _module_list,
        (),
        "modules the fork server imports once for every file, e.g. torch,transformers "
        "(module:name imports as from module import name); added to what the suite's "
        "conftest.py files and at least two of its test files import from installed "
        "packages, found automatically; a TOML list in [tool.gpusched]",
        "MODULES",
    ),
    Option(
        "gpu_release_timeout",
        ("--gpu-release-timeout",),
        _non_negative_float,
        DEFAULT_RELEASE_TIMEOUT,
        "after a file ends, wait up to S seconds for NVML to show its cards free "
        "(no process of the file, memory under --gpu-release-memory); "
        "a card still busy is quarantined for the rest of the run",
        "S",
    ),
    Option(
        "gpu_release_memory",
        ("--gpu-release-memory",),
        _memory,
        DEFAULT_RELEASE_MEMORY,
        "a released card must have less than this in use, e.g. 512MB (default 1GiB)",
        "SIZE",
    ),
    Option("reruns", ("--reruns",), _non_negative_int, 0, "rerun a failed file up to N times", "N"),
    Option(
        "exitfirst",
        ("-x", "--exitfirst"),
        _bool,
        False,
        "start no new file after one fails",
        flag=True,
    ),
    Option("markexpr", ("-m",), _text, None, "only tests matching this mark expression", "EXPR"),
    Option("keyword", ("-k",), _text, None, "only tests matching this keyword expression", "EXPR"),
    Option("junitxml", ("--junitxml",), _text, None, "write a merged JUnit XML report", "PATH"),
    Option("json", ("--json",), _text, None, "write a JSON report", "PATH"),
    Option(
        "timeline",
        ("--timeline",),
        _text,
        None,
        "write a self-contained HTML Gantt chart of cards over time",
        "PATH",
    ),
    Option(
        "ray",
        ("--ray",),
        _address,
        None,
        "pack the files across the nodes of this Ray cluster (auto: RAY_ADDRESS, or the "
        "cluster running on this machine); each node offers its own cards and runs its "
        "files as gpusched does on one machine",
        "ADDRESS",
    ),
    Option(
        "ray_shared",
        ("--ray-shared",),
        _text,
        None,
        "with --ray: the suite's root directory as every node sees it (a shared "
        "filesystem); without it the root directory is shipped to the nodes with Ray's "
        "runtime_env working_dir",
        "DIR",
    ),
    Option(
        "ray_excludes",
        ("--ray-excludes",),
        _patterns,
        (),
        "with --ray: gitignore-style patterns left out of what is shipped to the nodes, "
        "e.g. data/,*.ckpt (besides .gitignore'd files, .git and .gpusched); a TOML list "
        "in [tool.gpusched]",
        "PATTERNS",
    ),
)

PLAN_OPTIONS = frozenset(
    {
        "gpus", "simulate_gpus", "collect_timeout", "cpu_slots", "markexpr", "keyword", "ray",
        "durations_seed",
    }
)  # fmt: skip


def add_options(parser: argparse.ArgumentParser, names: frozenset[str] | None = None) -> None:
    """Add the options (all, or those in ``names``) to an argparse parser, parsed later by ``resolve``."""
    group = parser.add_argument_group(
        "options (also [tool.gpusched] keys and GPUSCHED_* variables)"
    )
    for option in OPTIONS:
        if names is not None and option.name not in names:
            continue
        text = f"{option.help} [{option.env}]"
        if option.flag:
            group.add_argument(
                *option.flags, dest=option.name, action="store_const", const="1", help=text
            )
        else:
            group.add_argument(*option.flags, dest=option.name, metavar=option.metavar, help=text)


def find_pyproject(start: Path) -> Path | None:
    for directory in [start, *start.parents]:
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_table(pyproject: Path | None) -> dict[str, Any]:
    """``[tool.gpusched]`` without its ``gpus`` globs (the plugin reads those)."""
    if pyproject is None:
        return {}
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{pyproject}: {exc}") from None
    table = dict(data.get("tool", {}).get("gpusched", {}))
    table.pop("gpus", None)
    return table


def resolve(
    cli: Mapping[str, str | None],
    env: Mapping[str, str],
    table: Mapping[str, Any],
    names: frozenset[str] | None = None,
    table_source: str = "pyproject.toml",
) -> dict[str, Any]:
    """Each option's value from the first source that sets it; bad values name their source."""
    options = [option for option in OPTIONS if names is None or option.name in names]
    known = {option.name for option in OPTIONS}
    unknown = sorted(set(table) - known - {"gpus"})
    if unknown:
        raise UsageError(f"[tool.gpusched] in {table_source}: unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for option in options:
        candidates = (
            (cli.get(option.name), "/".join(option.flags)),
            (env.get(option.env), option.env),
            (table.get(option.name), f"[tool.gpusched] {option.name} in {table_source}"),
        )
        for raw, source in candidates:
            if raw is None or (source == option.env and raw == ""):
                continue
            if isinstance(raw, bool):
                text = str(raw).lower()
            elif isinstance(raw, list):
                text = ",".join(str(item) for item in raw)
            else:
                text = str(raw)
            if option.path and source.startswith("[tool.gpusched]"):
                text = str(Path(table_source).parent / text)  # an absolute text stays as it is
            try:
                values[option.name] = option.parse(text)
            except ValueError as exc:
                detail = (
                    str(exc)
                    if "invalid literal" not in str(exc) and "could not convert" not in str(exc)
                    else "is not a number"
                )
                raise UsageError(f"{source}: {raw!r} {detail}") from None
            break
        else:
            values[option.name] = option.default
    return values
