"""Item 7: the child's environment: RAY_ADDRESS absent, a short local RAY_TMPDIR, separate Ray clusters."""

from __future__ import annotations

import pytest
import scenarios
from deadlines import hang_guard

from gpusched.execution.childenv import child_env, filesystem_type, is_network_fs, local_tmp_root

MOUNTS = [
    "/dev/sda1 / ext4 rw 0 0",
    "tmpfs /dev/shm tmpfs rw 0 0",
    "server:/export/home /home nfs4 rw 0 0",
    "//nas/scratch /scratch cifs rw 0 0",
    "sshfs#me@host: /mnt/remote fuse.sshfs rw 0 0",
]


@pytest.mark.parametrize("parent", ["127.0.0.1:6379", "", "auto"])
def test_ray_address_is_absent_not_empty(parent):
    env = child_env(
        {"RAY_ADDRESS": parent, "PATH": "/bin"},
        ("0",),
        simulated=True,
        ray_tmpdir="/tmp/gsx",
        master_port=29500,
        tag="t",
    )
    assert "RAY_ADDRESS" not in env
    assert env["RAY_TMPDIR"] == "/tmp/gsx" and env["PATH"] == "/bin"


@pytest.mark.parametrize(("parent", "expected"), [({}, "0"), ({"RAY_worker_niceness": "15"}, "15")])
def test_ray_workers_keep_the_tests_priority_unless_the_user_says(parent, expected):
    env = child_env(
        {"PATH": "/bin", **parent}, (), simulated=False, ray_tmpdir="/tmp/g", master_port=1, tag="t"
    )
    assert env["RAY_worker_niceness"] == expected


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/me/tmp", "nfs4"),
        ("/scratch/x", "cifs"),
        ("/mnt/remote/t", "fuse.sshfs"),
        ("/tmp", "ext4"),
        ("/dev/shm/a", "tmpfs"),
    ],
)
def test_filesystem_type_takes_the_longest_mount(path, kind):
    assert filesystem_type(path, MOUNTS) == kind


@pytest.mark.parametrize("tmpdir", ["/home/me/tmp", "/scratch/x", "/mnt/remote/t"])
def test_network_tmpdir_falls_back_to_local_disk_with_a_warning(tmpdir):
    root, warning = local_tmp_root(tmpdir, MOUNTS)
    assert root == "/tmp"
    assert (
        warning is not None
        and tmpdir in warning
        and "per-job RAY_TMPDIR goes under /tmp" in warning
    )
    assert is_network_fs(filesystem_type(tmpdir, MOUNTS))


def test_local_short_tmpdir_is_kept():
    assert local_tmp_root("/tmp", MOUNTS) == ("/tmp", None)
    root, warning = local_tmp_root("/tmp/" + "x" * 60, MOUNTS)
    assert root == "/tmp" and "too long" in warning


def test_a_tmpdir_is_kept_only_if_ray_s_sockets_fit_under_the_levels_made_in_it():
    """The longest socket path Ray makes under a per-job dir must stay within 107 bytes."""
    session = "/session_2026-11-29_03-40-03_996063_1234567/sockets/plasma_store"
    for levels in (1, 2):
        for length in (20, 30, 40):
            tmpdir = "/tmp/" + "x" * (length - len("/tmp/"))
            root, _ = local_tmp_root(tmpdir, MOUNTS, levels)
            longest = len(root) + levels * len("/gsabcdefgh") + len(session)
            assert longest <= 107, (levels, length, root)
            assert (root == tmpdir) == (length + levels * 11 + len(session) <= 107)


@pytest.mark.timeout(hang_guard(240))
def test_two_files_start_two_separate_ray_clusters(checked):
    pytest.importorskip("ray")
    observation = scenarios.two_ray_clusters()
    checked(observation)
    infos = observation.details["infos"]
    for info in infos:
        assert len(info["ray_tmpdir"]) < 40  # Ray's socket paths stay far under 107 bytes
    assert infos[0]["master_port"] != infos[1]["master_port"]
    # Ray's workers run at the test's own priority, not Ray's default niceness 15.
    assert [info["worker_nice"] for info in infos] == [info["test_nice"] for info in infos]
