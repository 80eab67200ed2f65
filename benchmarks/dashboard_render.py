"""Time the dashboard's pages on this CPU: a generated 10 000-trial campaign, or a real database.

    python benchmarks/dashboard_render.py [--trials 10000] [--repeat 5]
    python benchmarks/dashboard_render.py --db benchmarks/results/h200-campaign-gdn2-2026-11-30.db \\
        [--screenshot benchmarks/results/dashboard-h200-gdn2.png] [--page /devices/h200/gdn2]

Without --db: builds the fixture database (tests/server/server_fixture_db.py) plus one h200/kda campaign of
--trials trials in a temporary directory and times the heaviest page (device + operator) and its API twin.
With --db: copies the file into a temporary directory (the file itself is never opened, so a committed
result stays byte for byte as it is) and times every page and API endpoint it finds there: overview, each
device + operator page, each campaign page and its trials, compare.

Pages are rendered through the ASGI app (no network): cold is the first request (templates compiled,
trials not yet decoded), warm the best of --repeat (a finished campaign's decoded trials are cached by the
server). --screenshot serves the copy with `rewy-tune serve` and saves a full-page PNG of --page (default:
the first device + operator page) from Debian's chromium, headless, under Playwright.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))

from fastapi.testclient import TestClient  # noqa: E402

from rewy_tune.server.app import create_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def time_url(client: TestClient, url: str, repeat: int) -> tuple[list[float], list[float], int, int]:
    times, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        r = client.get(url)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
    return times, cpu, r.status_code, len(r.content)


def pages_of(client: TestClient) -> list[str]:
    """Every page and API endpoint of the database behind `client`, found through the API."""
    urls = ["/", "/api/overview", "/api/devices", "/api/winners", "/api/campaigns", "/compare"]
    for d in client.get("/api/devices").json():
        for op in d["ops"]:
            urls += [f"/devices/{d['short_name']}/{op}", f"/api/devices/{d['short_name']}/ops/{op}"]
    for c in client.get("/api/campaigns", params={"limit": 1000}).json()["items"]:
        urls += [f"/campaigns/{c['id']}", f"/api/campaigns/{c['id']}", f"/api/campaigns/{c['id']}/trials"]
    return urls


def time_database(path: str, repeat: int) -> str | None:
    """Time every page of the database at `path`; returns the first device + operator page."""
    with TestClient(create_app(path)) as client:
        t = time.perf_counter()
        client.get("/api/devices")  # open the database, import everything
        print(f"opened the database in {(time.perf_counter() - t) * 1000:.0f} ms")
        urls = pages_of(client)
        print(f"{'page':<40} {'cold ms':>8} {'warm ms':>8} {'CPU ms':>7} {'bytes':>8}")
        for url in urls:
            times, cpu, _, size = time_url(client, url, repeat)
            print(f"{url:<40} {times[0] * 1000:8.1f} {min(times) * 1000:8.1f} {min(cpu) * 1000:7.1f} {size:8d}")
    return next((u for u in urls if u.startswith("/devices/")), None)


def time_fixture(trials: int, repeat: int, tmp: str) -> None:
    import server_fixture_db

    t = time.perf_counter()
    path = server_fixture_db.build(str(Path(tmp) / "bench.db"), trials=40, big=trials)
    print(f"built the database in {time.perf_counter() - t:.1f} s")
    with TestClient(create_app(path)) as client:
        client.get("/api/devices")  # open the database, import everything
        for url in ("/devices/h200/gdn", "/campaigns/1"):  # compile the templates on small pages
            client.get(url)
        for url in ("/devices/h200/kda", "/api/devices/h200/ops/kda", "/campaigns/5"):
            times, cpu, _, size = time_url(client, url, repeat)
            print(f"{url}: {trials} trials, cold {times[0] * 1000:.0f} ms (CPU {cpu[0] * 1000:.0f} ms), "
                  f"warm best {min(times) * 1000:.0f} ms (CPU {min(cpu) * 1000:.0f} ms), {size / 1e6:.2f} MB")


def screenshot(path: str, page_url: str, out: Path, chromium: str) -> None:
    """Serve `path` with `rewy-tune serve` and save a full-page screenshot of `page_url`."""
    from playwright.sync_api import sync_playwright

    from rewy_tune.server.subprocess_server import served

    with served(path) as base:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                t = time.perf_counter()
                response = page.goto(base + page_url, wait_until="load")
                load_ms = (time.perf_counter() - t) * 1000
                assert response is not None and response.status == 200, (page_url, response and response.status)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
                print(f"screenshot of {page_url} ({page.title()!r}, loaded in {load_ms:.0f} ms in chromium) -> {out}")
            finally:
                browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000, help="trials of the generated campaign (no --db)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--db", help="time this database's pages instead (a temporary copy is used)")
    parser.add_argument("--screenshot", type=Path, metavar="PNG", help="with --db: save a screenshot of --page")
    parser.add_argument("--page", help="page for --screenshot (default: the first device + operator page)")
    parser.add_argument("--chromium", default=CHROMIUM, help=f"chromium executable (default {CHROMIUM})")
    args = parser.parse_args()
    if args.screenshot and not args.db:
        parser.error("--screenshot needs --db")
    with tempfile.TemporaryDirectory() as tmp:
        if args.db:
            source = Path(args.db)
            if not source.is_file():
                parser.error(f"--db {source}: no such file")
            path = str(Path(tmp) / source.name)
            shutil.copyfile(source, path)  # readers of a WAL database create -shm/-wal files beside it
            print(f"timing the pages of a copy of {source}")
            first = time_database(path, args.repeat)
            if args.screenshot:
                page = args.page or first
                if page is None:
                    parser.error("the database has no device + operator page; pass --page")
                screenshot(path, page, args.screenshot, args.chromium)
        else:
            time_fixture(args.trials, args.repeat, tmp)
    print(f"load average now: {', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(wall times grow with other work on a shared machine; CPU times do not)")


if __name__ == "__main__":
    main()
