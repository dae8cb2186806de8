"""Ports chosen now and bound later: never where the kernel hands ports out meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpusched.execution.childenv import PortPool
from rl_e2e import ports
from rl_e2e.ports import RAY_WORKER_PORTS_END, quiet_ports
from trainer.controller.rendezvous import free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return low, high


def _quiet(port: int) -> bool:
    low, high = _ephemeral_range()
    return port > RAY_WORKER_PORTS_END and not low <= port <= high


def test_ports_are_distinct_and_never_ones_the_kernel_hands_out():
    found = quiet_ports(9)
    assert len(set(found)) == 9
    assert all(_quiet(port) for port in found), found


def test_a_port_something_listens_on_is_never_chosen(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", quiet_ports(1)[0]))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(
            ports.random, "sample", lambda pool, k: [taken, *(p for p in pool if p != taken)]
        )
        assert taken not in quiet_ports(3)


def test_too_few_free_ports_is_an_error_naming_the_range(monkeypatch, tmp_path):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{RAY_WORKER_PORTS_END + 1}\t65535\n")  # nothing left outside it
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", narrow)
    with pytest.raises(
        RuntimeError, match=f"fewer than 1 free TCP ports .*{RAY_WORKER_PORTS_END + 1}-65535"
    ):
        quiet_ports(1)


def test_each_jobs_master_port_is_new_and_quiet():
    pool = PortPool()
    given = [pool.take() for _ in range(50)]
    assert len(set(given)) == 50
    assert all(_quiet(port) for port in given), given


def test_a_trainer_groups_rank0_port_is_quiet_on_every_interface():
    port = free_port("")
    assert _quiet(port), port
    with socket.socket() as sock:
        sock.bind(("", port))  # still free where rank 0 binds it
