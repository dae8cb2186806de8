"""The real ``gpusched`` command's messages: every usage error once, as ``gpusched: error: ...``."""

from __future__ import annotations

from importlib import metadata

import pytest
from deadlines import hang_guard


def _the_one_error_line(result) -> str:
    """The single ``gpusched: error:`` line of a usage error; nothing says it twice."""
    assert result.returncode == 4, result.stdout + result.stderr
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "error:" in line and "gpusched" in line]
    assert len(errors) == 1, output
    (line,) = errors
    assert line.startswith("gpusched: error: "), output
    assert line.count("gpusched:") == 1 and line.count("error:") == 1, line
    return line


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            [],
            "gpusched: error: the following arguments are required: command; see 'gpusched --help'",
        ),
        (
            ["runn"],
            "gpusched: error: argument command: invalid choice: 'runn' "
            "(choose from 'run', 'plan', 'shard', 'matrix'); see 'gpusched --help'",
        ),
        (
            ["shard", "."],
            "gpusched: error: the following arguments are required: --gpus-per-runner; "
            "see 'gpusched shard --help'",
        ),
        (
            ["run", ".", "--timeout"],
            "gpusched: error: argument --timeout: expected one argument; see 'gpusched run --help'",
        ),
        (["run", ".", "--no-such-option"], "gpusched: error: unrecognized arguments: "),
        (["run", ".", "--timeout", "soon"], "gpusched: error: --timeout: 'soon' is not a number"),
        (["plan", "missing_dir"], "gpusched: error: path 'missing_dir' does not exist"),
    ],
)
def test_a_usage_error_is_printed_once_with_one_prefix(args, line, make_suite, run_gpusched):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    result = run_gpusched(*args, timeout=hang_guard(30))
    assert _the_one_error_line(result).startswith(line)


@pytest.mark.parametrize("command", ["run", "plan", "shard"])
def test_pytest_rejecting_its_arguments_is_reported_once(command, make_suite, run_gpusched):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    extra = ["--gpus-per-runner", "0"] if command == "shard" else []
    result = run_gpusched(
        command, ".", *extra, "--", "--no-such-pytest-flag", timeout=hang_guard(60)
    )
    line = _the_one_error_line(result)
    assert line == "gpusched: error: pytest rejected the arguments:"
    assert (result.stdout + result.stderr).count("--no-such-pytest-flag") == 1


def test_version_is_the_installed_distributions(run_gpusched):
    result = run_gpusched("--version", timeout=hang_guard(30))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"gpusched {metadata.version('pytest-gpusched')}\n"
    assert result.stderr == ""
