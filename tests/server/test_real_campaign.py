"""The dashboard against a real H200 campaign database (issue #7), always on a copy in tmp_path.

benchmarks/results/h200-campaign-gdn2-2026-11-30.db: `rewy-tune --device h200 --op gdn2 --policy R --shapes
1,2048,4 1,8192,4 1,2048,16 1,8192,16 --trials 8 --compile-jobs 8`, killed at its job's time limit. Four
campaigns (one per shape bucket) were left 'running'; 11 trials (ok, constraint, compile_error), all in the
first two; an FLA baseline for the first bucket only; no winners (promotion never ran).

The expected numbers are read from the file with sqlite3, not through the code under test.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rewy_tune.server import views
from rewy_tune.server.app import create_app

REAL_DB = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-campaign-gdn2-2026-11-30.db"
SHAPES = ["B1-T2048-H4", "B1-T2048-H16", "B1-T8192-H4", "B1-T8192-H16"]  # the device page's order: T, then B*H
BUCKET_OF = {1: "B1-T2048-H4", 2: "B1-T8192-H4", 3: "B1-T2048-H16", 4: "B1-T8192-H16"}
LAST_TRIAL = datetime(2026, 11, 30, 7, 19, 31)  # the newest trial row (seconds)
SOON = datetime(2026, 11, 30, 7, 25, 0)  # six minutes after it: cannot tell a live run from a killed one
LATER = datetime(2026, 11, 30, 12, 0, 0)  # hours after it: the run has stopped

pytestmark = pytest.mark.skipif(not REAL_DB.is_file(), reason=f"{REAL_DB} is not in this checkout")


def _copy(directory: Path) -> Path:
    path = directory / "h200-gdn2.db"
    shutil.copyfile(REAL_DB, path)
    return path


def _facts(path: Path) -> dict:
    """What the file holds, straight from SQLite."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        trials = con.execute("SELECT campaign_id, number, status, medians_ms, message FROM trials").fetchall()
        baselines = con.execute("SELECT campaign_id, shape, median_ms FROM baselines").fetchall()
        campaigns = con.execute("SELECT id, status, finished_at FROM campaigns ORDER BY id").fetchall()
        winners = con.execute("SELECT count(*) FROM winners").fetchone()[0]
    finally:
        con.close()
    by_campaign: dict[int, dict[str, int]] = {}
    for cid, _, status, _, _ in trials:
        by_campaign.setdefault(cid, {}).setdefault(status, 0)
        by_campaign[cid][status] += 1
    best: dict[str, float] = {}
    for _, _, status, medians, _ in trials:
        if status == "ok":
            for shape, ms in json.loads(medians).items():
                best[shape] = min(best.get(shape, float("inf")), ms)
    return {"trials": trials, "by_campaign": by_campaign, "baselines": baselines, "campaigns": campaigns,
            "winners": winners, "best": best}


@pytest.fixture(scope="module")
def real_db(tmp_path_factory) -> Path:
    return _copy(tmp_path_factory.mktemp("real"))


@pytest.fixture(scope="module")
def facts(real_db) -> dict:
    return _facts(real_db)


@pytest.fixture
def at(monkeypatch):
    """Set the dashboard's clock (naive UTC, like the database)."""
    def set_now(now: datetime) -> None:
        monkeypatch.setattr(views, "_utcnow", lambda: now)
    return set_now


@pytest.fixture(scope="module")
def real(real_db):
    with TestClient(create_app(str(real_db))) as c:
        yield c


def test_the_file_is_what_the_issue_describes(facts):
    assert [c[1] for c in facts["campaigns"]] == ["running"] * 4 and all(c[2] is None for c in facts["campaigns"])
    assert len(facts["trials"]) == 11 and facts["winners"] == 0
    assert facts["by_campaign"] == {1: {"constraint": 3, "ok": 3, "compile_error": 2}, 2: {"constraint": 3}}
    assert [(b[0], b[1]) for b in facts["baselines"]] == [(1, "B1-T2048-H4")]


PAGES = ["/", "/devices/h200/gdn2", "/campaigns/1", "/campaigns/2", "/campaigns/3", "/campaigns/4", "/compare",
         "/compare?op=gdn2", "/devices/h200/gdn", "/campaigns/1?status=compile_error", "/campaigns/1?limit=3&offset=3",
         "/campaigns/1?offset=100", "/campaigns/3?status=ok"] + [f"/devices/h200/gdn2?shape={s}" for s in SHAPES] + \
        ["/devices/h200/gdn2?shape=B1-T2048-H4&param=consumer_cfg.num_warps", "/static/style.css"]
