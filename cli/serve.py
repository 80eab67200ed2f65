"""`rewy-tune serve`: the read-only dashboard and JSON API on uvicorn."""

from __future__ import annotations

from rich.console import Console

from rewy_tune.db.engine import as_db_url, default_db_url, display_url, sqlite_file


def run_serve(db: str | None, host: str, port: int, console: Console) -> None:
    import uvicorn

    from rewy_tune.server.app import create_app

    url = as_db_url(db) if db else default_db_url()
    path = sqlite_file(url)
    note = "" if path is None or path.is_file() else " (no file yet: the dashboard shows how to fill it)"
    console.print(f"rewy-tune dashboard on http://{host}:{port}/ reading {display_url(url)}{note}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]note:[/yellow] listening on {host}: reachable from other machines (read-only)")
    uvicorn.run(create_app(url), host=host, port=port, log_level="warning")
