"""Schemathesis over the OpenAPI schema against the fixture database: no request gets a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

import server_fixture_db  # noqa: E402
from rewy_tune.server.app import create_app  # noqa: E402

_app = None


def _get_app():
    global _app
    if _app is None:
        import tempfile
        from pathlib import Path

        path = server_fixture_db.build(str(Path(tempfile.mkdtemp(prefix="rewy-fuzz-")) / "rewy.db"), trials=30)
        _app = create_app(path)
    return _app


def test_no_server_errors():
    """Each API operation, `max_examples` generated requests (schemathesis strategies driven by hypothesis)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_asgi("/openapi.json", _get_app())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    seen: dict[int, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:
            response = case.call()
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code in (200, 404, 422), (case.method, case.formatted_path, case.query,
                                                              response.status_code, response.text[:300])

        check()
    print("status codes:", dict(sorted(seen.items())))
    assert seen.get(200) and seen.get(422)
