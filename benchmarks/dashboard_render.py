"""Time the dashboard's heaviest page (device + operator) over a campaign of 10 000 trials, on this CPU.

    python benchmarks/dashboard_render.py [--trials 10000] [--repeat 5]

Builds the fixture database (tests/server/server_fixture_db.py) plus one h200/kda campaign of --trials
trials in a temporary directory, then renders /devices/h200/kda through the ASGI app (no network) and
prints the cold time (templates compiled, trials not yet decoded) and the best warm time (a finished
campaign's decoded trials are cached by the server).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))

import server_fixture_db  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from rewy_tune.server.app import create_app  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = server_fixture_db.build(str(Path(tmp) / "bench.db"), trials=40, big=args.trials)
        print(f"built the database in {time.perf_counter() - t:.1f} s")
        with TestClient(create_app(path)) as client:
            client.get("/api/devices")  # open the database, import everything
            for url in ("/devices/h200/gdn", "/campaigns/1"):  # compile the templates on small pages
                client.get(url)
            for url in ("/devices/h200/kda", "/api/devices/h200/ops/kda", "/campaigns/5"):
                times, cpu = [], []
                for _ in range(args.repeat):
                    t, c = time.perf_counter(), time.process_time()
                    r = client.get(url)
                    times.append(time.perf_counter() - t)
                    cpu.append(time.process_time() - c)
                    assert r.status_code == 200, (url, r.status_code)
                print(f"{url}: {args.trials} trials, cold {times[0] * 1000:.0f} ms (CPU {cpu[0] * 1000:.0f} ms), "
                      f"warm best {min(times) * 1000:.0f} ms (CPU {min(cpu) * 1000:.0f} ms), {len(r.content) / 1e6:.2f} MB")
    print(f"load average now: {', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(wall times grow with other work on a shared machine; CPU times do not)")


if __name__ == "__main__":
    main()
