"""``--ray ADDRESS`` checked before Ray is asked: each malformed address is one line, exit code 4.

``parse_address`` is pure; the command-line cases run the real ``gpusched``
(no cluster is needed: the address is refused before collection).
"""

from __future__ import annotations

import re

import pytest

from conftest import gpusched, write_suite
from rl_e2e.reach import GcsAddress, parse_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("head:6379", GcsAddress("head", 6379)),
        ("10.0.0.7:6390", GcsAddress("10.0.0.7", 6390)),
        ("[::1]:6379", GcsAddress("::1", 6379)),
    ],
)
def test_host_and_port_are_read(text, expected):
    assert parse_address(text) == expected
    assert str(parse_address(text)) == text


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("http://head:8265", "is a web address (the dashboard's?)"),
        ("https://head:8265", "is a web address (the dashboard's?)"),
        ("grpc://head:6379", "has a scheme grpc:// that --ray does not know"),
        (":6379", "is a port without a host"),
        ("6379", "is a port without a host"),
        ("head", "names no port"),
        ("head:", "has no valid port ('')"),
        ("head:http", "has no valid port ('http')"),
        ("head:70000", "has no valid port ('70000')"),
        ("::1:6379", "is not HOST:PORT"),
    ],
)
def test_malformed_addresses_name_the_problem(text, problem):
    with pytest.raises(ValueError, match="^" + re.escape(problem)):
        parse_address(text)


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("http://head:8265", "is a web address (the dashboard's?); --ray takes the address"),
        (":6379", "is a port without a host: HOST:PORT"),
    ],
)
def test_a_malformed_address_is_one_line_and_exit_4(tmp_path, address, problem):
    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    result = gpusched(tmp_path, "run", ".", "--ray", address)
    assert result.returncode == 4, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gpusched: error: --ray {address}: {problem}"), lines
    assert result.stdout == ""


def test_something_else_listening_is_not_a_cluster(tmp_path):
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
        address = f"127.0.0.1:{server.server_address[1]}"
        result = gpusched(tmp_path, "plan", ".", "--ray", address)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 4, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1, result.stderr
    assert error[0].startswith(
        f"gpusched: error: --ray {address}: something listens at {address} but it is not "
        "a Ray cluster's head"
    ), error
