"""Check a campaign's Optuna journal against its database: every finished trial recorded once, none lost.

Usage: python benchmarks/journal_check.py JOURNAL DB   (per study: trial numbers contiguous, states, db rows,
finished trials missing from the db, db rows without a trial, duplicated rows; an abandoned trial (FAIL with
user_attrs abandoned) has a WAITING re-run)."""
import sys, sqlite3, collections
import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
optuna.logging.set_verbosity(optuna.logging.WARNING)
journal, db = sys.argv[1], sys.argv[2]
st = JournalStorage(JournalFileBackend(journal))
c = sqlite3.connect(db)
camps = {name: cid for cid, name in c.execute("select id, study_name from campaigns")}
for s in optuna.get_all_study_summaries(st):
    study = optuna.load_study(study_name=s.study_name, storage=st)
    trials = study.get_trials(deepcopy=False)
    nums = [t.number for t in trials]
    states = collections.Counter(t.state.name for t in trials)
    cid = camps.get(s.study_name)
    rows = c.execute("select number, status from trials where campaign_id=?", (cid,)).fetchall() if cid else []
    dbnums = [r[0] for r in rows]
    complete = [t.number for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]
    # each finished journal trial has exactly one db row
    missing = sorted(set(complete) - set(dbnums)); extra = sorted(set(dbnums) - set(nums))
    dup = [n for n, k in collections.Counter(dbnums).items() if k > 1]
    # schedule duplicates: same params evaluated twice (TPE may legitimately resample; enqueued defaults count)
    keys = collections.Counter(tuple(sorted(t.params.items())) for t in trials if t.state.name == "COMPLETE")
    print(f"{s.study_name.split('-gdn2-')[1][:30]:32s} journal={len(trials)} contiguous={nums==list(range(len(nums)))} "
          f"states={dict(states)} db_rows={len(rows)} missing_in_db={missing} extra_in_db={extra} dup_db={dup} "
          f"repeated_params={sum(k-1 for k in keys.values())} db_status={dict(collections.Counter(r[1] for r in rows))}")
