"""A real browser: Debian's chromium, headless under Playwright, against `rewy-tune serve` in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                "(apt-get install -y chromium; .ci/run installs it)")


@pytest.fixture
def server(fixture_db):
    from rewy_tune.server.subprocess_server import ServerDidNotStart, served

    try:
        with served(fixture_db) as url:
            yield url
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))


def test_overview_to_device_page_in_chromium(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server + "/")
            assert page.title().startswith("Overview")
            assert page.locator("#overview-table tbody tr").count() == 3
            page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

            page.locator('a.device-link[href="/devices/h200/gdn"]').click()
            page.wait_for_url("**/devices/h200/gdn")
            assert page.locator("h1").inner_text() == "gdn on h200"
            assert page.locator("#shape-table tbody tr").count() == 3
            assert page.locator("#scatter svg circle").count() >= 100
            assert page.locator("#history svg path.best-so-far").count() == 1
            assert page.locator("#importance svg").count() == 1
            box = page.locator("#scatter svg").bounding_box()
            assert box and box["width"] > 300 and box["height"] > 150
            page.screenshot(path=str(ARTIFACTS / "dashboard-device.png"), full_page=True)

            page.select_option("select[name=param]", "consumer")
            page.click("form.inline button")
            page.wait_for_url("**param=consumer**")
            assert "Latency against consumer" in page.locator("#scatter").inner_text()
        finally:
            browser.close()
