"""Whether a run measures coverage: pytest-cov's switches as every file's pytest will read them.

Decided once, before any file starts (early starts go before collection), from
the same three places pytest reads options from, in pytest's order: the ini
file's ``addopts``, ``PYTEST_ADDOPTS``, then the arguments after ``--``.
"""

from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpusched.options import UsageError

PLUGIN_NAMES = ("cov", "pytest_cov", "pytest_cov.plugin")
"""What ``-p no:NAME`` may call pytest-cov's plugin."""


def measures(tokens: Sequence[str]) -> bool:
    """Whether pytest-cov, given these arguments, starts measuring (pure).

    ``--cov`` in any form turns it on, ``--cov-reset`` drops the sources given so
    far, ``--no-cov`` and ``-p no:cov`` turn it off whatever comes after.
    """
    sources = disabled = False
    previous = ""
    for token in tokens:
        if token == "--cov" or token.startswith("--cov="):
            sources = True
        elif token == "--cov-reset":
            sources = False
        elif token == "--no-cov":
            disabled = True
        elif _blocks_plugin(previous, token):
            disabled = True
        previous = token
    return sources and not disabled


def _blocks_plugin(previous: str, token: str) -> bool:
    if previous == "-p":
        name = token
    elif token.startswith("-p") and len(token) > 2:
        name = token[2:]
    else:
        return False
    return name.startswith("no:") and name[3:] in PLUGIN_NAMES


def option_value(tokens: Sequence[str], *names: str) -> str | None:
    """The last value given to one of ``names`` (``-c X``, ``--config-file=X``), or None (pure)."""
    value = None
    for at, token in enumerate(tokens):
        for name in names:
            if token == name and at + 1 < len(tokens):
                value = tokens[at + 1]
            elif name.startswith("--") and token.startswith(name + "="):
                value = token[len(name) + 1 :]
    return value


def ini_addopts(paths: Sequence[str], args: Sequence[str], cwd: Path) -> list[str]:
    """The ``addopts`` of the ini file pytest will use for ``paths``; [] where none is found.

    Located with pytest's own search (``-c``, ``--rootdir`` and the paths
    considered), so the file is the one the children read.
    """
    try:
        from _pytest.config.findpaths import determine_setup

        _, _, ini, _ = determine_setup(
            inifile=_under(cwd, option_value(args, "-c", "--config-file")),
            override_ini=None,
            args=[str(cwd / path.split("::")[0]) for path in paths] or [str(cwd)],
            rootdir_cmd_arg=_under(cwd, option_value(args, "--rootdir")),
            invocation_dir=cwd,
        )
    except Exception:  # noqa: BLE001 - pytest says what is wrong with its ini when the files run
        return []
    value = ini.get("addopts")
    value = getattr(value, "value", value)  # pytest 9 wraps each value with its origin
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list):
        return [str(item) for item in value]
    return []


def _under(cwd: Path, path: str | None) -> str | None:
    return None if path is None else str(cwd / path)


def coverage_requested(
    paths: Sequence[str],
    pytest_args: Sequence[str],
    environ: Mapping[str, str],
    cwd: Path,
) -> bool:
    """Whether this run's files measure coverage; UsageError where pytest-cov is asked for but
    not installed."""
    tokens = [
        *ini_addopts(paths, pytest_args, cwd),
        *shlex.split(environ.get("PYTEST_ADDOPTS", "")),
        *pytest_args,
    ]
    if not measures(tokens):
        return False
    if importlib.util.find_spec("pytest_cov") is None:
        raise UsageError("--cov needs pytest-cov, which is not installed (pip install pytest-cov)")
    check_config(option_value(tokens, "--cov-config") or ".coveragerc")
    return True


def check_config(config_file: str) -> None:
    """UsageError naming the coverage configuration if coverage cannot read it.

    Checked once here: otherwise every file's pytest would fail on it.
    """
    import coverage
    from coverage.exceptions import CoverageException

    try:
        coverage.Coverage(config_file=config_file)
    except CoverageException as exc:
        raise UsageError(f"--cov: the coverage configuration cannot be read: {exc}") from None
