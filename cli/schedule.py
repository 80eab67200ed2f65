"""`rewy-tune schedule`: the schedule a call would run on this machine (the runtime dispatcher's pick and why), or a
compute capability's built-in default, as JSON that `rewy-tune bench --schedule FILE` and `schedule=` read back."""

from __future__ import annotations

import json

from rich.console import Console

from rewy_tune.cli.files import write_text_atomic


def parse_cc(text: str) -> tuple[int, int]:
    """'9.0' → (9, 0); a ValueError naming --cc otherwise."""
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise ValueError(f"--cc: {text!r} is not a compute capability MAJOR.MINOR (e.g. 9.0)") from None
    if major < 1 or minor < 0:
        raise ValueError(f"--cc: {text!r} is not a compute capability MAJOR.MINOR (e.g. 9.0)")
    return major, minor


def pick(op: str, policy: str, shape: tuple[int, int, int], K: int, V: int, dtype: str, cc: str | None,
         db_url: str | None = None):
    """(Schedule, reason): with cc, that compute capability's built-in default (no database); otherwise what
    `rewy_tune.lookup` picks for this machine's device (the winners database at db_url, REWY_DB or the default)."""
    from rewy_tune.dispatch import lookup
    from rewy_tune.problem import Problem
    from rewy_tune.search_spaces import default_schedule
    from rewy_tune.validation import MAX_HEAD_DIM_TRITON

    try:
        problem = Problem(op, policy, dtype, *shape, K, V)  # checks op, policy, dtype and the sizes
    except ValueError as exc:  # Problem names its field; the user gave an option
        field = str(exc).split(" ", 1)[0]
        option = {"op": "--op", "policy": "--policy", "dtype": "--dtype", "K": "--head-dim"}.get(field, "--shape")
        raise ValueError(f"{option}: {exc}") from None
    if max(K, V) > MAX_HEAD_DIM_TRITON:
        raise ValueError(f"--head-dim: {max(K, V)} has no schedule; accepted: 1 to {MAX_HEAD_DIM_TRITON} (the Triton "
                         "backward's limit)")
    if cc is not None:
        capability = parse_cc(cc)
        return (default_schedule(capability, K=K, V=V, op=op, dtype=dtype, policy=policy),
                f"built-in default for compute capability {cc} (no database read)")
    return lookup(problem, db_url=db_url)


def show_schedule(console: Console, schedule, reason: str, out: str | None) -> None:
    """The reason on one line, then the schedule's JSON (to stdout, or written to out)."""
    text = json.dumps(schedule.to_dict(), indent=1, sort_keys=True)
    console.print(f"schedule: {reason}", soft_wrap=True, highlight=False)
    if out is None:
        print(text)
        return
    try:
        write_text_atomic(out, text + "\n")
    except OSError as exc:
        raise ValueError(f"--json {out}: cannot write it ({exc.strerror})") from None
    console.print(f"wrote {out}")
