"""The collection stream and the feeder: what the plugin streams, and how it becomes jobs.

The plugin's stream is checked against its own final report (the truth);
the feeder runs against a real runner and packer that are not started, so
the jobs it submits and the results it reports can be read back.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import hang_guard

from gpusched.collection.collect import CollectedFile, CollectError, Collection, parse_report
from gpusched.collection.stream import (
    FileFailed,
    FileFound,
    Rooted,
    StreamOff,
    parse_line,
)
from gpusched.execution.runner import RunConfig, Runner
from gpusched.feed import Feeder
from gpusched.history import Entry
from gpusched.requirements import Requirement
from gpusched.results import FileResult, expectation
from gpusched.scheduling import Packer

SUITE = {
    "test_mix.py": (
        "import pytest\n\n"
        "def test_cpu():\n    pass\n\n"
        "@pytest.mark.gpu(2, memory='20GB')\ndef test_two():\n    pass\n\n"
        "class TestGroup:\n    def test_named_x(self):\n        pass\n"
    ),
    "test_gpu.py": "import pytest\n\npytestmark = pytest.mark.gpu1\n\ndef test_g():\n    pass\n",
    "test_bad.py": "import nosuchmodule\n",
    "test_skip.py": "import pytest\n\npytest.skip('not here', allow_module_level=True)\n",
    "sub/test_deep.py": "def test_deep():\n    pass\n",
}


def _collect(tmp_path: Path, *selection: str) -> tuple[list, Collection]:
    for name, source in SUITE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    report, stream = tmp_path / "report.json", tmp_path / "stream.jsonl"
    report.unlink(missing_ok=True)
    stream.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         f"--gpusched-report={report}", f"--gpusched-stream={stream}", *selection, "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(60),
    )  # fmt: skip
    events = [parse_line(line) for line in stream.read_text().splitlines()]
    return events, parse_report(json.loads(report.read_text()))


@pytest.mark.parametrize(
    "selection",
    [
        (),
        ("-m", "not gpu"),
        ("-m", "gpu2"),
        ("-k", "named or test_g"),
        ("--deselect", "test_mix.py::test_cpu"),
    ],
)
def test_the_stream_predicts_the_final_report_file_by_file(tmp_path, selection):
    events, final = _collect(tmp_path, *selection)
    assert events[0] == Rooted(final.rootdir)
    # The stream also says how long each file took to collect; the report does not.
    streamed = {
        e.file.path: dataclasses.replace(e.file, seconds=0.0)
        for e in events
        if isinstance(e, FileFound)
    }
    assert streamed == {f.path: f for f in final.files}
    failed = [e.error for e in events if isinstance(e, FileFailed)]
    assert failed == final.errors and [Path(e.path).name for e in failed] == ["test_bad.py"]
    assert not any(isinstance(e, StreamOff) for e in events)


def test_a_conftest_selection_hook_turns_the_stream_off(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "def pytest_collection_modifyitems(items):\n    items.reverse()\n"
    )
    events, final = _collect(tmp_path)
    assert isinstance(events[1], StreamOff) and "conftest.py" in events[1].reason
    assert not any(isinstance(e, FileFound) for e in events) and final.files


# ---------------------------------------------------------------- the feeder


def _feeder(tmp_path: Path, history: dict[str, Entry] | None = None):
    config = RunConfig(
        pytest_args=(), timeout=None, kill_grace=1.0, simulated=True, log_dir=tmp_path,
        work_dir=tmp_path, tmp_root=str(tmp_path), run_id="t",
    )  # fmt: skip
    runner = Runner(config, Packer([], cpu_slots=2), {}, reporter=None, open_input=True)  # type: ignore[arg-type]
    reported: list[FileResult] = []
    feeder = Feeder(runner, runner.refit, history or {}, reported.append, rootdir="/s")
    return feeder, runner, reported


def _file(name: str, gpus: int = 0, tests: tuple[str, ...] = ("t",)) -> CollectedFile:
    return CollectedFile(f"/s/{name}", Requirement(gpus), tests, (Requirement(gpus),))


def _pending(runner: Runner) -> dict[str, tuple[int, float]]:
    return {job.path: (job.gpus, job.expected) for job in runner.policy.cancel_pending()}


def test_each_streamed_file_is_submitted_at_once_with_its_prediction(tmp_path):
    history = {"test_known.py": Entry(8.0, 8.0, 1), "other.py": Entry(2.0, 2.0, 1)}
    feeder, runner, _ = _feeder(tmp_path, history)
    feeder.on_event(Rooted("/s"))
    feeder.on_event(FileFound(_file("test_known.py")))
    feeder.on_event(FileFound(_file("test_new.py", tests=("a", "b"))))
    assert runner.expect["/s/test_new.py"] == expectation(Requirement(), ("a", "b"))
    assert runner.tests["/s/test_new.py"] == ("a", "b")
    # Unknown files get the mean of the whole history: the rest of the suite is not known yet.
    assert _pending(runner) == {"/s/test_known.py": (0, 8.0), "/s/test_new.py": (0, 5.0)}


def test_the_final_report_adds_what_was_not_streamed_and_reports_each_error_once(tmp_path):
    feeder, runner, reported = _feeder(tmp_path)
    error = CollectError("/s/test_bad.py", "test_bad.py", "ImportError")
    feeder.on_event(FileFound(_file("test_a.py")))
    feeder.on_event(FileFailed(error))
    final = Collection("/s", files=[_file("test_a.py"), _file("test_b.py")], errors=[error])
    feeder.finish(final)
    assert [r.path for r in reported] == ["/s/test_bad.py"]
    assert sorted(_pending(runner)) == ["/s/test_a.py", "/s/test_b.py"]
    assert "/s/test_b.py" not in runner.expect  # collected in full: nothing left to check


def test_a_pending_file_the_final_report_sees_differently_is_replaced(tmp_path):
    feeder, runner, _ = _feeder(tmp_path)
    feeder.on_event(FileFound(_file("test_a.py", gpus=0, tests=("x",))))
    feeder.finish(Collection("/s", files=[_file("test_a.py", gpus=0, tests=("x", "y"))]))
    assert runner.tests["/s/test_a.py"] == ("x", "y")
    assert "/s/test_a.py" not in runner.expect
    assert list(_pending(runner)) == ["/s/test_a.py"]


def test_after_a_stop_nothing_new_is_submitted(tmp_path):
    feeder, runner, _ = _feeder(tmp_path)
    runner.stop("-x")
    feeder.on_event(FileFound(_file("test_a.py")))
    feeder.finish(Collection("/s", files=[_file("test_b.py")]))
    assert _pending(runner) == {}