API = ["/api/overview", "/api/devices", "/api/winners", "/api/winners?device=h200&op=gdn2", "/api/campaigns",
       "/api/campaigns?status=running&limit=2&offset=2", "/api/devices/h200/ops/gdn2",
       "/api/devices/h200/ops/gdn"] + [f"/api/campaigns/{i}" for i in range(1, 5)] + \
      [f"/api/campaigns/{i}/trials" for i in range(1, 5)] + [f"/api/devices/h200/ops/gdn2?shape={s}" for s in SHAPES]


@pytest.mark.parametrize("url", PAGES + API)
def test_every_page_and_endpoint_answers(real, url):
    r = real.get(url)
    assert r.status_code == 200, (url, r.text[:500])
    if url.startswith("/api"):
        json.loads(r.text, parse_constant=lambda name: pytest.fail(f"{url}: {name} is not JSON"))
    elif not url.startswith("/static"):
        assert "<html" in r.text and not re.search(r"\b(nan|inf|None)\b", re.sub(r"<[^>]+>", " ", r.text)), url


def test_api_numbers_match_the_database(real, facts):
    overview = real.get("/api/overview").json()
    (row,) = overview["rows"]
    assert (row["device"], row["op"], row["policy"]) == ("h200", "gdn2", "R")
    assert row["trials"] == 11 and row["ok_trials"] == 3 and row["campaigns"] == 4 and row["unfinished"] == 4
    assert row["winners"] == 0 and row["best_speedup"] is None
    assert [c["id"] for c in overview["campaigns"]] == [4, 3, 2, 1]
    assert overview["devices"][0]["short_name"] == "h200" and overview["devices"][0]["campaigns"] == 4

    page = real.get("/api/campaigns", params={"limit": 3}).json()
    assert page["total"] == 4 and [c["id"] for c in page["items"]] == [4, 3, 2]
    for c in page["items"] + real.get("/api/campaigns", params={"offset": 3}).json()["items"]:
        assert c["trials_by_status"] == facts["by_campaign"].get(c["id"], {})
        assert c["shapes"] == [BUCKET_OF[c["id"]]] and c["activity"]["trials_target"] == 8
        assert c["activity"]["trials_recorded"] == sum(facts["by_campaign"].get(c["id"], {}).values())

    for cid in range(1, 5):
        t = real.get(f"/api/campaigns/{cid}/trials").json()
        expected = sorted((n, s) for c, n, s, _, _ in facts["trials"] if c == cid)
        assert t["total"] == len(expected) and [(x["number"], x["status"]) for x in t["items"]] == expected

    d = real.get("/api/devices/h200/ops/gdn2").json()
    assert d["trials"] == 11 and d["shapes"] == SHAPES and d["unfinished_campaigns"] == 4
    assert d["status_counts"] == {"ok": 3, "constraint": 6, "compile_error": 2}
    rows = {r["shape"]: r for r in d["table"]}
    (_, shape, fla_ms), = facts["baselines"]
    best = facts["best"][shape]
    assert rows[shape]["fla_ms"] == fla_ms and rows[shape]["best_ms"] == best
    assert rows[shape]["speedup"] == pytest.approx(fla_ms / best) and rows[shape]["speedup"] < 1  # 0.59x: slower
    assert rows[shape]["best_trial"] == {"campaign_id": 1, "number": 1}
    assert rows[shape]["trials"] == 8 and rows[shape]["timed_ok_trials"] == 3 and rows[shape]["campaigns"] == [1]
    for other in set(SHAPES) - {shape}:  # no FLA baseline and no ok trial: no speedup, not a wrong one
        r = rows[other]
        assert r["fla_ms"] is None and r["best_ms"] is None and r["speedup"] is None and r["default_speedup"] is None
        assert r["campaigns"] == [next(c for c, s in BUCKET_OF.items() if s == other)]
    assert rows["B1-T8192-H4"]["trials_by_status"] == {"constraint": 3}
    assert rows["B1-T2048-H16"]["trials"] == 0 and rows["B1-T8192-H16"]["trials"] == 0

    detail = real.get("/api/campaigns/1").json()
    assert detail["duration_s"] is None  # not finished: no duration, its activity says when it last wrote
    assert detail["shapes"] == [{"shape": shape, "planned": True, "best_ms": best, "best_trial": 1,
                                 "timed_ok_trials": 3, "fla_ms": fla_ms, "speedup": pytest.approx(fla_ms / best)}]
    assert real.get("/api/campaigns/3").json()["shapes"][0] | {"shape": None} == {
        "shape": None, "planned": True, "best_ms": None, "best_trial": None, "timed_ok_trials": 0, "fla_ms": None,
        "speedup": None}


