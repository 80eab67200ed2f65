"""The winners database on temporary SQLite files: schema, round-trips, promotion, exchange, migration,
and the failure modes readers and writers must report in one clear line."""

from __future__ import annotations

import json
import threading
import time

import pytest
from sqlalchemy import inspect, text

from rewy_tune.db import exchange, migrations, queries
from rewy_tune.db.engine import as_db_url, default_db_url, make_engine, open_db
from rewy_tune.db.errors import DatabaseError
from rewy_tune.db.models import CampaignRow, TrialRow
from rewy_tune.device import Device, Environment
from rewy_tune.problem import Problem
from rewy_tune.schedule import Schedule

H200 = Device("NVIDIA H200", (9, 0), 132, 150_013_493_248)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_100_000_000)
ENV = Environment("570.86.15", "12.8", "2.8.0", "3.6.0", "0.6.0", "0.1.0", "0123456789abcdef")
BUCKET = Problem("gdn", "R", "bf16", B=1, T=2000, H=16, K=128, V=128).bucket()


@pytest.fixture
def db(tmp_path):
    database = open_db(str(tmp_path / "rewy.db"))
    yield database
    database.close()


def new_campaign(db, device=H200, environment=ENV, op="gdn", policies=("R", "A")) -> int:
    with db.session() as s:
        return queries.create_campaign(s, device=device, environment=environment, op=op, policies=policies,
                                       workload={"shapes": [[1, 2048, 16]], "dtype": "bf16"},
                                       budget={"trials": 50}, storage_url="journal:///tmp/x.log").id


def test_create_sets_wal_busy_timeout_foreign_keys_and_version(db, tmp_path):
    assert (tmp_path / "rewy.db").is_file()
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert migrations.stored_version(conn) == migrations.CURRENT_VERSION
    assert set(inspect(db.engine).get_table_names()) == {
        "schema_version", "devices", "environments", "campaigns", "trials", "baselines", "winners"}


def test_default_url_from_env_and_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("REWY_DB", "postgresql://u:p@host/db")
    assert default_db_url() == "postgresql://u:p@host/db"
    monkeypatch.setenv("REWY_DB", str(tmp_path / "x.db"))
    assert default_db_url() == f"sqlite:///{tmp_path / 'x.db'}"
    monkeypatch.delenv("REWY_DB")
    assert default_db_url().startswith("sqlite:///") and default_db_url().endswith("rewy-tune.db")
    assert as_db_url("sqlite:///a.db") == "sqlite:///a.db"


def test_device_and_environment_get_or_create(db):
    with db.session() as s:
        first = queries.record_environment(s, H200, ENV)
        again = queries.record_environment(s, H200, ENV)
        assert first.id == again.id and first.fingerprint == ENV.fingerprint(H200)
        assert queries.device_of(first.device) == H200 and queries.environment_of(first) == ENV
        queries.record_environment(s, A100, ENV)
    with db.session() as s:
        assert [d.short_name for d in queries.devices(s)] == ["a100", "h200"]


