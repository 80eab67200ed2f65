"""`rewy-tune run -- python train.py ...`: run a command with fla-core's chunk ops routed through ReWY.

The child gets `REWY_ENABLE=1` and a temporary directory first on `PYTHONPATH` holding a
`sitecustomize.py` that imports rewy_tune (which then enables the routing) and prints the dispatch report
to stderr at exit. An unmodified training script needs no `import rewy_tune`. Python loads only one
`sitecustomize`: the hook runs the one it shadows, if any, after its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = '''\
"""rewy-tune run: enable ReWY dispatch in this interpreter and print the report at exit."""
import atexit as _atexit
import os as _os
import sys as _sys

def _rewy_enable():
    try:
        import rewy_tune
    except Exception as exc:  # never break the user's program
        print(f"rewy-tune run: cannot import rewy_tune: {exc}", file=_sys.stderr)
        return
    if not rewy_tune.is_enabled():
        rewy_tune.enable()
    _atexit.register(rewy_tune.print_report)

def _chain_sitecustomize():
    """Run the sitecustomize this one shadows (Python imports only the first on sys.path)."""
    import importlib.machinery
    import importlib.util
    here = _os.path.dirname(_os.path.abspath(__file__))
    path = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

if _os.environ.get("REWY_RUN_HOOK") == "1":
    _os.environ.pop("REWY_RUN_HOOK", None)  # grandchildren (dataloader workers, ...) print no report
    _rewy_enable()
try:
    _chain_sitecustomize()
except Exception as exc:
    print(f"rewy-tune run: the shadowed sitecustomize failed: {exc}", file=_sys.stderr)
'''


def child_environment(hook_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["REWY_ENABLE"] = "1"
    env["REWY_RUN_HOOK"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([hook_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_command(argv: list[str]) -> int:
    """Run `argv` with ReWY dispatch enabled; returns its exit code (127 when it cannot be started)."""
    if not argv:
        print("rewy-tune run: give the command after --, e.g. rewy-tune run -- python train.py", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rewy-run-") as hook_dir:
        Path(hook_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        try:
            completed = subprocess.run(argv, env=child_environment(hook_dir))
        except FileNotFoundError:
            print(f"rewy-tune run: command not found: {argv[0]}", file=sys.stderr)
            return 127
        except KeyboardInterrupt:
            return 130
    rc = completed.returncode
    return rc if rc >= 0 else 128 - rc
