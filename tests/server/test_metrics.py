"""/metrics: vLLM's names, types, labels and buckets; values that follow the requests.

Also /health, /version and the two kinds of log line.
"""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.client import EngineStats
from tandem.entrypoints.server.app import ServerConfig
from tandem.entrypoints.server.stats import StatsLogger
from tests.server.conftest import tiny_engine

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), written out here on purpose.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
EXPECTED = {
    "vllm:time_to_first_token_seconds": ("histogram", VLLM_TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", VLLM_ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "tandem:queue_rejections": ("counter", None),
    "tandem:request_aborts": ("counter", None),
}


@pytest.fixture(scope="module")
def server(start_server, tiny_config_path):
    return start_server(tiny_engine(tiny_config_path),
                        ServerConfig(served_model_names=["tiny"]))


def scrape(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    for s in families[name].samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


def test_names_types_labels_and_buckets(server):
    fams = scrape(server)
    for name, (kind, buckets) in EXPECTED.items():
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", name
        if buckets is not None:
            les = [float(s.labels["le"]) for s in fams[name].samples
                   if s.name.endswith("_bucket")]
            assert les == [*buckets, float("inf")], name
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_values_follow_requests(server, caplog):
    before = scrape(server)
    n_req, n_tok = 3, 6
    with caplog.at_level(logging.INFO, logger="tandem.entrypoints.server"):
        for _ in range(n_req):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": list(range(5, 14)), "max_tokens": n_tok,
                "ignore_eos": True, "stream": True})
            assert r.status_code == 200
    after = scrape(server)

    def delta(name, sample=None, **labels):
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert delta("vllm:time_to_first_token_seconds",
                 "vllm:time_to_first_token_seconds_count") == n_req
    assert delta("vllm:inter_token_latency_seconds",
                 "vllm:inter_token_latency_seconds_count") == n_req * (n_tok - 1)
    assert delta("vllm:e2e_request_latency_seconds",
                 "vllm:e2e_request_latency_seconds_count") == n_req
    assert delta("vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == n_req
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == n_req * n_tok
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == n_req * 9
    # The same 9-token prompt three times: its full blocks (of 4) are reused.
    assert delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") > 0
    assert value(after, "vllm:num_requests_running") == 0
    lines = [r.getMessage() for r in caplog.records if "finished (length)" in r.getMessage()]
    assert len(lines) == n_req
    assert "prompt 9 tokens" in lines[0] and "output 6 tokens" in lines[0]
    assert "queue" in lines[0] and "prefill" in lines[0] and "decode" in lines[0]


def test_stats_line(server):
    stats = StatsLogger(server.engine, 10.0)
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": [1, 2], "max_tokens": 4, "ignore_eos": True})
    text, busy = stats.line()
    assert busy and "Running: 0 reqs, Waiting: 0 reqs" in text and "CPU threads: " in text
    assert "Avg generation throughput: 0.0" not in text
    text, busy = stats.line()  # nothing happened since
    assert not busy and "Avg generation throughput: 0.0 tokens/s" in text


def test_stats_line_counts_a_prompt_while_it_prefills():
    """A long prompt's chunks show as prompt throughput as they run, not only once it is done."""
    base = dict(num_running=1, num_waiting=0, num_waiting_for_kv=0, num_pending=0,
                kv_cache_usage=0.5,
                num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                prompt_tokens_total=0, generation_tokens_total=0, num_threads=2,
                num_kv_blocks=64, num_steps=0, scheduled_tokens_total=0,
                prefill_tokens_total=0)
    snaps = iter([EngineStats(**base)] + [EngineStats(**{
        **base, "num_steps": 10, "scheduled_tokens_total": 1280,
        "prefill_tokens_total": 1280})] * 2)

    class Engine:
        def stats(self) -> EngineStats:
            return next(snaps)

    text, busy = StatsLogger(Engine(), 10.0).line()  # type: ignore[arg-type]
    assert busy and "Avg prompt throughput: 0.0" not in text


def test_version_and_health(start_server, tiny_config_path, server):
    assert httpx.get(f"{server.url}/version").json()["version"]
    other = start_server(tiny_engine(tiny_config_path))
    assert httpx.get(f"{other.url}/health").status_code == 200
    other.engine.shutdown()  # the engine loop is gone: load balancers must see it
    r = httpx.get(f"{other.url}/health")
    assert r.status_code == 503 and "not running" in r.json()["error"]
    r = httpx.post(f"{other.url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]


def test_head_probes_and_cors(start_server, tiny_config_path, server):
    """Ollama's HEAD probes answer; a page on this machine may call the APIs from a browser
    (a preflight with the Authorization header passes) and another site may not, unless
    --allowed-origins names it."""
    for path in ("/", "/api/version", "/api/tags"):
        assert httpx.head(f"{server.url}{path}").status_code == 200, path
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    local = httpx.options(f"{server.url}/v1/chat/completions",
                          headers={"Origin": "http://localhost:3000", **preflight})
    assert local.status_code == 200
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in local.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://127.0.0.1:8080"})
    assert r.headers["access-control-allow-origin"] == "http://127.0.0.1:8080"
    for app in ("vscode-webview://abc", "vscode-file://vscode-app", "tauri://localhost"):
        assert httpx.options(f"{server.url}/api/chat",
                             headers={"Origin": app, **preflight}).status_code == 200, app
    site = {"Origin": "https://example.com"}
    assert httpx.options(f"{server.url}/v1/chat/completions",
                         headers={**site, **preflight}).status_code == 400
    # Another site's page gets no answer and runs nothing, preflight or not (a text/plain
    # POST needs none), in each API's error shape; the server's own pages may call it.
    r = httpx.get(f"{server.url}/v1/models", headers=site)
    assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/api/generate", headers={**site, "Content-Type": "text/plain"},
                   content=json.dumps({"prompt": "hi", "options": {"num_predict": 1}}))
    assert r.status_code == 403 and "https://example.com" in r.json()["error"]
    host = server.url.split("//")[1]
    assert httpx.get(f"{server.url}/v1/models", headers={"Origin": f"http://{host}"}
                     ).status_code == 200
    # DNS rebinding: another site's name pointed at 127.0.0.1 is same-origin with its page
    # (Origin and Host agree, or a GET carries no Origin): on loopback without an API key,
    # only local names are served.
    port = host.rsplit(":", 1)[1]
    for headers in ({"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"},
                    {"Host": f"evil.example:{port}"}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"], headers
    for name in ("localhost", "app.localhost", "127.0.0.1", "[::1]", socket.gethostname()):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": f"{name}:{port}"}
                         ).status_code == 200, name
    keyed = start_server(tiny_engine(tiny_config_path), ServerConfig(api_key="k"))
    assert httpx.get(f"{keyed.url}/v1/models", headers={
        "Host": "evil.example", "Authorization": "Bearer k"}).status_code == 200
    other = start_server(tiny_engine(tiny_config_path),
                         ServerConfig(allowed_origins=["https://example.com"]))
    r = httpx.options(f"{other.url}/api/chat", headers={**site, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == site["Origin"]
    assert httpx.get(f"{other.url}/v1/models", headers=site).status_code == 200
    # --allowed-origins adds to the pages on this machine (as Ollama's OLLAMA_ORIGINS)
    assert httpx.get(f"{other.url}/v1/models", headers={"Origin": "http://localhost:3000"}
                     ).status_code == 200