def test_campaign_trials_and_baselines_round_trip(db):
    cid = new_campaign(db)
    with db.session() as s:
        for n in range(5):
            queries.add_trial(s, cid, number=n, schedule={"bt": 64, "n": n}, status="ok" if n % 2 else "incorrect",
                              errors={"dq": {"rel_rms": 0.001 * n}}, samples_ms={"B1-T2048-H16": [3.0, 1.0, 2.0]},
                              compile_s=1.5, bench_s=0.25, message=None if n % 2 else "dq off")
        queries.add_baseline(s, cid, shape="B1-T2048-H16", samples_ms=[4.0, 5.0, 6.0])
        queries.finish_campaign(s, cid)
    with db.session() as s:
        campaign = queries.get_campaign(s, cid)
        assert campaign.status == "finished" and campaign.finished_at is not None
        assert campaign.policies == ["R", "A"] and campaign.workload["dtype"] == "bf16"
        assert campaign.environment.device.short_name == "h200"
        page = queries.campaign_trials(s, cid, offset=1, limit=2)
        assert page.total == 5 and [t.number for t in page.items] == [1, 2]
        trial = page.items[0]
        assert trial.schedule == {"bt": 64, "n": 1} and trial.medians_ms == {"B1-T2048-H16": 2.0}
        assert trial.samples_ms["B1-T2048-H16"] == [3.0, 1.0, 2.0] and trial.compile_s == 1.5
        assert queries.campaign_trials(s, cid, status="incorrect").total == 3
        (baseline,) = queries.baselines(s, cid)
        assert baseline.median_ms == 5.0 and baseline.samples_ms == [4.0, 5.0, 6.0]
        assert [c.id for c in queries.campaigns(s, device="h200", op="gdn")] == [cid]
        assert queries.campaigns(s, device="a100") == []


def test_resumed_trial_overwrites_and_bad_status_is_rejected(db):
    cid = new_campaign(db)
    with db.session() as s:
        queries.add_trial(s, cid, number=7, schedule={}, status="timeout")
        queries.add_trial(s, cid, number=7, schedule={}, status="ok", samples_ms={"s": [1.0]})
        with pytest.raises(ValueError, match="trial status must be one of ok, constraint"):
            queries.add_trial(s, cid, number=8, schedule={}, status="great")
    with db.session() as s:
        assert [(t.number, t.status) for t in queries.campaign_trials(s, cid).items] == [(7, "ok")]


def test_promotion_inserts_then_replaces_only_when_told(db):
    cid = new_campaign(db)
    fingerprint = ENV.fingerprint(H200)
    with db.session() as s:
        assert queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule={"v": 1},
                                      latency_ms=2.0, fla_latency_ms=3.0) is None
    with db.session() as s:
        with pytest.raises(queries.WinnerExistsError, match="replace=True"):
            queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule={"v": 2},
                                   latency_ms=1.0, fla_latency_ms=3.0)
    with db.session() as s:
        previous = queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule={"v": 2},
                                          latency_ms=1.0, fla_latency_ms=3.0, replace=True)
    assert previous.schedule == {"v": 1} and previous.speedup == pytest.approx(1.5)
    with db.session() as s:
        (winner,) = queries.winners(s, device="h200", op="gdn", policy="R")
        assert winner.schedule == {"v": 2} and winner.speedup == pytest.approx(3.0)
        assert (winner.t_bucket, winner.bh_bucket) == (2048, 16)
        assert winner.compute_capability == "9.0" and winner.kernel_source_hash == ENV.kernel_source_hash
        assert winner.fingerprint == fingerprint and winner.campaign_id == cid
        assert queries.winner_for(s, BUCKET, fingerprint=fingerprint).id == winner.id
        assert queries.winner_for(s, BUCKET, device=H200).id == winner.id
        assert queries.winner_for(s, BUCKET, device=A100) is None
        assert [w.id for w in queries.all_winners_for_ops(s, ["gdn", "kda"])] == [winner.id]
        assert queries.all_winners_for_ops(s, ["kda"]) == []


def test_promotion_rejects_a_bucket_outside_the_campaign(db):
    cid = new_campaign(db, op="kda", policies=["A"])
    with db.session() as s, pytest.raises(ValueError, match="not covered by campaign"):
        queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule={}, latency_ms=1, fla_latency_ms=2)


