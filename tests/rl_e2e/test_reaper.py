"""The reaper kills what a cluster's processes left, and nothing else, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
from deadlines import hang_guard

from rl_e2e.reaper import SETTLED_S, TAG_VARIABLE, _tagged_trees, start_reaper

# A child that carries the tag and starts a grandchild: the reaper kills both.
_PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("started", flush=True)
time.sleep(600)
"""


def _wait_for_children(proc: subprocess.Popen, n: int) -> list[psutil.Process]:
    deadline = time.monotonic() + hang_guard(10)
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children(recursive=True)
        if len(children) >= n:
            return children
        time.sleep(0.1)
    raise AssertionError("the grandchild never started")


def test_closing_the_reaper_kills_the_tagged_tree_and_spares_the_rest():
    reaper = start_reaper()
    try:
        tagged = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE)
    finally:
        os.environ.pop(reaper.variable, None)
    untagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert tagged.stdout is not None and tagged.stdout.readline() == b"started\n"
        (grandchild,) = _wait_for_children(tagged, 1)
        time.sleep(3)  # the reaper notes the tree every two seconds
        reaper.close(timeout_s=hang_guard(10))
        assert tagged.wait(timeout=hang_guard(5)) == -9
        psutil.wait_procs([grandchild], timeout=hang_guard(5))
        assert not grandchild.is_running()
        assert untagged.poll() is None, "a process without the tag was killed"
    finally:
        untagged.kill()
        tagged.kill()
        untagged.wait()
        tagged.wait()


def test_a_poll_finds_a_tree_tagged_after_its_neighbours_were_read_once():
    """The reaper reads a settled process's environment once; a tree that starts later, or a
    pid taken by a tagged newcomer, is still found (the cache keys on creation time too)."""
    tag = f"reaper-test-{os.getpid()}"
    untagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tagged = None
    try:
        time.sleep(SETTLED_S + 0.2)
        seen: set[tuple[int, float]] = set()
        assert _tagged_trees(TAG_VARIABLE, tag, seen) == {}
        assert (untagged.pid, psutil.Process(untagged.pid).create_time()) in seen
        env = {**os.environ, TAG_VARIABLE: tag}
        tagged = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, env=env)
        assert tagged.stdout is not None and tagged.stdout.readline() == b"started\n"
        (grandchild,) = _wait_for_children(tagged, 1)
        found = _tagged_trees(TAG_VARIABLE, tag, seen)
        assert set(found) == {tagged.pid, grandchild.pid}
        assert untagged.pid not in found
    finally:
        for proc in (untagged, tagged):
            if proc is not None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()
