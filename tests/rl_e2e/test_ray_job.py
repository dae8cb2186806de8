"""The pure parts of the ``ray start --head`` fixture: the ports it picks, the status it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_e2e.ray_job import job_status, quiet_ports


@pytest.mark.parametrize(
    ("printed", "status"),
    [
        ("------------------------------------------\nJob 'e2e-1a2b' succeeded\n", "SUCCEEDED"),
        ("Job 'e2e-1a2b' failed\nStatus message: exit code 1", "FAILED"),
        ("Job 'e2e-1a2b' was stopped", "STOPPED"),
        ("Status for job 'e2e-1a2b': RUNNING", "RUNNING"),
        ("Status for job 'e2e-1a2b': PENDING", "PENDING"),
        ("Traceback (most recent call last): ConnectionError", None),
    ],
)
def test_the_status_ray_job_status_prints(printed, status):
    assert job_status(printed) == status


def test_ports_are_never_ones_the_kernel_hands_out():
    """Outside ip_local_port_range: no bind(0) or connect() elsewhere can take them meanwhile."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = quiet_ports(9)
    assert len(set(ports)) == 9
    assert all(port >= 20000 and not low <= port <= high for port in ports)
