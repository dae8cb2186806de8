"""What pytest's own ``--junitxml`` writes for a test, as pure functions of plain data.

The child (``gpusched.plugin``) feeds each phase report of a test to
``JunitCases``, which mirrors ``_pytest.junitxml.LogXML.pytest_runtest_logreport``
for that one test, and streams the resulting ``<testcase>`` contents to the
parent, which writes them unchanged into the merged report. So classname,
name, the ``message`` of ``<failure>``/``<error>``/``<skipped>`` and the
``system-out``/``system-err`` that ``junit_logging`` asks for are pytest's, per
test, whichever file or process the test ran in. gpusched adds one thing pytest
drops: report sections whose names are not pytest's captured stdout, stderr or
log (``rank 0 stderr``, ``ray worker logs``, or ``item.add_report_section``
under another key) are written to ``system-err`` of a *failing* test's case,
whatever ``junit_logging`` says: they are what explains a distributed failure.

The parent uses ``junit_names`` and ``fallback_case`` only for outcomes it made
up itself (timeouts, crashes, tests never run, collection errors found by the
collection process).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpusched.results import JunitCase, JunitElement

# The ``junit_logging`` values (pytest's ini option of that name).
JUNIT_LOGGING = ("no", "log", "system-out", "system-err", "out-err", "all")
# Sections pytest's junitxml writes (when ``junit_logging`` asks); the others are "extra".
CAPTURED = ("Captured stdout", "Captured stderr", "Captured log")

_ILLEGAL_XML = re.compile(
    "[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
)


def xml_safe(text: str) -> str:
    """``text`` with characters XML cannot hold written as ``#xNN`` (pytest's ``bin_xml_escape``).

    ElementTree escapes ``<&"`` but writes control characters (ANSI colours) as
    they are, which makes the file unreadable to every XML parser.
    """

    def visible(match: re.Match[str]) -> str:
        code = ord(match.group())
        return f"#x{code:02X}" if code <= 0xFF else f"#x{code:04X}"

    return _ILLEGAL_XML.sub(visible, text)


def junit_names(nodeid: str, prefix: str | None = None) -> tuple[str, str]:
    """``(classname, name)`` of a test id, as pytest's ``mangle_test_address`` makes them.

    The path is everything before the first ``::``; the names are split on
    ``::`` only before the first ``[``, so a parameter id may hold ``::``,
    ``/``, ``.`` or ``[``: ``a/test_x.py::TestK::test_f[ignore::Warning-1]`` is
    ``("a.test_x.TestK", "test_f[ignore::Warning-1]")``. A file's own id (a
    collection error) has an empty classname. ``prefix`` is ``--junitprefix``.
    """
    path, sep, tail = nodeid.partition("::")
    names = [re.sub(r"\.py$", "", path.replace("/", "."))]
    if sep:
        head, bracket, params = tail.partition("[")
        names += head.split("::")
        if bracket:
            names[-1] += f"[{params.removesuffix(']')}]"
    classnames = names[:-1]
    if prefix:
        classnames.insert(0, prefix)
    return ".".join(classnames), names[-1]


def section_text(name: str, content: str) -> str:
    """One section as pytest's junitxml frames captured output: a centred header line."""
    return "\n".join([f" {name} ".center(80, "-"), content, ""])


def extra_sections(sections: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The sections pytest's junitxml never writes: all but captured stdout, stderr and log."""
    return [(name, content) for name, content in sections if not name.startswith(CAPTURED)]


def shown_sections(
    sections: Sequence[tuple[str, str]], showcapture: str = "all"
) -> list[tuple[str, str]]:
    """The sections pytest's terminal prints under a failure, per ``--show-capture``."""
    if showcapture == "no":
        return []
    return [(n, c) for n, c in sections if showcapture == "all" or showcapture in n]


@dataclass
class Phase:
    """What ``JunitCases`` needs of one pytest ``TestReport`` (plain data, so tests build it)."""

    when: str  # setup, call, teardown
    outcome: str  # passed, failed, skipped (pytest's report.outcome)
    duration: float = 0.0
    wasxfail: str | None = None  # report.wasxfail: an xfail-marked test
    crash: str | None = None  # report.longrepr.reprcrash.message, if it has one
    text: str = ""  # str(report.longrepr) of a failed report
    skip: tuple[str, int | None, str] | None = None  # report.longrepr of a skip
    stdout: str = ""  # report.capstdout
    stderr: str = ""  # report.capstderr
    log: str = ""  # report.caplog
    sections: list[tuple[str, str]] = field(default_factory=list)  # report.sections
    properties: list[tuple[str, str]] = field(default_factory=list)  # report.user_properties


def _same(message: str) -> str:
    return message


@dataclass
class JunitCases:
    """The ``<testcase>`` element(s) pytest's junitxml writes for one test, phase by phase.

    Mirrors ``LogXML.pytest_runtest_logreport`` (pytest 9) for a single test id:
    a failed call followed by a failed teardown closes the first testcase and
    opens a second one; captured output is written per ``logging``
    (``junit_logging``) and ``log_passing_tests`` (``junit_log_passing_tests``);
    the time is the sum of the phases, or only the call's when
    ``duration_report`` (``junit_duration_report``) is ``call``. ``shorten``
    is pytest's ``shorten_message`` where the child's pytest has it.
    """

    logging: str = "no"
    log_passing_tests: bool = True
    duration_report: str = "total"
    shorten: Callable[[str], str] = _same
    cases: list[JunitCase] = field(default_factory=list)
    _open: JunitCase | None = None
    _extras: list[tuple[str, str]] = field(default_factory=list)  # of the open case
    _call_failed: bool = False

    def add(self, phase: Phase) -> None:
        """Take one phase report, in pytest's order: setup, call (if setup passed), teardown."""
        if phase.outcome == "passed":
            if phase.when == "call":
                self._case()
        elif phase.outcome == "failed":
            if phase.when == "teardown" and self._call_failed:
                self._close(phase.properties)  # pytest finalizes the call's case first
            case = self._case()
            if phase.when == "call":
                self._failure(case, phase)
                self._call_failed = True
                if not self.log_passing_tests:
                    self._output(case, phase)
            else:
                self._error(case, phase)
            self._extras += [s for s in extra_sections(phase.sections) if s not in self._extras]
        elif phase.outcome == "skipped":
            self._skipped(self._case(), phase)
        if self.duration_report in ("total", phase.when):
            self._case().time += phase.duration
        if phase.when == "teardown":
            self._output(self._case(), phase)
            self._close(phase.properties)

    def _case(self) -> JunitCase:
        if self._open is None:
            self._open = JunitCase()
            self.cases.append(self._open)
        return self._open

    def _close(self, properties: Sequence[tuple[str, str]]) -> None:
        """Finish the open case: its ``record_property`` values, then the extra sections."""
        case = self._case()
        case.properties = [(str(name), str(value)) for name, value in properties]
        if self._extras:
            text = "".join(section_text(name, content) for name, content in self._extras)
            errs = [e for e in case.elements if e.tag == "system-err"]
            if errs:
                errs[-1].text = (errs[-1].text or "") + text
            else:
                case.elements.append(JunitElement("system-err", {}, text))
        self._open, self._extras = None, []

    def _failure(self, case: JunitCase, phase: Phase) -> None:
        if phase.wasxfail is not None:
            message = "xfail-marked test passes unexpectedly"
            case.elements.append(JunitElement("skipped", {"message": message}, "None"))
            return
        message = phase.crash if phase.crash is not None else phase.text
        case.elements.append(
            JunitElement("failure", {"message": self.shorten(message)}, phase.text)
        )

    def _error(self, case: JunitCase, phase: Phase) -> None:
        reason = phase.crash if phase.crash is not None else phase.text
        when = "teardown" if phase.when == "teardown" else "setup"
        message = self.shorten(f'failed on {when} with "{reason}"')
        case.elements.append(JunitElement("error", {"message": message}, phase.text))

    def _skipped(self, case: JunitCase, phase: Phase) -> None:
        if phase.wasxfail is not None:
            reason = phase.wasxfail.removeprefix("reason: ")
            case.elements.append(
                JunitElement("skipped", {"type": "pytest.xfail", "message": reason})
            )
            return
        filename, lineno, reason = phase.skip or ("", None, "")
        reason = reason.removeprefix("Skipped: ")
        case.elements.append(
            JunitElement(
                "skipped",
                {"type": "pytest.skip", "message": reason},
                f"{filename}:{lineno}: {reason}",
            )
        )
        self._output(case, phase)

    def _output(self, case: JunitCase, phase: Phase) -> None:
        """pytest's ``write_captured_output``: which captured streams go where, per ``logging``."""
        if (not self.log_passing_tests and phase.outcome == "passed") or self.logging == "no":
            return
        content = ""
        if self.logging in ("log", "all"):
            content = section_text("Captured Log", phase.log)
        if self.logging in ("system-out", "out-err", "all"):
            content += section_text("Captured Out", phase.stdout)
            case.elements.append(JunitElement("system-out", {}, content))
            content = ""
        if self.logging in ("system-err", "out-err", "all"):
            content += section_text("Captured Err", phase.stderr)
            case.elements.append(JunitElement("system-err", {}, content))
            content = ""
        if content:
            case.elements.append(JunitElement("system-out", {}, content))


def collect_error_case(text: str) -> JunitCase:
    """A file pytest could not collect: pytest writes ``<error message="collection failure">``."""
    return JunitCase(0.0, [JunitElement("error", {"message": "collection failure"}, text)])


def _crash_line(text: str) -> str:
    """The exception line(s) of a traceback (pytest's ``E   `` lines), else its last line."""
    lines = text.strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return "\n".join(errors) if errors else (lines[-1] if lines else "")


def fallback_case(nodeid: str, outcome: str, message: str, duration: float) -> JunitCase:
    """A testcase for a result the child did not describe: a timeout, a crash, a test never
    run, or a file the collection process could not collect or skipped as a whole."""
    whole_file = "::" not in nodeid
    elements: list[JunitElement] = []
    if outcome == "failed":
        elements.append(JunitElement("failure", {"message": _crash_line(message)[:500]}, message))
    elif outcome == "error" and whole_file:
        return collect_error_case(message)
    elif outcome == "error":
        elements.append(JunitElement("error", {"message": _crash_line(message)[:500]}, message))
    elif outcome in ("timeout", "crashed"):  # gpusched's own: the type says which
        attrs = {"message": f"{outcome}: {_crash_line(message)[:500]}", "type": outcome}
        elements.append(JunitElement("error", attrs, message))
    elif outcome == "skipped" and whole_file:
        elements.append(JunitElement("skipped", {"message": "collection skipped"}, message))
    elif outcome in ("skipped", "xfailed"):
        reason = message.removeprefix("Skipped: ")
        elements.append(JunitElement("skipped", {"message": reason or outcome}))
    elif outcome == "not run":
        elements.append(JunitElement("skipped", {"message": message or outcome}))
    return JunitCase(duration, elements)
