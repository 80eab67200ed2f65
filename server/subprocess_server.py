"""`rewy-tune serve` in a child process on a free localhost port, for the browser test and the screenshot
script: `with served(db) as url: ...` waits until /api/devices answers and stops the server afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


class ServerDidNotStart(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(db: str, timeout_s: float = 60.0) -> Iterator[str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-c", "from rewy_tune.cli.main import main; main()", "serve", "--db", db,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/api/devices", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
                raise ServerDidNotStart(f"rewy-tune serve did not come up on {url}: {out[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
