"""The NCCL loopback guard: probe only when needed, never override, set loopback on failure."""

from __future__ import annotations

import ipaddress
import os
from unittest import mock

import pytest

from rl_e2e.netguard import (
    GUARD_VALUES,
    apply_loopback_guard,
    host_reaches_itself,
    missing_guard_vars,
    outbound_ip,
)

# RFC 5737 TEST-NET-2: not an address of this host, so it cannot be bound and
# the probe fails without any packet being sent.
FAKE_FOREIGN_IP = "198.51.100.7"


class CountingProbe:
    """A probe that records how often it was called and answers ``reachable``."""

    def __init__(self, reachable: bool) -> None:
        self.reachable = reachable
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.reachable


def test_fake_outbound_address_fails_the_probe_and_sets_loopback():
    env: dict[str, str] = {}
    set_now = apply_loopback_guard(env, probe=lambda: host_reaches_itself(lambda: FAKE_FOREIGN_IP))
    assert set_now == GUARD_VALUES
    assert env == {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_reachable_address_sets_nothing():
    env: dict[str, str] = {}
    assert apply_loopback_guard(env, probe=lambda: host_reaches_itself(lambda: "127.0.0.1")) == {}
    assert env == {}


def test_loopback_address_answers_the_real_probe():
    assert host_reaches_itself(lambda: "127.0.0.1") is True


def test_no_outbound_address_counts_as_unreachable():
    assert host_reaches_itself(lambda: None) is False


def test_nothing_probed_when_all_set():
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "NCCL_SOCKET_IFNAME": "eth0"}
    env["GLOO_SOCKET_IFNAME"] = "eth1"
    probe = CountingProbe(reachable=False)
    assert apply_loopback_guard(env, probe=probe) == {}
    assert probe.calls == 0
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_probes_once_and_never_overrides_a_set_value():
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    probe = CountingProbe(reachable=False)
    assert apply_loopback_guard(env, probe=probe) == {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    assert probe.calls == 1
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_empty_value_counts_as_missing():
    assert missing_guard_vars({"NCCL_SOCKET_IFNAME": " ", "GLOO_SOCKET_IFNAME": "lo"}) == {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "NCCL_SOCKET_IFNAME": "lo",
    }


def test_defaults_to_os_environ():
    """The guard writes into this process's environment: every variable it sets is taken out
    again after the test (``monkeypatch.delenv`` of an absent name would restore nothing, and
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` would stop every later ``ray start --address``
    in this process)."""
    before = dict(os.environ)
    with mock.patch.dict(os.environ):
        for name in GUARD_VALUES:
            os.environ.pop(name, None)
        os.environ["GLOO_SOCKET_IFNAME"] = "keep"
        apply_loopback_guard(probe=CountingProbe(reachable=False))
        assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
        assert os.environ["GLOO_SOCKET_IFNAME"] == "keep"
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert dict(os.environ) == before


def test_outbound_ip_is_an_ipv4_address_or_none():
    ip = outbound_ip()
    if ip is None:
        pytest.skip("this host has no IPv4 route")
    assert ipaddress.ip_address(ip).version == 4
