"""The end of a measuring run: every file's data in the user's data file, reported once.

Called by the run's end (``gpusched.ending``) with the folder the attempts
measured into (``gpusched.coverage.data``). It combines them into the data
file pytest-cov would have left (``.coverage``, or the configuration's
``data_file`` / ``COVERAGE_FILE``), under the user's configuration (its
``[paths]`` too), and writes the reports pytest-cov would have written, with
the same options: ``--cov-report`` (``term`` by default), ``--cov-fail-under``,
``--cov-append``, ``--no-cov-on-fail``, ``--cov-precision``.

Data measured on another node of a ``--ray`` run has that node's paths; the
files under the node's code root are mapped to the driver's, so the report
names the driver's checkout and nothing in Ray's working dirs.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.coverage.data import Attempt

Say = Callable[[str], None]


@dataclass
class Verdict:
    """What the report said: its lines, the total, and whether ``--cov-fail-under`` failed."""

    lines: list[str] = field(default_factory=list)
    total: float | None = None
    failed_under: bool = False


def reports(manifest: dict[str, Any]) -> dict[str, str | None]:
    """The reports asked for, as pytest-cov resolved them (pure): type -> destination or
    modifier. pytest-cov turns no ``--cov-report`` into ``["term"]``; ``--cov-report=`` alone
    into ``{}``."""
    asked = manifest.get("report")
    if isinstance(asked, list):
        return dict.fromkeys(asked)
    if isinstance(asked, dict):
        return {str(kind): value for kind, value in asked.items()}
    return {"term": None}


def node_mapper(node_root: str, root: str) -> Callable[[str], str]:
    """A path map from a node's code root to the driver's checkout (pure); other paths stay."""
    prefix = node_root.rstrip(os.sep) + os.sep

    def remap(path: str) -> str:
        if path.startswith(prefix):
            return os.path.join(root, path[len(prefix) :])
        return path

    return remap


def split_versions(attempts: Sequence[Attempt], version: str) -> tuple[list[Attempt], list[str]]:
    """The attempts whose data this coverage can read, and a line for each node whose
    coverage version differs (pure)."""
    kept: list[Attempt] = []
    odd: dict[str, str] = {}
    for attempt in attempts:
        theirs = (attempt.manifest or {}).get("coverage")
        if theirs is not None and theirs != version:
            odd.setdefault(attempt.node or "this machine", theirs)
            continue
        kept.append(attempt)
    lines = [
        f"gpusched: coverage: node {node} measured with coverage {theirs}, this machine has "
        f"{version}: its data is left out"
        for node, theirs in sorted(odd.items())
    ]
    return kept, lines


def missing_lines(attempts: Sequence[Attempt], display: Callable[[str], str]) -> list[str]:
    """A line naming the files none of whose attempts left data (killed before saving) (pure)."""
    measured = {attempt.file for attempt in attempts if attempt.files}
    missing = sorted(
        {attempt.file for attempt in attempts if attempt.file and attempt.file not in measured}
    )
    if not missing:
        return []
    names = ", ".join(display(path) for path in missing)
    return [
        f"gpusched: coverage: no data from {len(missing)} file(s), killed before they could "
        f"save it: {names}"
    ]


def combine_and_report(
    attempts: Sequence[Attempt],
    *,
    root: str,
    tests_failed: bool,
    display: Callable[[str], str],
) -> Verdict:
    """Combine ``attempts`` into the user's data file and make the reports; the verdict.

    ``root`` is the driver's checkout (where node paths are mapped to);
    ``tests_failed`` decides ``--no-cov-on-fail``.
    """
    import coverage
    from coverage.exceptions import CoverageException

    verdict = Verdict()
    manifests = [attempt.manifest for attempt in attempts if attempt.manifest]
    if not manifests:
        verdict.lines.append("gpusched: coverage: no file measured anything")
        return verdict
    manifest = manifests[0]
    kept, verdict.lines = split_versions(attempts, coverage.__version__)
    verdict.lines += missing_lines(kept, display)
    cov = coverage.Coverage(
        source=manifest.get("source"),
        branch=manifest.get("branch"),
        config_file=manifest.get("config") or True,
    )
    if manifest.get("append"):
        cov.load()
    else:
        cov.erase()
    files = _local_files(kept, root)
    if files:
        cov.combine([str(path) for path in files], keep=True)
    cov.save()
    for path in files:
        if path.name.endswith(".mapped"):
            path.unlink(missing_ok=True)
    if tests_failed and manifest.get("no_cov_on_fail"):
        return verdict
    precision = manifest.get("precision") or 0
    try:
        verdict.total, text = _write_reports(cov, reports(manifest), precision)
    except CoverageException as exc:
        verdict.lines.append(f"gpusched: coverage: failed to generate the report: {exc}")
        verdict.total = 0.0
        text = ""
    if text:
        verdict.lines += [
            "",
            _rule("tests coverage", "="),
            _rule(f"coverage: {platform_line()}", "_"),
            "",
            *text.rstrip("\n").split("\n"),
        ]
    fail_under = manifest.get("fail_under")
    if fail_under:
        from coverage.results import should_fail_under

        verdict.failed_under = should_fail_under(verdict.total, fail_under, precision)
        verdict.lines.append(
            f"{'FAIL ' if verdict.failed_under else ''}Required test coverage of {fail_under}% "
            f"{'not reached' if verdict.failed_under else 'reached'}. "
            f"Total coverage: {verdict.total:.2f}%"
        )
    return verdict


def _local_files(attempts: Sequence[Attempt], root: str) -> list[Path]:
    """The data files to combine; a node's are first copied with its paths mapped to ``root``."""
    files: list[Path] = []
    for attempt in attempts:
        node_root = (attempt.manifest or {}).get("cwd")
        if not attempt.node or not node_root or node_root == root:
            files += attempt.files
            continue
        files += [_mapped(path, node_mapper(node_root, root)) for path in attempt.files]
    return files


