"""Check a campaign's Optuna journal against its database: every finished trial recorded once, none lost.

Usage: python benchmarks/journal_check.py JOURNAL DB   (per study: trial numbers contiguous, states, db rows,
finished trials missing from the db, db rows without a trial, duplicated rows; an abandoned trial (FAIL with
user_attrs abandoned) has a WAITING re-run)."""
import collections
import sqlite3
import sys

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend


def main(journal: str, db: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(journal))
    c = sqlite3.connect(db)
    campaigns = {name: (cid, op) for cid, name, op in c.execute("select id, study_name, op from campaigns")}
    for s in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)
        nums = [t.number for t in trials]
        states = collections.Counter(t.state.name for t in trials)
        cid, op = campaigns.get(s.study_name, (None, None))
        rows = c.execute("select number, status from trials where campaign_id=?", (cid,)).fetchall() if cid else []
        dbnums = [r[0] for r in rows]
        # each finished journal trial has exactly one db row
        complete = [t.number for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]
        missing = sorted(set(complete) - set(dbnums))
        extra = sorted(set(dbnums) - set(nums))
        dup = [n for n, k in collections.Counter(dbnums).items() if k > 1]
        # schedule duplicates: same params evaluated twice (TPE may legitimately resample; enqueued defaults count)
        keys = collections.Counter(tuple(sorted(t.params.items())) for t in trials if t.state.name == "COMPLETE")
        label = s.study_name.split(f"-{op}-", 1)[-1]  # the bucket after the operator (policy, dtype, shape)
        print(f"{label[:30]:32s} journal={len(trials)} contiguous={nums == list(range(len(nums)))} "
              f"states={dict(states)} db_rows={len(rows)} missing_in_db={missing} extra_in_db={extra} dup_db={dup} "
              f"repeated_params={sum(k - 1 for k in keys.values())} "
              f"db_status={dict(collections.Counter(r[1] for r in rows))}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/journal_check.py JOURNAL DB  (a campaign's Optuna journal file and its "
                 "SQLite database)")
    main(sys.argv[1], sys.argv[2])