def test_export_import_round_trip(db, tmp_path):
    cid = new_campaign(db)
    cid_a100 = new_campaign(db, device=A100)
    with db.session() as s:
        # import reads schedules as the dispatcher does (Schedule.from_dict): real ones, as the tuner stores them
        queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule=Schedule().to_dict(),
                               latency_ms=1, fla_latency_ms=2)
        queries.promote_winner(s, campaign_id=cid_a100, bucket=BUCKET, schedule=Schedule(chunk_size=32).to_dict(),
                               latency_ms=4, fla_latency_ms=5)
        exported = exchange.export_winners(s)
    text_form = json.dumps(exported)  # what `rewy-tune export FILE` writes

    fresh = open_db(str(tmp_path / "fresh.db"))
    with fresh.session() as s:
        assert exchange.import_winners(s, json.loads(text_form)) == 2
    with fresh.session() as s:
        assert exchange.import_winners(s, json.loads(text_form)) == 0  # existing winners are kept
        again = exchange.export_winners(s)
        imported = queries.campaigns(s)
        assert {c.status for c in imported} == {"imported"}
    strip = lambda w: {**w, "campaign": {k: v for k, v in w["campaign"].items() if k not in ("id", "status")}}  # noqa: E731
    assert [strip(w) for w in again["winners"]] == [strip(w) for w in exported["winners"]]
    assert {w["device"]["short_name"] for w in again["winners"]} == {"h200", "a100"}
    fresh.close()


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("winners"), r"\(top level\)\.winners: missing"),
    (lambda d: d.update(format="csv"), "format: expected 'rewy-tune-winners'"),
    (lambda d: d["winners"][0].update(op="mamba"), r"winners\[0\]: op must be one of deltanet"),
    (lambda d: d["winners"][0].update(t_bucket=1000), r"winners\[0\]: t_bucket must be a power of two"),
    (lambda d: d["winners"][0].update(latency_ms="fast"), r"winners\[0\]\.latency_ms: expected int or float"),
    (lambda d: d["winners"][0]["device"].pop("sm_count"), r"winners\[0\]\.device\.sm_count: missing"),
    (lambda d: d["winners"][0]["environment"].update(triton="9.9"), r"winners\[0\]\.environment\.fingerprint"),
    (lambda d: d["winners"][0]["campaign"].update(started_at="yesterday"), r"campaign\.started_at: not an ISO"),
    (lambda d: d["winners"][0].update(schedule={"v": 1}), r"winners\[0\]\.schedule: Schedule: unknown field\(s\) \['v'\]"),
    (lambda d: d["winners"][0].update(schedule={"chunk_size": 7}),
     r"winners\[0\]\.schedule: Schedule\.chunk_size must be one of \(16, 32, 64\), got 7"),
    (lambda d: d["winners"][0].update(K=256), r"winners\[0\]\.schedule: .*block_k=128 must cover K=256"),
    (lambda d: d["winners"][0].update(K=1000), r"winners\[0\]\.K: 1000 is not supported; accepted: 1 to 256"),
    (lambda d: d["winners"][0].update(latency_ms=float("nan")), r"winners\[0\]\.latency_ms: expected a positive finite"),
    (lambda d: d["winners"][0].update(fla_latency_ms=float("inf")), r"winners\[0\]\.fla_latency_ms: expected a positive fin"),
])
def test_import_rejects_malformed_files_naming_the_field(db, tmp_path, mutate, field):
    cid = new_campaign(db)
    with db.session() as s:
        queries.promote_winner(s, campaign_id=cid, bucket=BUCKET, schedule={}, latency_ms=1, fla_latency_ms=2)
        data = exchange.export_winners(s)
    mutate(data)
    fresh = open_db(str(tmp_path / "fresh.db"))
    with pytest.raises(exchange.ImportFormatError, match=field):
        with fresh.session() as s:
            exchange.import_winners(s, data)
    with fresh.session() as s:
        assert queries.winners(s) == [] and queries.devices(s) == []  # nothing half-written
    fresh.close()


