"""The node watchdog on its own: it fires when its pipe closes, kills the run's processes and
removes the directories it was given (what an agent that died could not do)."""

from __future__ import annotations

import os
import subprocess
import uuid

from deadlines import hang_guard, wait_until

from gpusched.execution.cluster import watchdog
from gpusched.execution.proctree import TAG_VARIABLE


def test_a_fired_watchdog_kills_the_runs_processes_and_removes_its_paths(tmp_path):
    prefix = f"{uuid.uuid4().hex[:10]}-abcdef-"
    work, ray_tmp, kept = tmp_path / "work", tmp_path / "gs", tmp_path / "kept"
    for folder in (work / "logs", ray_tmp / "gs1", kept):
        folder.mkdir(parents=True)
    (work / "logs" / "test_a.py.log").write_text("a log\n")
    tagged = subprocess.Popen(["sleep", "300"], env={**os.environ, TAG_VARIABLE: f"{prefix}0-1"})
    pipe = watchdog.launch(prefix, [str(work), str(ray_tmp)])
    try:
        os.close(pipe)  # as the agent's exit does, however it exits
        assert tagged.wait(timeout=hang_guard(5)) is not None
        wait_until(lambda: not work.exists() and not ray_tmp.exists(), 5, "the paths to go")
    finally:
        tagged.kill()
        tagged.wait()
    assert kept.is_dir()  # only the paths it was given
