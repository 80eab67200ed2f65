"""`rewy-tune serve`: the read-only dashboard and JSON API on uvicorn."""

from __future__ import annotations

import errno
import socket

from rich.console import Console

from rewy_tune.db.engine import as_db_url, default_db_url, display_url, sqlite_file


def listen_problem(host: str, port: int) -> str | None:
    """Why the dashboard could not listen on host:port (an unknown host, a port in use or not allowed), or None.
    Checked before uvicorn starts, whose own report ("[Errno 98] error while attempting to bind ...") names
    neither option; a port taken between this check and uvicorn's bind still gets uvicorn's report."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host {host!r}: not a host name or address ({getattr(exc, 'strerror', None) or exc})"
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind(address)
    except OSError as exc:
        hint = {errno.EADDRINUSE: "; choose another --port", errno.EACCES: "; ports below 1024 need privileges",
                errno.EADDRNOTAVAIL: "; --host must be an address of this machine (127.0.0.1, 0.0.0.0, ...)"}
        return f"--host {host!r} --port {port}: cannot listen there ({exc.strerror or exc}){hint.get(exc.errno, '')}"
    return None


def run_serve(db: str | None, host: str, port: int, console: Console) -> None:
    import uvicorn

    from rewy_tune.cli.campaign import fail
    from rewy_tune.server.app import create_app

    problem = listen_problem(host, port)
    if problem:
        fail(console, problem)
    url = as_db_url(db) if db else default_db_url()
    path = sqlite_file(url)
    note = "" if path is None or path.is_file() else " (no file yet: the dashboard shows how to fill it)"
    console.print(f"rewy-tune dashboard on http://{host}:{port}/ reading {display_url(url)}{note}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]note:[/yellow] listening on {host}: reachable from other machines (read-only)")
    uvicorn.run(create_app(url), host=host, port=port, log_level="warning")