def test_import_with_a_malformed_later_winner_writes_none(db, tmp_path):
    # "nothing half-written" where a good winner comes before the bad one (with one winner in the file, any check
    # fails before a write, so the test above cannot tell an import that commits winner by winner)
    cid = new_campaign(db)
    other = Problem("gdn", "R", "bf16", B=1, T=8192, H=16, K=128, V=128).bucket()
    with db.session() as s:
        for bucket in (BUCKET, other):
            queries.promote_winner(s, campaign_id=cid, bucket=bucket, schedule={}, latency_ms=1, fla_latency_ms=2)
        data = exchange.export_winners(s)
    assert len(data["winners"]) == 2
    data["winners"][1].update(latency_ms="fast")
    fresh = open_db(str(tmp_path / "fresh.db"))
    with pytest.raises(exchange.ImportFormatError, match=r"winners\[1\]\.latency_ms: expected int or float"):
        with fresh.session() as s:
            exchange.import_winners(s, data)
    with fresh.session() as s:
        assert queries.winners(s) == [] and queries.devices(s) == [] and s.query(CampaignRow).count() == 0
    data["winners"][1].update(latency_ms=1.0)
    with fresh.session() as s:
        # the same file, mended, imports both; schedule {} is accepted: Schedule.from_dict gives every field its
        # default, a full schedule the dispatcher serves (fields added later read the same way)
        assert exchange.import_winners(s, data) == 2
    fresh.close()


def test_migration_from_v1_keeps_data_and_matches_a_fresh_schema(tmp_path):
    url = as_db_url(str(tmp_path / "old.db"))
    engine = make_engine(url)
    with engine.begin() as conn:
        assert migrations.upgrade(conn, upto=1) == (0, 1)
        conn.execute(text("INSERT INTO devices (id, gpu_name, short_name, cc_major, cc_minor, sm_count, "
                          "memory_bytes, created_at) VALUES (1, 'NVIDIA H200', 'h200', 9, 0, 132, 1, '2025-01-01')"))
        conn.execute(text(
            "INSERT INTO environments VALUES (1, 1, 'fp1', 'd', 'c', 't', 'tr', 'f', 'r', 'k', '2025-01-01')"))
        conn.execute(text("INSERT INTO campaigns (id, device_id, environment_id, op, policies, workload, budget, "
                          "started_at, status) VALUES (1, 1, 1, 'gdn', '[\"R\"]', '{}', '{}', '2025-01-01', 'finished')"))
    assert "study_name" not in {c["name"] for c in inspect(engine).get_columns("campaigns")}
    engine.dispose()

    with pytest.raises(DatabaseError, match="older than v2; open it once with a writer"):
        open_db(url, read_only=True)
    db = open_db(url)
    assert db.schema_version == migrations.CURRENT_VERSION
    with db.session() as s:
        campaign = s.get(CampaignRow, 1)
        assert (campaign.op, campaign.policies, campaign.study_name) == ("gdn", ["R"], None)
        assert campaign.environment.device.short_name == "h200"
        campaign.study_name = "gdn-R-h200"
    migrated = inspect(db.engine)
    db.close()

    fresh = open_db(str(tmp_path / "fresh.db"))
    created = inspect(fresh.engine)
    for table in created.get_table_names():
        assert {c["name"] for c in migrated.get_columns(table)} == {c["name"] for c in created.get_columns(table)}
        assert ({i["name"] for i in migrated.get_indexes(table)} == {i["name"] for i in created.get_indexes(table)})
    assert "ix_trials_campaign_status" in {i["name"] for i in created.get_indexes(TrialRow.__tablename__)}
    fresh.close()


def test_newer_schema_is_refused(db):
    with db.engine.begin() as conn:
        conn.execute(text("UPDATE schema_version SET version = 99"))
    with pytest.raises(DatabaseError, match="schema v99, newer than this rewy-tune"):
        open_db(db.url)


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "corrupt.db"
    path.write_bytes(b"this is not sqlite\x00\xff" * 512)
    for read_only in (False, True):
        with pytest.raises(DatabaseError, match=r"cannot open the rewy-tune database at sqlite:///.*corrupt\.db: "
                                                r"file is not a database") as info:
            open_db(str(path), read_only=read_only)
        assert "\n" not in str(info.value)


