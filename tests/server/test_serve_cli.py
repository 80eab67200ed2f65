"""`rewy-tune serve`'s own checks: a port in use or a host it cannot listen on is one clear line and exit 2 before
uvicorn starts; a free port still serves the dashboard."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rewy_tune.cli.serve import listen_problem
from rewy_tune.server.subprocess_server import ServerDidNotStart, free_port, served


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "serve", *args], capture_output=True,
                          text=True, timeout=60)


def test_a_port_in_use_is_named_with_the_option_to_change(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--db", str(tmp_path / "d.db"), "--port", str(port))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines == [f"error: --host '127.0.0.1' --port {port}: cannot listen there (Address already in use); "
                     "choose another --port"], proc.stdout
    assert not (tmp_path / "d.db").exists()


@pytest.mark.parametrize("host, needle", [
    ("no-such-host.invalid", "--host 'no-such-host.invalid': not a host name or address"),
    ("192.0.2.1", "--host '192.0.2.1' --port PORT: cannot listen there"),  # TEST-NET-1: no machine's own address
])
def test_a_host_it_cannot_listen_on_is_named(host, needle):
    port = free_port()
    problem = listen_problem(host, port)
    assert problem is not None and problem.startswith(needle.replace("PORT", str(port))), problem
    proc = _serve("--host", host, "--port", str(port))
    assert proc.returncode == 2 and needle.replace("PORT", str(port)) in proc.stdout, proc.stdout + proc.stderr


def test_a_free_port_passes_the_check_and_serves(fixture_db):
    assert listen_problem("127.0.0.1", free_port()) is None
    try:
        with served(fixture_db) as url:
            import httpx

            assert httpx.get(url + "/api/devices", timeout=5).status_code == 200
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))
