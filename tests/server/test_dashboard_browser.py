"""/dashboard in a real headless chromium: log in with the API key, watch the panels
move under load and settle on /metrics' numbers, with every host but the server's
unresolvable and no request leaving for anywhere else.

Needs chromium + chromedriver (Debian: apt-get install chromium chromium-driver) and
selenium (the dev extra); skipped without them. Run alone: pytest -m browser.
"""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tandem.entrypoints.server.app import ServerConfig
from tandem.entrypoints.server.dashboard import DashboardConfig
from tests.server.conftest import API_KEY
from tests.server.dashboard_feed import quantiles, scrape, total

pytestmark = pytest.mark.browser
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SECRET = "okapi-4411-marmot"
CHROME = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                              "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
if CHROME is None or DRIVER is None:  # before any fixture: no model is loaded for nothing
    pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    opts = Options()
    opts.binary_location = CHROME
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1500",
                # Every name but the server's fails to resolve: a CDN or web font would break.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # An explicit driver: Selenium Manager would go looking for one on the internet.
    d = webdriver.Chrome(options=opts, service=Service(DRIVER))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def server(start_server, real_server):
    """The default model behind its API key, in a fresh app (its histograms start at 0)."""
    return start_server(real_server.engine, ServerConfig(
        api_key=API_KEY, served_model_names=["smollm2"],
        dashboard=DashboardConfig(slo_ttft_s=1.0, slo_itl_s=0.1)))


def value(d, element_id: str) -> float | None:
    v = d.find_element(By.ID, element_id).get_attribute("data-value")
    return None if v in (None, "") else float(v)


def test_dashboard_in_a_browser(browser, server):
    d, url = browser, server.url
    wait = WebDriverWait(d, 120, poll_frequency=0.1)
    d.get(f"{url}/dashboard")
    d.find_element(By.ID, "key").send_keys(API_KEY)  # the login form: no key in any URL
    d.find_element(By.ID, "login").click()
    wait.until(lambda _: int(d.execute_script("return document.body.dataset.frames || 0")) > 0)
    assert d.find_element(By.ID, "model").text == "smollm2"
    assert value(d, "total-requests") == 0 and value(d, "slo-ttft") == 1.0

    def complete(i: int) -> None:  # a few seconds of 4 streams: several frames see them
        r = httpx.post(f"{url}/v1/completions", headers=server.headers, timeout=300, json={
            "model": "smollm2", "max_tokens": 160, "temperature": 0, "ignore_eos": True,
            "prompt": f"The password is {SECRET} {i}. Count to twenty:"})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # The panels move: requests in the table, running, generation tok/s.
    wait.until(lambda _: (value(d, "now-running") or 0) >= 1 and d.find_elements(
        By.CSS_SELECTOR, "#requests tr[data-state=decode]"))
    wait.until(lambda _: (value(d, "tp-generation") or 0) > 0)
    for t in threads:
        t.join()
    # ... and settle on what /metrics says once the load is over.
    wait.until(lambda _: value(d, "total-requests") == 4 and value(d, "now-running") == 0)
    metrics = scrape(url)
    assert value(d, "total-generation-tokens") == total(metrics, "vllm:generation_tokens")
    assert value(d, "total-prompt-tokens") == total(metrics, "vllm:prompt_tokens")
    assert value(d, "total-requests") == total(metrics, "vllm:request_success") == 4
    assert value(d, "total-preemptions") == total(metrics, "vllm:num_preemptions")
    for key in ("ttft", "itl", "e2e", "queue"):
        q = quantiles(metrics, key)
        assert value(d, f"lat-{key}-count") == q["count"]
        for p in ("p50", "p95", "p99"):
            assert value(d, f"lat-{key}-{p}") == pytest.approx(q[p]), (key, p)
    assert d.find_element(By.ID, "verdict").text  # the doctor speaks
    assert len(d.find_elements(By.CSS_SELECTOR, ".chart canvas")) == 5  # uPlot drew them

    # Nothing but the server was asked for anything; the prompts never reached the page.
    asked = [json.loads(e["message"])["message"] for e in d.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in asked
            if m["method"] == "Network.requestWillBeSent"]
    assert any(u.endswith("uPlot.iife.min.js") for u in urls)
    assert [u for u in urls if not u.startswith((url, "data:"))] == []
    errors = [e["message"] for e in d.get_log("browser")
              if e["level"] == "SEVERE" and "401" not in e["message"]]  # the login page's
    assert errors == []
    assert SECRET not in d.page_source