def _mapped(path: Path, remap: Callable[[str], str]) -> Path:
    from coverage import CoverageData

    source = CoverageData(str(path))
    source.read()
    target = path.with_name(path.name + ".mapped")
    mapped = CoverageData(str(target))
    mapped.update(source, map_path=remap)
    mapped.write()
    return target


FILE_REPORTS = (  # --cov-report type, its default's setting, what is said, the writer, its argument
    ("html", "html_dir", "Coverage HTML written to dir {}\n", "html_report", "directory"),
    ("xml", "xml_output", "Coverage XML written to file {}\n", "xml_report", "outfile"),
    ("json", "json_output", "Coverage JSON written to file {}\n", "json_report", "outfile"),
    ("lcov", "lcov_output", "Coverage LCOV written to file {}\n", "lcov_report", "outfile"),
)


def _write_reports(cov: Any, asked: dict[str, str | None], precision: int) -> tuple[float, str]:
    """Each asked report, as pytest-cov words them; the total and the console text."""
    out = io.StringIO()
    total = cov.report(
        ignore_errors=True, output_format="total", precision=precision, file=io.StringIO()
    )
    if "term" in asked or "term-missing" in asked:
        cov.report(
            ignore_errors=True,
            file=out,
            precision=precision,
            show_missing="term-missing" in asked or None,
            skip_covered="skip-covered" in asked.values() or None,
        )
    if "annotate" in asked:
        dest = asked["annotate"]
        cov.annotate(ignore_errors=True, directory=dest)
        where = f"to dir {dest}" if dest else "next to source"
        out.write(f"Coverage annotated source written {where}\n")
    for kind, setting, said, method, argument in FILE_REPORTS:
        if kind in asked:
            dest = asked[kind]
            getattr(cov, method)(ignore_errors=True, **{argument: dest})
            out.write(said.format(dest if dest is not None else getattr(cov.config, setting)))
    for kind, mode, verb in (("markdown", "w", "written"), ("markdown-append", "a", "appended")):
        if kind in asked:
            dest = asked[kind] or "coverage.md"
            with open(dest, mode, encoding="utf-8") as handle:
                cov.report(
                    ignore_errors=True, file=handle, output_format="markdown", precision=precision
                )
            out.write(f"Coverage Markdown information {verb} to file {dest}\n")
    return float(total), out.getvalue()


def platform_line() -> str:
    """This machine as pytest-cov names it in its report's heading."""
    version = "{}.{}.{}-{}-{}".format(*sys.version_info[:5])
    return f"platform {sys.platform}, python {version}"


def _rule(title: str, char: str, width: int = 80) -> str:
    side = max((width - len(title) - 2) // 2, 1)
    return f"{char * side} {title} {char * side}"
