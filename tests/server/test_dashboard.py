"""/dashboard and its feed on a real server: what the frames say, against /metrics;
the viewer cap; the API-key gate (header, login form, cookie); ``tandem top``."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import pytest

from tandem.entrypoints.cli import main
from tandem.entrypoints.server.app import ServerConfig
from tandem.entrypoints.server.dashboard import COOKIE, DashboardConfig
from tandem.tools.top import refused
from tests.server.conftest import API_KEY, slow_down, tiny_engine
from tests.server.dashboard_feed import Feed, quantiles, scrape, total

PROMPT = [7, 11, 13, 17, 19, 23, 29, 31]  # token ids: the tiny model has no tokenizer


@pytest.fixture
def server(start_server, tiny_config_path):
    """A fresh server per test (its registry and sampler start empty), viewer cap 2."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=2), 0.02)
    return start_server(engine, ServerConfig(
        max_queue=8, dashboard=DashboardConfig(slo_ttft_s=0.5, slo_itl_s=0.05, max_viewers=2)))


@pytest.fixture(scope="module")
def keyed_server(start_server, tiny_config_path):
    return start_server(tiny_engine(tiny_config_path), ServerConfig(api_key=API_KEY))


def _generate(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    def one() -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_feed_follows_the_load_and_agrees_with_metrics(server):
    feed = Feed(server.url)
    try:
        first = feed.wait(lambda f: True)
        assert feed.events[0][0] == "history"  # the charts' past comes first
        assert first["slo"] == {"ttft_s": 0.5, "itl_s": 0.05}
        assert first["now"]["kv_blocks_total"] > 0 and first["requests"] == []
        # 4 requests on 2 sequence slots: two decode while two queue.
        threads = _generate(server.url, 4, 120)
        busy = feed.wait(lambda f: {r["state"] for r in f["requests"]} >= {"decode", "queued"})
        running = [r for r in busy["requests"] if r["state"] in ("prefill", "decode")]
        assert 1 <= len(running) <= 2 and busy["now"]["waiting"] >= 1
        for row in busy["requests"]:
            assert row["num_prompt_tokens"] == len(PROMPT) and row["age_s"] >= 0
            if row["state"] == "decode":
                assert row["num_computed_tokens"] == len(PROMPT) + row["num_output_tokens"] - 1
        later = feed.wait(lambda f: f["point"]["generation_tok_s"] > 0 and any(
            r["num_output_tokens"] > 1 and r["output_tokens_per_s"] for r in f["requests"]))
        assert later["scheduler"]["tokens_per_step"] >= 1
        for t in threads:
            t.join()
        done = feed.wait(lambda f: f["totals"]["requests"] == 4 and f["now"]["running"] == 0)
        metrics = scrape(server.url)
    finally:
        feed.close()
    t = done["totals"]
    assert t["generation_tokens"] == total(metrics, "vllm:generation_tokens") == 4 * 120
    assert t["prompt_tokens"] == total(metrics, "vllm:prompt_tokens")
    assert t["requests"] == total(metrics, "vllm:request_success") == 4
    assert t["preemptions"] == total(metrics, "vllm:num_preemptions")
    assert done["window_s"] < 60  # every observation is in the window: compare with /metrics
    for key in ("ttft", "itl", "e2e", "queue"):
        assert done["latency"][key] == pytest.approx(quantiles(metrics, key)), key
    # Two requests waited for a slot behind two of 120 tokens: the doctor says so.
    assert done["latency"]["queue"]["p99"] > 0.5
    phases = [f["phase"] for f in done["doctor"]["findings"]]
    assert phases[0] == "queue" and "--max-num-seqs" in done["doctor"]["verdict"]
    # Step composition: the steps that prefilled a prompt had decodes beside them or not.
    shares = [f["point"]["prefill_share"] for f in feed.frames]
    assert any(s is not None and 0 < s <= 1 for s in shares)


def test_frames_never_carry_prompt_text(real_server):
    """The request table counts tokens; a secret in the prompt never reaches the feed."""
    secret = "platypus-7731-zebra"
    feed = Feed(real_server.url, real_server.headers)
    try:
        feed.wait(lambda f: True)
        # A stream long enough to be seen in a frame; leaving it aborts it.
        with httpx.stream("POST", f"{real_server.url}/v1/completions", timeout=120,
                          headers=real_server.headers, json={
                              "model": real_server.model, "max_tokens": 900,
                              "ignore_eos": True, "stream": True,
                              "prompt": f"The password is {secret}. Repeat it:"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            row = feed.wait(lambda f: any(x["num_output_tokens"] > 0
                                          for x in f["requests"]))["requests"][0]
        assert row["num_prompt_tokens"] > 5 and set(row) == {
            "request_id", "state", "num_prompt_tokens", "num_computed_tokens",
            "num_cached_tokens", "num_output_tokens", "num_preemptions", "age_s",
            "output_tokens_per_s"}
        feed.wait(lambda f: f["requests"] == [])  # the client left: aborted, gone
    finally:
        feed.close()
    assert secret.encode() not in bytes(feed.raw) and b"platypus" not in bytes(feed.raw)


def test_viewer_cap(server):
    feeds = [Feed(server.url), Feed(server.url)]
    try:
        for f in feeds:
            f.wait(lambda _: True)
        r = httpx.get(f"{server.url}/dashboard/events", timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "10"
        err = r.json()["error"]
        assert err["code"] == "too_many_viewers" and "--dashboard-max-viewers 2" in err["message"]
        feeds.pop().close()  # a viewer leaves: its place is free again
        deadline = time.monotonic() + 10
        while True:
            again = Feed(server.url)
            if again.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        feeds.append(again)
        assert again.status == 200
        again.wait(lambda _: True)
    finally:
        for f in feeds:
            f.close()


def test_api_key_gate(keyed_server):
    url = keyed_server.url
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.get("/dashboard/events")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/dashboard/events", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        # The page without the key is a login form, not the dashboard.
        r = c.get("/dashboard")
        assert r.status_code == 401 and 'method="post"' in r.text
        assert "dashboard.js" not in r.text
        assert c.post("/dashboard", data={"key": "nope"}).status_code == 401
        assert c.post("/dashboard", content=b"key=" + b"x" * 5000).status_code == 413
    # A form that says it is 300 MB is refused before a byte of it is read.
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /dashboard HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % (300 << 20))
        assert s.recv(64).startswith(b"HTTP/1.1 413")
    with httpx.Client(base_url=url, timeout=10) as c:
        # The right key in a form body: a cookie that is not the key, for /dashboard only.
        r = c.post("/dashboard", data={"key": API_KEY}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"]
        assert API_KEY not in cookie
        assert re.search(r"(?i)httponly", cookie) and re.search(r"(?i)samesite=strict", cookie)
        assert "Path=/dashboard" in cookie
        assert c.get("/dashboard").status_code == 200  # the client kept the cookie
        # The cookie opens the dashboard, not the API.
        assert c.post("/v1/completions", json={"prompt": PROMPT}).status_code == 401
        with c.stream("GET", "/dashboard/events") as r:
            assert r.status_code == 200
    with httpx.stream("GET", f"{url}/dashboard/events", headers=keyed_server.headers,
                      timeout=10) as r:
        assert r.status_code == 200  # tandem top's way: the bearer header
    assert httpx.get(f"{url}/dashboard", cookies={COOKIE: "forged"}).status_code == 401


def test_page_loads_nothing_from_elsewhere(server):
    r = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert refs and all(not re.match(r"(?i)[a-z]+://|//", u) for u in refs if u != "data:,")
    for u in refs:
        if u.startswith("dashboard/"):
            assert httpx.get(f"{server.url}/{u}", timeout=10).status_code == 200, u
    lic = httpx.get(f"{server.url}/dashboard/static/uplot/LICENSE", timeout=10).text
    assert "MIT" in lic and "Leon Sorokin" in lic


@pytest.mark.parametrize("flags, words", [
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be a positive number"),
    (["--slo-itl-ms", "nan"], "--slo-itl-ms must be a positive number"),
    (["--dashboard-max-viewers", "-1"], "--dashboard-max-viewers must be >= 0"),
])
def test_serve_rejects_bad_dashboard_flags(flags, words, capsys):
    assert main(["serve", *flags]) == 2
    assert words in capsys.readouterr().err


def test_top_renders_one_frame(server, capsys):
    threads = _generate(server.url, 2, 200)
    feed = Feed(server.url)
    try:  # top's frame is taken while both requests run
        feed.wait(lambda f: f["now"]["running"] == 2)
        assert main(["top", server.url, "--once"]) == 0
    finally:
        feed.close()
        for t in threads:
            t.join()
    out = capsys.readouterr().out
    for words in ("doctor", "running", "KV blocks", "generation", "TTFT", "ITL", "E2E",
                  "queue", "tokens per step", "requests (2 in the engine)", "decode"):
        assert words in out, words
    assert re.search(r"running\s+2\b", out)


def test_top_not_on_a_terminal_prints_frame_after_frame(server):
    """Piped into a file or a log, the screen-mode view would print nothing."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "top", server.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=6)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert out.count("doctor") >= 2, out  # two frames or more in 6 s (one a second)


def test_top_says_why_it_cannot_watch(keyed_server, capsys):
    assert main(["top", keyed_server.url, "--once"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(["top", keyed_server.url, "--once", "--api-key", "wrong"]) == 2
    assert "the API key sent is not its --api-key" in capsys.readouterr().err
    # a server still loading (503 "Loading model")
    assert "still loading its model" in refused(503, '{"error": {"message": "Loading model"}}',
                                                False)
    assert main(["top", keyed_server.url, "--once", "--api-key", API_KEY]) == 0
    assert "doctor" in capsys.readouterr().out
    assert main(["top", "127.0.0.1:9", "--once", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem top: error: cannot reach 127.0.0.1:9") and err.count("\n") == 1
