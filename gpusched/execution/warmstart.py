"""Warm starts: a GPU file's pytest process starts before its cards are free.

Cards are the scarce resource of a run. A pytest child spends a fraction of a
second to seconds starting an interpreter, importing pytest and loading the
installed plugins before any user code runs; a card should not sit idle
through that. So the runner starts the next few GPU files ahead of time with
*no* cards visible and a gate: one end of a socket pair on which the child,
inside the plugin's ``pytest_load_initial_conftests`` hook (before any
``conftest.py`` or test module is imported), says ``ready`` and then waits for
one line of JSON carrying the variables that depend on the assignment
(``CUDA_VISIBLE_DEVICES``). When the cards are free the runner sends that line
and the file runs as if it had just started. The ``ready`` line tells the
runner that the child's start-up is over, so warm starts can be limited to
idle cores and never slow down a file that already holds its cards.

End of file on the gate without a message means "not needed after all" (the
run was interrupted or stopped by ``-x``): the child exits at once with
:data:`CANCELLED`. Only code that runs before the gate (the interpreter's
``site``, plugins loaded through entry points or ``-p``) sees the pre-start
environment; if such code initialised CUDA, the child refuses to run the file
(exit :data:`CUDA_TOO_EARLY`) rather than run it on the wrong cards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Mapping

GATE_VARIABLE = "GPUSCHED_GATE_FD"
CANCELLED = 2
CUDA_TOO_EARLY = 3


def prestart_env(
    env: Mapping[str, str], assigned: Mapping[str, str], gate_fd: int
) -> dict[str, str]:
    """A child environment as it must be before the cards are known.

    ``env`` is the complete environment; the ``assigned`` variables (those that
    depend on the cards) are blanked until the gate opens: an early CUDA
    initialisation then finds no card rather than someone else's.
    """
    waiting = {**env, **dict.fromkeys(assigned, "")}
    waiting[GATE_VARIABLE] = str(gate_fd)
    return waiting


def go_message(assigned: Mapping[str, str]) -> bytes:
    """The line that opens the gate."""
    return (json.dumps(dict(assigned)) + "\n").encode()


class Gate:
    """The runner's end of one child's gate: a socket pair, one end passed to the child."""

    def __init__(self) -> None:
        self._ours, self._theirs = socket.socketpair()
        self._ours.setblocking(False)

    @property
    def child_fd(self) -> int:
        """The descriptor to pass to the child (``pass_fds``) and name in :data:`GATE_VARIABLE`."""
        return self._theirs.fileno()

    def spawned(self) -> None:
        """The child has its copy: close ours of its end, so its exit reads as end of file."""
        self._theirs.close()

    async def ready(self) -> None:
        """Return once the child reached the gate, or exited (or the gate was closed) before."""
        try:
            await asyncio.get_running_loop().sock_recv(self._ours, 64)
        except OSError:
            pass

    def open(self, assigned: Mapping[str, str]) -> bool:
        """Let the child run with the ``assigned`` variables; False if it has already exited."""
        try:
            self._ours.sendall(go_message(assigned))
            self._ours.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        return True

    def cancel(self) -> None:
        """End of file for a waiting child: it exits by itself (:data:`CANCELLED`)."""
        try:
            self._ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._theirs.close()
        self._ours.close()


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


def wait_at_gate() -> None:
    """In the child: block until the runner sends the cards, then apply them to ``os.environ``.

    Does nothing when the process was not pre-started (no gate variable).
    """
    fd_text = os.environ.pop(GATE_VARIABLE, None)  # grandchildren must not inherit it
    if fd_text is None:
        return
    fd = int(fd_text)
    try:
        os.write(fd, b"ready\n")
        line = _read_line(fd)
    except OSError:  # the runner is gone
        line = b""
    finally:
        os.close(fd)
    if not line.strip():
        sys.stderr.write("gpusched: pre-started file not needed (run ended); exiting\n")
        sys.stderr.flush()
        os._exit(CANCELLED)
    os.environ.update(json.loads(line))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sys.stderr.write(
            "gpusched: CUDA was initialised before gpusched assigned cards (by a plugin loaded "
            "at start-up or by site-packages code); run with --prestart 0\n"
        )
        sys.stderr.flush()
        os._exit(CUDA_TOO_EARLY)
