"""The JSON API against a fixture database: every endpoint, pagination, validation, emptiness, read-only."""

from __future__ import annotations

import pytest

from rewy_tune.db.engine import open_db
from rewy_tune.db import queries


def test_overview_rows_and_freshness(client):
    data = client.get("/api/overview").json()
    assert data["empty"] is False
    rows = {(r["device"], r["op"], r["policy"]): r for r in data["rows"]}
    assert set(rows) == {("a100", "gdn", "R"), ("h200", "gdn", "R"), ("h200", "deltanet", "R")}
    h = rows["h200", "gdn", "R"]
    assert h["trials"] == 120 and h["campaigns"] == 2 and h["winners"] == 6
    assert h["fresh"] == 3 and h["stale_fields"] == ["triton"]  # the old campaign's winners
    assert h["best_speedup"] > 1
    assert rows["a100", "gdn", "R"]["fresh"] == 3


def test_devices(client):
    devices = client.get("/api/devices").json()
    assert [d["short_name"] for d in devices] == ["a100", "h200"]
    assert devices[1]["ops"] == ["deltanet", "gdn"] and devices[1]["compute_capability"] == "9.0"


@pytest.mark.parametrize("params, n", [({}, 12), ({"device": "h200"}, 9), ({"device": "h200", "op": "gdn"}, 6),
                                       ({"op": "deltanet"}, 3), ({"policy": "A"}, 0)])
def test_winners_filters(client, params, n):
    r = client.get("/api/winners", params=params)
    assert r.status_code == 200 and len(r.json()) == n
    for w in r.json():
        assert all(w[k] == v for k, v in params.items())


def test_device_op_page_data(client):
    d = client.get("/api/devices/h200/ops/gdn").json()
    assert d["trials"] == 120 and len(d["table"]) == 3
    row = d["table"][0]
    assert row["fla_ms"] and row["best_ms"] and row["default_ms"] and row["speedup"] > 1
    assert row["spread"]["n"] == 7
    assert d["importance"][0]["parameter"] == "consumer_cfg.num_warps"  # the fixture's strongest effect
    assert sum(d["status_counts"].values()) == 120 and d["status_counts"]["ok"] > 60
    assert d["best_so_far"] == sorted(d["best_so_far"], key=lambda p: -p["latency_ms"])
    chosen = client.get("/api/devices/h200/ops/gdn", params={"shape": "B1-T2048-H16",
                                                             "param": "consumer"}).json()
    assert chosen["shape"] == "B1-T2048-H16" and chosen["parameter"] == "consumer"


def test_campaigns_and_pagination(client):
    page = client.get("/api/campaigns", params={"limit": 2}).json()
    assert page["total"] == 4 and [c["id"] for c in page["items"]] == [4, 3]
    assert page["items"][0]["trials"] == 80
    assert [c["id"] for c in client.get("/api/campaigns", params={"limit": 2, "offset": 2}).json()["items"]] == [2, 1]
    assert client.get("/api/campaigns", params={"device": "a100"}).json()["total"] == 1
    assert client.get("/api/campaigns", params={"status": "interrupted"}).json()["total"] == 1

    detail = client.get("/api/campaigns/2").json()
    prov = detail["provenance"]
    assert prov["gpu_name"] == "NVIDIA H200" and prov["driver"] == "570.86.15" and prov["cuda"] == "12.8"
    assert prov["triton"] == "3.5.0" and not prov["freshness"]["fresh"]
    assert detail["campaign"]["budget"]["trials"] == 40

    seen = []
    for offset in range(0, 80, 30):
        t = client.get("/api/campaigns/3/trials", params={"limit": 30, "offset": offset}).json()
        assert t["total"] == 80
        seen += [x["number"] for x in t["items"]]
    assert seen == list(range(80))
    ok = client.get("/api/campaigns/3/trials", params={"status": "ok", "limit": 1000}).json()
    assert ok["total"] == len(ok["items"]) and all(x["status"] == "ok" for x in ok["items"])
    assert client.get("/api/campaigns/3/trials", params={"offset": 500}).json()["items"] == []


