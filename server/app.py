"""The dashboard application: `create_app(db_url)` serves the HTML pages and the JSON API, read-only.

The database is opened read-only on first use and kept open. A missing file is not an error: the pages
show how to fill it, the API answers empty lists, and the file is looked for again on the next request
(a read-only open never creates it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.orm import Session

from rewy_tune.db.engine import Database, as_db_url, default_db_url, display_url, open_db
from rewy_tune.db.errors import DatabaseError

from .views import NotFound

HERE = Path(__file__).resolve().parent


class DashboardState:
    """The database behind one app: opened lazily, read-only, shared by the request threads."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.label = display_url(url)
        self.error: str | None = None
        self._db: Database | None = None
        self._lock = threading.Lock()

    def database(self) -> Database | None:
        with self._lock:
            if self._db is None:
                try:
                    self._db = open_db(self.url, read_only=True)
                    self.error = None
                except DatabaseError as exc:
                    self.error = str(exc)
            return self._db

    @contextlib.contextmanager
    def session(self) -> Iterator[Session | None]:
        db = self.database()
        if db is None:
            yield None
            return
        with db.session() as s:
            yield s

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


def create_app(db_url: str | None = None) -> FastAPI:
    from . import api, pages

    url = as_db_url(db_url) if db_url else default_db_url()
    state = DashboardState(url)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="rewy-tune dashboard", version="1",
                  description="Read-only view of rewy-tune campaigns, trials and winning schedules. "
                              "Every HTML page has a JSON twin under /api.",
                  lifespan=lifespan)
    app.state.dashboard = state
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.include_router(api.router)
    app.include_router(pages.router)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):
        if request.url.path.startswith("/api"):
            return JSONResponse({"detail": str(exc)}, status_code=404)
        return pages.render(request, "error.html", {"message": str(exc), "code": 404}, status_code=404)

    return app
