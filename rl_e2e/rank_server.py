"""What the fork server of :func:`rl_e2e.distributed.run_distributed` imports before it forks ranks.

multiprocessing's fork server imports the modules named by
``set_forkserver_preload`` once, as it starts, and every rank it forks then
finds torch and ``torch.distributed`` imported. Importing them runs no torch
operation, starts no thread and does not initialise CUDA (a process does that
at its first CUDA call, which only a rank makes), so each rank still starts
without any torch, gloo or CUDA state: nothing here may use torch beyond
importing it, and the server imports nothing else of the caller's (not its
``__main__``, whose imports might touch CUDA).

The server leaves when its "alive" pipe reaches end-of-file, that is when its
caller is gone (the ranks close their copies, see
``rl_e2e.distributed._die_with_caller``). It then exits at once, skipping the
interpreter's finalisation, which with torch loaded takes 0.4 CPU s and one to
three seconds: for that long the ranks, killed by ``PR_SET_PDEATHSIG`` only
when the server has exited, would outlive a caller killed with SIGKILL, and
gpusched, which gives a test file's processes half a second to end after
pytest, would count the server among what the file left behind.
"""

from __future__ import annotations

import atexit
import os

import torch  # noqa: F401 - imported once, for every rank the server forks
import torch.distributed  # noqa: F401

_SERVER_PID = os.getpid()


def _exit_now() -> None:
    """The server's first exit handler (registered last): end the process without finalising.

    A no-op in the processes the server forks, which inherit the handler.
    """
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_exit_now)