def test_compare(client):
    d = client.get("/api/compare", params={"op": "gdn", "devices": "h200,a100"}).json()
    assert d["devices"] == ["h200", "a100"] and len(d["buckets"]) == 3
    b = d["buckets"][0]
    assert set(b["winners"]) == {"h200", "a100"}

    def flat(schedule, prefix=""):  # the test's own flattening, not views'
        out = {}
        for key, value in schedule.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return out

    h200, a100 = (flat(b["winners"][dev]["schedule"]) for dev in ("h200", "a100"))
    assert {f["name"]: f["values"] for f in b["fields"]} == {n: {"h200": h200[n], "a100": a100[n]} for n in h200}
    want = sorted(n for n in h200 if h200[n] != a100[n])
    assert want and sorted(b["differing"]) == want  # the fixture's winners differ (chunk_size)
    assert all(f["differs"] == (f["name"] in want) for f in b["fields"])
    cross = {(x["schedule_of"], x["measured_on"]): x for x in b["cross_device"]}
    on_h200 = cross["a100", "h200"]  # the fixture measured a100's winner on the h200, not h200's on the a100
    assert on_h200["slowdown"] == pytest.approx(on_h200["latency_ms"] / on_h200["own_winner_ms"])
    assert cross["h200", "a100"]["latency_ms"] is None and cross["h200", "a100"]["slowdown"] is None
    same = client.get("/api/compare?op=gdn&devices=h200&devices=a100").json()
    assert same["devices"] == ["h200", "a100"]


@pytest.mark.parametrize("url", [
    "/api/winners?op=mamba", "/api/winners?policy=Z", "/api/devices/h200/ops/mamba", "/api/compare?op=x&devices=a,b",
    "/api/compare?op=gdn&devices=h200", "/api/compare?op=gdn", "/api/campaigns/abc", "/api/campaigns/0",
    "/api/campaigns/1/trials?limit=1001", "/api/campaigns/1/trials?limit=0", "/api/campaigns/1/trials?offset=-1",
    "/api/campaigns/1/trials?status=great", "/api/devices/h200/ops/gdn?param=warp_speed",
    "/api/winners?device=H200%27%20OR%201=1", "/api/campaigns/99999999999999999999999",
])
def test_malformed_parameters_are_422(client, url):
    assert client.get(url).status_code == 422, url


@pytest.mark.parametrize("url", [
    "/api/campaigns/999", "/api/campaigns/999/trials", "/api/winners?device=v100", "/api/devices/v100/ops/gdn",
    "/api/compare?op=gdn&devices=h200,v100", "/api/devices/h200/ops/gdn?shape=B9-T9-H9",
])
def test_unknown_ids_and_names_are_404(client, url):
    r = client.get(url)
    assert r.status_code == 404, url
    assert r.json()["detail"]


def test_sql_injection_looking_values_are_harmless(client, fixture_db):
    for url in ["/api/winners?device=h200;DROP TABLE winners", "/api/winners?device=h200' OR '1'='1",
                "/api/campaigns?device=a%25", "/api/devices/h200/ops/gdn?shape=B1-T2048-H16'--",
                "/api/campaigns/1%20OR%201=1/trials", "/api/compare?op=gdn&devices=h200,a100;--"]:
        assert client.get(url).status_code in (404, 422), url
    # a pattern-valid name that would match everything as LIKE or SQL text matches nothing
    assert client.get("/api/campaigns", params={"device": "h200-or-1"}).json()["total"] == 0
    db = open_db(fixture_db, read_only=True)
    with db.session() as s:
        assert len(queries.winners(s)) == 12 and len(queries.devices(s)) == 2
    db.close()