def test_foreign_database_is_refused(tmp_path):
    engine = make_engine(as_db_url(str(tmp_path / "other.db")))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE studies (id INTEGER)"))
    engine.dispose()
    with pytest.raises(DatabaseError, match="not a rewy-tune database"):
        open_db(str(tmp_path / "other.db"))


def test_read_only_open_of_a_missing_file_creates_nothing(tmp_path):
    path = tmp_path / "sub" / "missing.db"
    with pytest.raises(DatabaseError, match="no rewy-tune database at sqlite:///.*missing.db"):
        open_db(str(path), read_only=True)
    assert not path.exists() and not path.parent.exists()


def test_reader_cannot_write(db):
    new_campaign(db)
    reader = open_db(db.url, read_only=True)
    with pytest.raises(DatabaseError, match="read-only"):
        with reader.session() as s:
            queries.finish_campaign(s, 1)
    with pytest.raises(Exception, match="readonly"):
        with reader.engine.begin() as conn:
            conn.execute(text("DELETE FROM campaigns"))
    reader.close()


def test_reader_open_while_writers_commit(db):
    cid = new_campaign(db)
    reader = open_db(db.url, read_only=True)
    other_writer = open_db(db.url)
    with reader.session() as rs:
        assert queries.campaign_trials(rs, cid).total == 0
        # A writer commits while the reader's transaction is open: WAL keeps both going.
        with db.session() as ws:
            queries.add_trial(ws, cid, number=0, schedule={}, status="ok")
        assert queries.campaign_trials(rs, cid).total == 0  # the reader's snapshot
    with reader.session() as rs:
        assert queries.campaign_trials(rs, cid).total == 1

    # Two writers: the second waits for the first (busy timeout) instead of failing.
    holding = threading.Event()
    errors: list[BaseException] = []

    def slow_writer() -> None:
        try:
            with db.session() as ws:
                queries.add_trial(ws, cid, number=1, schedule={}, status="ok")
                holding.set()
                time.sleep(0.5)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            holding.set()

    thread = threading.Thread(target=slow_writer)
    thread.start()
    holding.wait(5)
    with other_writer.session() as ws:
        queries.add_trial(ws, cid, number=2, schedule={}, status="ok")
    thread.join()
    assert errors == []
    with reader.session() as rs:
        assert [t.number for t in queries.campaign_trials(rs, cid).items] == [0, 1, 2]
    reader.close()
    other_writer.close()


def test_a_server_url_without_its_driver_is_a_clear_error():
    # (no PostgreSQL driver is installed here: the error names the missing module, with the password hidden)
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here")
    with pytest.raises(DatabaseError, match=r"cannot open the rewy-tune database at postgresql://u:\*\*\*@127\.0\.0\.1:1"
                                            r"/rewy: No module named 'psycopg'"):
        open_db("postgresql://u:secret@127.0.0.1:1/rewy")


def test_unreachable_server_is_a_clear_error():
    # a connection that fails (not a missing driver): SQLite at a file that cannot be opened stands in for a server
    # that refuses, through the same SQLAlchemy error path
    with pytest.raises(DatabaseError, match=r"cannot open the rewy-tune database at .*x\.db: unable to open "
                                            r"database file"):
        open_db("sqlite:////proc/self/x.db")


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DatabaseError, match=r"cannot create the folder of the rewy-tune database at .*file/sub/x\.db"):
        open_db(str(tmp_path / "file" / "sub" / "x.db"))


def test_read_only_open_of_a_path_with_spaces_and_uri_characters(tmp_path):
    path = tmp_path / "Application Support" / "odd%#name.db"  # macOS's user data directory has a space
    open_db(str(path)).close()
    reader = open_db(str(path), read_only=True)
    assert reader.schema_version == migrations.CURRENT_VERSION
    reader.close()
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [path.name]
