"""The environment and command line of a child pytest process, and where its temporary files go."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from gpusched.execution.proctree import TAG_VARIABLE
from rl_e2e.ports import quiet_ports

NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "fuseblk", "lustre", "gpfs", "9p", "ceph"}
)


RAY_WORKER_NICENESS = "RAY_worker_niceness"
"""Ray's setting for the niceness of its worker processes (Ray's default: 15)."""
# Ray's longest socket path is RAY_TMPDIR/session_<date>_<time>_<us>_<pid>/sockets/plasma_store
# (64 bytes past RAY_TMPDIR with a 7-digit pid), and an AF_UNIX path has at most 107.
RAY_TMPDIR_MAX = 107 - 64
TMP_LEVEL = len("/gs") + 8  # one level of ``mkdtemp(prefix="gs")`` under the root


def child_env(
    base: Mapping[str, str],
    cards: Sequence[str],
    *,
    simulated: bool,
    ray_tmpdir: str,
    master_port: int,
    tag: str,
) -> dict[str, str]:
    """The child's variables: its cards, a fresh Ray temp dir and port, the job tag.

    ``RAY_ADDRESS`` is removed, never set to "": Ray treats "" as an address and
    would try to attach instead of starting a local cluster.

    Ray's workers run at the test's own priority (``RAY_worker_niceness=0``)
    unless the user set it: at Ray's default of 15 they get a small share of a
    core beside busy sibling files (figures in docs/reliability.md).
    """
    env = {key: value for key, value in base.items() if key != "RAY_ADDRESS"}
    env.update(card_env(cards))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["RAY_TMPDIR"] = ray_tmpdir
    env["MASTER_PORT"] = str(master_port)
    env[TAG_VARIABLE] = tag
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault(RAY_WORKER_NICENESS, "0")
    if simulated:
        env["GPUSCHED_SIMULATED"] = "1"
    else:
        env.pop("GPUSCHED_SIMULATED", None)
    return env


def card_env(cards: Sequence[str]) -> dict[str, str]:
    """The variables that depend on which cards a job got (sent at the gate of a warm start)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(cards)}


def filesystem_type(path: str, mounts: Iterable[str]) -> str | None:
    """The type of the filesystem holding ``path``, from lines of ``/proc/mounts``."""
    best, best_type = "", None
    target = os.path.realpath(path)
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount_point = parts[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, parts[2]
    return best_type


def is_network_fs(fs_type: str | None) -> bool:
    return fs_type is not None and (
        fs_type in NETWORK_FILESYSTEMS or fs_type.split(".")[0] in NETWORK_FILESYSTEMS
    )


def local_tmp_root(
    tmpdir: str | None, mounts: Iterable[str], levels: int = 1
) -> tuple[str, str | None]:
    """A short directory on local disk for per-job Ray temp dirs, and a warning if TMPDIR was unfit.

    Ray's socket paths must stay under 107 bytes and Ray hangs on NFS, so a
    network ``TMPDIR``, or one too long for ``levels`` short temp dirs under it
    (one per job; a cluster node adds its own), is replaced by ``/tmp`` (or
    ``/dev/shm``).
    """
    mounts = list(mounts)
    candidate = tmpdir or "/tmp"
    fs_type = filesystem_type(candidate, mounts)
    if not is_network_fs(fs_type) and len(candidate) <= RAY_TMPDIR_MAX - levels * TMP_LEVEL:
        return candidate, None
    for fallback in ("/tmp", "/dev/shm"):
        if os.path.isdir(fallback) and not is_network_fs(filesystem_type(fallback, mounts)):
            why = f"is on {fs_type}" if is_network_fs(fs_type) else "is too long for Ray's sockets"
            return fallback, f"TMPDIR={candidate} {why}; per-job RAY_TMPDIR goes under {fallback}"
    return candidate, f"TMPDIR={candidate} is on {fs_type} and no local fallback was found"


def read_mounts() -> list[str]:
    try:
        return Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []


class PortPool:
    """Free TCP ports, never the same one twice in a run (each job's ``MASTER_PORT``).

    Drawn outside the kernel's ephemeral range (:func:`rl_e2e.ports.quiet_ports`):
    rank 0 binds the port only when its test gets there, and meanwhile other
    files' processes are handed ephemeral ports all the time.
    """

    def __init__(self) -> None:
        self._given: set[int] = set()

    def take(self) -> int:
        for _ in range(100):
            (port,) = quiet_ports(1)
            if port not in self._given:
                self._given.add(port)
                return port
        raise RuntimeError("no free TCP port found after 100 tries")


def plugin_args() -> list[str]:
    """``-p gpusched.plugin`` only where the entry point will not load it already.

    Passing it while the ``pytest11`` entry point is active makes pytest fail with
    "Plugin already registered under a different name".
    """
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return ["-p", "gpusched.plugin"]
    return [] if _entry_point_registered() else ["-p", "gpusched.plugin"]


@functools.cache
def _entry_point_registered() -> bool:
    """Whether the ``pytest11`` entry point names the plugin (scanning them costs ~10 ms: once)."""
    from importlib.metadata import entry_points  # not at import: the fork server starts sooner

    return any(ep.value == "gpusched.plugin" for ep in entry_points(group="pytest11"))
