"""`rewy-tune show` and `export` with --device/--op: 'cpu' names the interpreter's winners in both, and a filter
that matches nothing says what the database does hold instead of reading as an empty database."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rewy_tune.cli.main import app
from rewy_tune.device import CPU_INTERPRETER, Device


def _db(tmp_path):
    from test_dispatch import H200, RUN, S1, make_db, problem

    cpu = Device(CPU_INTERPRETER, (0, 0), 1, 0)
    return make_db(tmp_path / "w.db", [(H200, RUN, problem(op="gdn"), S1), (H200, RUN, problem(op="kda"), S1),
                                      (cpu, RUN, problem(op="gdn"), S1)])


def _run(*args):
    res = CliRunner().invoke(app, list(args), terminal_width=300)
    return res.exit_code, " ".join(res.output.split())


def test_show_with_a_filter_that_matches_nothing_lists_what_is_stored(tmp_path):
    db = _db(tmp_path)
    code, out = _run("show", "--db", db, "--device", "h300")
    assert code == 0
    assert out == ("no winners stored for --device h300 (winners in this database, by --device: cpu: gdn; "
                   "h200: gdn, kda)")
    code, out = _run("show", "--db", db, "--device", "cpu", "--op", "kda")
    assert out.startswith("no winners stored for --device cpu --op kda (winners")
    code, out = _run("show", "--db", db, "--device", "cpu")
    assert "cpu-interpreter" in out and "no winners" not in out


def test_show_of_an_empty_database_says_so_plainly(tmp_path):
    from test_dispatch import make_db

    db = make_db(tmp_path / "e.db", [])
    assert _run("show", "--db", db) == (0, "no winners stored")
    assert _run("show", "--db", db, "--op", "gdn")[1].endswith("(winners in this database, by --device: none)")


def test_export_takes_cpu_as_show_does_and_explains_an_empty_export(tmp_path):
    db = _db(tmp_path)
    out_file = tmp_path / "cpu.json"
    code, out = _run("export", str(out_file), "--db", db, "--device", "cpu")
    assert code == 0 and "exported 1 winner(s)" in out  # before: 0, the stored name is 'cpu-interpreter'
    assert [w["device"]["short_name"] for w in json.loads(out_file.read_text())["winners"]] == [CPU_INTERPRETER]
    code, out = _run("export", str(tmp_path / "none.json"), "--db", db, "--device", "h100")
    assert code == 0 and "no winners stored for --device h100" in out and "exported 0 winner(s)" in out
    assert json.loads((tmp_path / "none.json").read_text())["winners"] == []