def test_a_campaign_killed_mid_run_is_not_shown_as_running_forever(real, at):
    at(SOON)
    a = real.get("/api/campaigns/2").json()["activity"]
    assert a["finished"] is False and a["state"] == "running" and a["stalled"] is False
    assert a["last_trial_at"] == LAST_TRIAL.isoformat() and a["idle_s"] == pytest.approx(329, abs=1)
    assert "not finished: 3 of 8 trials recorded" in a["summary"] and "may still be running" in a["summary"]

    at(LATER)
    for cid in range(1, 5):
        a = real.get(f"/api/campaigns/{cid}").json()["activity"]
        assert a["state"] == "stalled" and a["stalled"] and a["run_campaigns"] == [1, 2, 3, 4]
        assert "most likely stopped" in a["summary"] and "--resume" in a["summary"]
    a1 = real.get("/api/campaigns/1").json()["activity"]
    assert "8 of 8 trials recorded" in a1["summary"] and "promotion" in a1["summary"]
    page = real.get("/campaigns/2").text
    assert 'class="state state-stalled"' in page and "last trial 2026-11-30 07:19:31 UTC" in page
    assert "4 h 40 min ago" in page and "took" not in page
    page = real.get("/campaigns/3").text
    assert "no trial yet" in page and "No trial recorded." in page
    assert "since it started 2026-11-30 07:14:40 UTC" in page
    overview = real.get("/").text
    assert overview.count('class="state state-stalled"') == 5  # four recent campaigns and the row's last one
    assert "(4 not finished)" in overview and "no winner yet" in overview
    device = real.get("/devices/h200/gdn2").text
    assert device.count('class="state state-stalled"') == 4 and ">running<" not in device


def test_a_bucket_waiting_for_its_first_trial_is_alive_while_its_run_records(real, at):
    # Campaign 3 started at 07:14:40 and never recorded a trial, but its run (the same tuner process: same
    # environment and study storage) recorded trials until 07:19:31: an hour after its start it is not stalled.
    at(datetime(2026, 11, 30, 8, 16, 0))
    a = real.get("/api/campaigns/3").json()["activity"]
    assert a["last_trial_at"] is None and a["idle_s"] < 3600 and a["state"] == "running"
    at(datetime(2026, 11, 30, 8, 20, 0))
    assert real.get("/api/campaigns/3").json()["activity"]["state"] == "stalled"


def test_a_writer_clock_ahead_of_the_dashboard_is_not_idle(real, at):
    at(datetime(2026, 11, 30, 7, 0, 0))  # before the rows were written
    a = real.get("/api/campaigns/1").json()["activity"]
    assert a["idle_s"] == 0 and a["state"] == "running" and "(0 s ago)" in a["summary"]


def test_device_page_lists_every_bucket_and_says_what_is_missing(real, at):
    at(SOON)
    r = real.get("/devices/h200/gdn2")
    assert "11 trials in 4 campaigns" in r.text and "4 not finished" in r.text
    rows = re.findall(r'<tr class="shape-row" id="shape-([^"]+)">(.*?)</tr>', r.text, flags=re.S)
    assert [s for s, _ in rows] == SHAPES
    cells = dict(rows)
    assert "0.2652" in cells["B1-T2048-H4"] and "0.59×" in cells["B1-T2048-H4"]
    for shape in SHAPES[1:]:
        assert "not measured" in cells[shape] and "no ok trial" in cells[shape] and "×" not in cells[shape]
    assert "3 constraint" in cells["B1-T8192-H4"]
    # the charts show the shape's own trials: campaign 1's eight, not campaign 2's constraint trials
    assert 'id="scatter"' in r.text and "8 trials: latency against" in r.text
    assert real.get("/api/devices/h200/ops/gdn2").json()["shape_trials"] == 8
    # a bucket with no timed trial: a sentence, not empty axes
    r = real.get("/devices/h200/gdn2?shape=B1-T8192-H4")
    assert r.status_code == 200 and 'id="no-timed-trials"' in r.text and "3 constraint" in r.text
    assert 'id="scatter"' not in r.text and 'id="history"' not in r.text and 'id="failures"' in r.text
    r = real.get("/devices/h200/gdn2?shape=B1-T8192-H16")
    assert r.status_code == 200 and "no campaign has recorded a trial for it" in r.text
    # the default parameter is one the trials vary (chunk_size is 64 in every trial)
    assert real.get("/api/devices/h200/ops/gdn2").json()["parameter"] != "chunk_size"
    assert real.get("/devices/h200/gdn2?shape=B9-T9-H9").status_code == 404


