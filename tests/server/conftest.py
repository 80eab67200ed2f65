"""Dashboard fixtures: a fixture database written through `db.queries`, an empty one, a missing one."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rewy_tune.server.app import create_app

import server_fixture_db


@pytest.fixture(scope="session")
def fixture_db(tmp_path_factory) -> str:
    return server_fixture_db.build(str(tmp_path_factory.mktemp("dash") / "rewy.db"), trials=80)


@pytest.fixture(scope="session")
def client(fixture_db):
    with TestClient(create_app(fixture_db)) as c:
        yield c


@pytest.fixture
def empty_client(tmp_path):
    with TestClient(create_app(server_fixture_db.build_empty(str(tmp_path / "empty.db")))) as c:
        yield c


@pytest.fixture
def missing_client(tmp_path):
    path = tmp_path / "nowhere" / "missing.db"
    with TestClient(create_app(str(path))) as c:
        yield c, path
