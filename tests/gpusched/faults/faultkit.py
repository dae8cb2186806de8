"""Fault injection for gpusched: a throwaway suite, a real ``gpusched run``, and what it left behind.

Shared by the tests in this folder and by ``bench/faults.py``. A ``Sandbox``
owns one short temporary directory holding the suite, the run's ``TMPDIR`` and
its reports; every process started for it carries ``FAULTKIT_MARK=<id>`` in its
environment (inherited through gpusched, the child pytest, and anything the
tests spawn, however they detach), so what a run leaves behind is found by
scanning for the mark, and the temporary files by listing the run's ``TMPDIR``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deadlines import hang_guard

from gpusched.execution.proctree import TAG_VARIABLE, processes_with

MARK_VARIABLE = "FAULTKIT_MARK"


@dataclass
class RunOutput:
    """What one ``gpusched run`` produced: exit code, console output, parsed reports."""

    code: int
    out: str
    seconds: float
    report: dict | None
    junit: ET.Element | None

    @property
    def last_line(self) -> str:
        lines = self.out.strip().splitlines()
        return lines[-1] if lines else ""

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith(prefix)]

    def file(self, name: str) -> dict:
        """The JSON report's entry for the test file named ``name`` (a basename)."""
        assert self.report is not None, f"no JSON report; output:\n{self.out}"
        for entry in self.report["files"]:
            if Path(entry["path"]).name == name:
                return entry
        raise AssertionError(f"{name} not in the JSON report; output:\n{self.out}")

    def tests(self, name: str) -> dict[str, str]:
        """Test name -> outcome for one file of the JSON report."""
        return {t["nodeid"].split("::")[-1]: t["outcome"] for t in self.file(name)["tests"]}

    def junit_property(self, name: str, prop: str) -> str:
        assert self.junit is not None, f"no JUnit report; output:\n{self.out}"
        for suite in self.junit.iter("testsuite"):
            if Path(suite.get("name", "")).name == name:
                for element in suite.iter("property"):
                    if element.get("name") == prop:
                        return element.get("value", "")
        raise AssertionError(f"no property {prop} for {name} in the JUnit report")


@dataclass
class Sandbox:
    """One fault injection's world. Use as a context manager: it kills and removes everything."""

    files: dict[str, str]
    extra_env: dict[str, str] = field(default_factory=dict)
    on_close: list[Any] = field(default_factory=list)  # callables run first by ``close``

    def __post_init__(self) -> None:
        # Short on purpose: gpusched puts per-job RAY_TMPDIRs under TMPDIR only when it is short.
        self.root = Path(tempfile.mkdtemp(prefix="fk", dir="/tmp"))
        self.suite = self.root / "suite"
        self.tmp = self.root / "tmp"
        self.suite.mkdir()
        self.tmp.mkdir()
        self.mark = uuid.uuid4().hex
        self.json_path = self.root / "report.json"
        self.junit_path = self.root / "junit.xml"
        self.output_path = self.root / "output.txt"
        # Stop pytest's and gpusched's upward search for configuration here.
        (self.suite / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
        (self.suite / "pyproject.toml").write_text("[tool.gpusched]\n")
        for name, source in self.files.items():
            target = self.suite / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(source))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill whatever still carries the mark (a failed run must not leak), remove the files."""
        self.end_session()
        for proc in processes_with(MARK_VARIABLE, self.mark):
            try:
                proc.kill()
            except Exception:
                pass
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)

    def end_session(self) -> None:
        """What the session does after its runner, for in-process runs (close the fork server)."""
        while self.on_close:
            self.on_close.pop()()

    def environ(self) -> dict[str, str]:
        """The parent's environment without gpusched's own variables, plus the mark and TMPDIR.

        Plugin autoloading is off (gpusched then passes ``-p gpusched.plugin`` itself):
        it keeps each child pytest's start-up short on a loaded machine.
        """
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("GPUSCHED_")
            and key not in ("CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS", "RAY_ADDRESS", TAG_VARIABLE)
        }
        env.update(
            {
                MARK_VARIABLE: self.mark,
                "TMPDIR": str(self.tmp),
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gpusched",
            "run",
            ".",
            "--json",
            str(self.json_path),
            "--junitxml",
            str(self.junit_path),
            *args,
        ]

    def start(self, *args: str) -> subprocess.Popen:
        """Start ``gpusched run . ARGS`` in the suite, output to a file (read it with ``output``)."""
        self._started = time.monotonic()
        with open(self.output_path, "wb") as out:
            return subprocess.Popen(
                self.command(*args),
                cwd=self.suite,
                env=self.environ(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        """Block until ``text`` appears in the output (bounded)."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not seen in {timeout:g}s; output:\n{self.output()}")
            time.sleep(0.05)

    def wait_for_file(self, name: str, timeout: float = 60.0) -> Path:
        path = self.suite / name
        deadline = time.monotonic() + timeout
        while not (path.exists() and path.stat().st_size):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} not written in {timeout:g}s; output:\n{self.output()}"
                )
            time.sleep(0.05)
        return path

    def finish(self, proc: subprocess.Popen, timeout: float = hang_guard(120)) -> RunOutput:
        """Wait for a started run (killing it past ``timeout``) and read its reports."""
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"gpusched did not exit in {timeout:g}s:\n{self.output()}"
            ) from None
        seconds = time.monotonic() - self._started
        report = json.loads(self.json_path.read_text()) if self.json_path.exists() else None
        junit = ET.parse(self.junit_path).getroot() if self.junit_path.exists() else None
        return RunOutput(code, self.output(), seconds, report, junit)

    def run(self, *args: str, timeout: float = hang_guard(120)) -> RunOutput:
        return self.finish(self.start(*args), timeout)

    def signal_when(self, proc: subprocess.Popen, signum: int) -> float:
        """Send ``signum`` to the gpusched process; returns when it was sent (monotonic)."""
        proc.send_signal(signum)
        return time.monotonic()

    def leftover_processes(self) -> list[str]:
        """Command lines of live processes that carry this sandbox's mark (none is the goal)."""
        left = []
        for proc in processes_with(MARK_VARIABLE, self.mark):
            try:
                left.append(f"{proc.pid}: {' '.join(proc.cmdline())[:120]}")
            except Exception:
                left.append(str(proc.pid))
        return left

    def leftover_temp(self) -> list[str]:
        """Everything the run left in its TMPDIR (which starts empty)."""
        return sorted(str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*"))


@dataclass
class Observation:
    fault: str
    expected: str
    observed: str
    processes_left: list[str]
    temp_left: list[str]
    run: RunOutput | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.observed == self.expected and not self.processes_left and not self.temp_left


def observe(sandbox: Sandbox, fault: str, expected: str, observed: str, run, **details):
    sandbox.end_session()
    return Observation(
        fault,
        expected,
        observed,
        sandbox.leftover_processes(),
        sandbox.leftover_temp(),
        run,
        details,
    )


def alive(pids: list[int]) -> list[int]:
    """The pids still running (not zombies)."""
    import psutil

    living = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living


def read_pids(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()] if path.exists() else []


SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