def test_campaign_page_lists_trials_with_their_messages(real, facts):
    r = real.get("/campaigns/1")
    assert r.text.count('class="trial-row"') == 8 and "Trials 1–8 of 8." in r.text
    text = html.unescape(r.text)
    for _, _, status, _, message in (t for t in facts["trials"] if t[0] == 1):
        if message:  # every message, long ones folded but whole
            assert message in text
    assert r.text.count('<details class="msg">') == 4  # the two compile errors and two long constraint messages
    assert "Required: 283648, Hardware limit: 232448" in r.text
    assert "27 passed, worst rel. RMS" in r.text and 'id="timeline"' in r.text

    r = real.get("/campaigns/1", params={"status": "compile_error"})
    assert r.text.count('class="trial-row"') == 2 and "with status compile_error" in r.text
    r = real.get("/campaigns/1", params={"limit": 3, "offset": 3})
    numbers = re.findall(r'<tr class="trial-row"><td class="num">(\d+)</td>', r.text)
    assert numbers == ["3", "4", "5"] and "Trials 4–6 of 8." in r.text
    assert "offset=0&amp;limit=3#trials" in r.text and "offset=6&amp;limit=3#trials" in r.text  # previous, next
    assert real.get("/campaigns/1", params={"limit": 501}).status_code == 422

    r = real.get("/campaigns/2")
    assert 'id="timeline-empty"' in r.text and "3 constraint, none with a latency" in r.text
    assert "not measured" in r.text and "no ok trial" in r.text


def test_compare_with_one_device_explains_instead_of_failing(real):
    r = real.get("/compare")
    assert r.status_code == 200 and 'id="one-device"' in r.text and "<option selected>gdn2</option>" in r.text
    r = real.get("/compare", params={"op": "gdn2", "devices": "h200"})
    assert r.status_code == 422 and r.headers["content-type"].startswith("text/html")
    assert "give 2 to 8 distinct devices" in r.text
    assert real.get("/api/compare", params={"op": "gdn2", "devices": "h200"}).status_code == 422


def _dump(path: Path) -> str:
    """Every row and the schema, as SQLite sees them (a write-ahead log's pages included, which the main file's
    bytes would not show while a connection holds them)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


def test_the_dashboard_does_not_write(real_db, real, at):
    # against the file as the repository has it, so that a write when the app opened the database counts too
    before = hashlib.sha256(real_db.read_bytes()).hexdigest()
    at(LATER)
    for url in PAGES + API:
        real.get(url)
    assert hashlib.sha256(real_db.read_bytes()).hexdigest() == before
    assert _dump(real_db) == _dump(REAL_DB)
    assert [c[1] for c in _facts(real_db)["campaigns"]] == ["running"] * 4


def test_non_finite_numbers_from_a_poisoned_gate(tmp_path):
    """A gate on a NaN-poisoned output records NaN/inf errors; nothing shows 'nan' or breaks the JSON."""
    from rewy_tune.db import queries
    from rewy_tune.db.engine import open_db

    path = _copy(tmp_path)
    db = open_db(str(path))
    with db.session() as s:
        queries.add_trial(s, 2, number=5, schedule={"chunk_size": 64}, status="incorrect",
                          errors={"tail-h0/dq": {"rel_rms": float("nan"), "max_abs": float("inf"), "passed": False}},
                          samples_ms={"B1-T8192-H4": [float("nan")] * 3}, message="tail-h0: gate failed for dq")
    db.close()
    with TestClient(create_app(str(path))) as c:
        for url in ["/devices/h200/gdn2?shape=B1-T8192-H4", "/campaigns/2", "/campaigns/2?status=incorrect"]:
            r = c.get(url)
            assert r.status_code == 200 and not re.search(r"\b(nan|inf)\b", re.sub(r"<[^>]+>", " ", r.text), re.I)
        assert "1 of 1 failed: tail-h0/dq" in c.get("/campaigns/2").text
        for url in ["/api/campaigns/2/trials", "/api/devices/h200/ops/gdn2?shape=B1-T8192-H4", "/api/campaigns/2"]:
            r = c.get(url)
            assert r.status_code == 200
            json.loads(r.text, parse_constant=lambda name: pytest.fail(f"{url}: {name} is not JSON"))
        row = next(r for r in c.get("/api/devices/h200/ops/gdn2").json()["table"] if r["shape"] == "B1-T8192-H4")
        assert row["best_ms"] is None and row["speedup"] is None
