"""The HTML pages render from the fixture database, and their empty and not-found states."""

from __future__ import annotations


def test_overview_page(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'href="/devices/h200/gdn"' in r.text and "triton changed" in r.text
    assert "/static/style.css" in r.text
    assert client.get("/static/style.css").status_code == 200


def test_device_page_has_table_and_charts(client):
    r = client.get("/devices/h200/gdn")
    assert r.status_code == 200
    assert r.text.count('class="shape-row"') == 3
    for chart in ('id="scatter"', 'id="history"', 'id="failures"', 'id="importance"'):
        assert chart in r.text
    assert r.text.count("<svg") >= 4 and "best-so-far" in r.text
    r = client.get("/devices/h200/gdn?param=consumer&shape=B4-T4096-H32")
    assert r.status_code == 200 and "Latency against consumer" in r.text


def test_device_without_campaigns_for_op(client):
    r = client.get("/devices/a100/kda")
    assert r.status_code == 200 and "No campaign for kda on a100" in r.text


def test_compare_and_campaign_pages(client):
    r = client.get("/compare?op=gdn&devices=h200&devices=a100")
    assert r.status_code == 200 and 'class="differs"' in r.text and "compare-table" in r.text
    assert client.get("/compare").status_code == 200
    r = client.get("/campaigns/2")
    assert r.status_code == 200
    for text in ("NVIDIA H200", "570.86.15", "12.8", "3.5.0", "Kernel hash", "40 trials, time limit 60 min", 'id="timeline"'):
        assert text in r.text


def test_not_found_page_is_html(client):
    r = client.get("/campaigns/4242")
    assert r.status_code == 404 and "no campaign with id 4242" in r.text and "<html" in r.text
    assert client.get("/devices/v100/gdn").status_code == 404


def test_text_from_the_database_is_escaped(tmp_path):
    # free text in the database (a trial's fault message, a workload's fields) reaches the pages escaped: the
    # fixture database holds no markup, so this test writes some
    from fastapi.testclient import TestClient

    from rewy_tune.db import open_db, queries
    from rewy_tune.server.app import create_app
    from server_fixture_db import H200, environment

    markup = "<script>alert(1)</script>"
    path = str(tmp_path / "x.db")
    db = open_db(path)
    with db.session() as s:
        cid = queries.create_campaign(s, device=H200, environment=environment(), op="gdn", policies=("R",),
                                      workload={"K": 64, "V": 64, "note": markup}, budget={"trials": 1}).id
        queries.add_trial(s, cid, number=0, schedule={"chunk_size": 64}, status="timeout", message=markup)
    db.close()
    with TestClient(create_app(path)) as c:
        pages = {u: c.get(u) for u in ("/devices/h200/gdn", f"/campaigns/{cid}")}
    for url, r in pages.items():
        assert r.status_code == 200 and "<script>alert" not in r.text, url
    assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in r.text for r in pages.values())  # shown, as text


def test_empty_database_pages(empty_client):
    r = empty_client.get("/")
    assert r.status_code == 200 and 'id="empty-state"' in r.text and "empty.db" in r.text
    assert empty_client.get("/compare").status_code == 200


def test_default_schedules_are_each_policys():
    # A KDA campaign on an H200 under both policies shows both built-in defaults (policy A's widens the reverse
    # scan), each once; the bare Schedule() default stays first
    from types import SimpleNamespace

    from rewy_tune.search import default_schedule
    from rewy_tune.server import views

    device = SimpleNamespace(cc_major=9, cc_minor=0)
    camp = SimpleNamespace(op="kda", policies=["R", "A"], workload={"K": 128, "V": 128, "dtype": "bf16"},
                           environment=SimpleNamespace(device=device))
    got = views._default_schedules([camp, camp])
    want = [default_schedule("kda", (9, 0), 128, 128, "bf16", p).to_dict() for p in ("R", "A")]
    assert got == [views.DEFAULT_SCHEDULE, *want] and want[0] != want[1]