def test_no_write_methods(client):
    schema = client.get("/openapi.json").json()
    assert all(set(ops) == {"get"} for ops in schema["paths"].values())
    for path in ["/api/winners", "/api/campaigns", "/api/devices", "/api/campaigns/1", "/"]:
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            assert client.request(method, path).status_code == 405, (method, path)
    for path in ["/devices/h200/gdn", "/campaigns/1", "/compare"]:
        assert client.post(path).status_code == 405


def test_openapi_lists_every_api_route(client):
    schema = client.get("/openapi.json").json()
    assert {"/api/overview", "/api/devices", "/api/devices/{device}/ops/{op}", "/api/winners", "/api/campaigns",
            "/api/campaigns/{campaign_id}", "/api/campaigns/{campaign_id}/trials", "/api/compare"} <= set(schema["paths"])
    assert all(set(ops) == {"get"} for ops in schema["paths"].values())
    op_param = next(p for p in schema["paths"]["/api/winners"]["get"]["parameters"] if p["name"] == "op")
    assert "deltanet" in str(op_param["schema"])


def test_empty_database(empty_client):
    o = empty_client.get("/api/overview").json()
    assert o["empty"] is True and o["rows"] == [] and o["database"].endswith("empty.db")
    assert empty_client.get("/api/devices").json() == []
    assert empty_client.get("/api/winners").json() == []
    assert empty_client.get("/api/campaigns").json()["total"] == 0
    assert empty_client.get("/api/campaigns/1").status_code == 404
    assert empty_client.get("/api/winners?device=h200").status_code == 404


def test_missing_database_file_is_not_created(missing_client):
    client, path = missing_client
    o = client.get("/api/overview").json()
    assert o["empty"] is True and "no rewy-tune database" in o["database_error"]
    assert client.get("/api/campaigns").json()["items"] == []
    page = client.get("/")
    assert page.status_code == 200 and "missing.db" in page.text and "rewy-tune --device cpu" in page.text
    assert not path.exists() and not path.parent.exists()


def test_running_campaign_is_read_fresh_and_finished_ones_are_cached(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from rewy_tune.server import views
    from rewy_tune.server.app import create_app
    from server_fixture_db import H200, environment

    decoded = []  # campaigns whose trials were read and decoded (views' cache sits in front of this)
    real_points = views.q.trial_points
    monkeypatch.setattr(views.q, "trial_points", lambda s, ids: decoded.append(tuple(ids)) or real_points(s, ids))

    path = str(tmp_path / "live.db")
    writer = open_db(path)
    with writer.session() as s:
        cid = queries.create_campaign(s, device=H200, environment=environment(), op="kda", policies=("R",),
                                      workload={"K": 128, "V": 128}, budget={"trials": 3}).id
        queries.add_trial(s, cid, number=0, schedule={"chunk_size": 64}, status="ok", samples_ms={"B1-T64-H1": [1.0]})
    with TestClient(create_app(path)) as client:
        assert client.get("/api/devices/h200/ops/kda").json()["trials"] == 1
        with writer.session() as s:
            queries.add_trial(s, cid, number=1, schedule={"chunk_size": 32}, status="timeout")
        assert client.get("/api/devices/h200/ops/kda").json()["trials"] == 2
        assert len(decoded) == 2  # running: read afresh on every request
        with writer.session() as s:
            queries.finish_campaign(s, cid)
        assert client.get("/api/devices/h200/ops/kda").json()["trials"] == 2
        assert client.get("/api/devices/h200/ops/kda").json()["trials"] == 2
        assert len(decoded) == 3  # finished: decoded once, the second request served from the cache
        with writer.session() as s:  # a trial overwritten after the end still changes the key (count)
            queries.add_trial(s, cid, number=2, schedule={"chunk_size": 16}, status="constraint")
        assert client.get("/api/devices/h200/ops/kda").json()["status_counts"] == {"ok": 1, "timeout": 1,
                                                                                    "constraint": 1}
        assert len(decoded) == 4
    writer.close()
