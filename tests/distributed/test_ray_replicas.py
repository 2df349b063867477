"""Two replicas of the default model on a local Ray instance, behind one server:
prefix-aware routing, per-replica /metrics, both APIs, and a replica dying."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tandem.distributed.config import ReplicaSpec
from tests.distributed.conftest import Cluster, replica_config

pytestmark = pytest.mark.ray

# ~250 tokens: a system prompt long enough that a user question is under half the prompt
SYSTEM = ("You are the support assistant of a bicycle shop in Utrecht. "
          "Answer briefly, in plain words, and never invent prices. " * 10)
OTHER = ("You are a tutor of Latin grammar for secondary school pupils. "
         "Correct mistakes gently and give one example each time. " * 10)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    from tandem.distributed.client import RayEngineClient

    # max_num_seqs 1: a second request on a replica waits there (the fault test)
    c = Cluster(RayEngineClient(replica_config(max_num_seqs=1), ReplicaSpec(replicas=2)))
    yield c
    c.close()


def test_shared_system_prompt_sticks_to_one_replica(cluster):
    first, _ = cluster.served_by(lambda: cluster.chat(SYSTEM, "Do you repair tyres?"))
    second, body = cluster.served_by(lambda: cluster.chat(SYSTEM, "When do you open?"))
    assert second == first
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 200, body["usage"]  # the system prompt's blocks, from the prefix cache
    other, body = cluster.served_by(lambda: cluster.chat(OTHER, "Is it 'rosa' or 'rosae'?"))
    assert other != first  # a different prefix goes to the idle replica
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again, _ = cluster.served_by(lambda: cluster.chat(OTHER, "What is the ablative?"))
    assert again == other
    hits = cluster.metrics("vllm:prefix_cache_hits_total")
    assert hits[first] >= 200 and hits[other] >= 200


def test_ollama_api_streams_through_a_replica(cluster):
    with httpx.stream("POST", f"{cluster.url}/api/generate", timeout=120, json={
            "model": cluster.app.state.tandem.card.name, "prompt": "Count: one, two,",
            "options": {"num_predict": 6, "temperature": 0}}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert r.status_code == 200 and lines[-1]["done"] and lines[-1]["eval_count"] == 6


def test_idle_cluster_returns_every_kv_block(cluster):
    cluster.chat(SYSTEM, "Can I rent a bike?", max_tokens=4)
    names = set(cluster.client.names)

    def idle() -> bool:
        usage = cluster.metrics("vllm:kv_cache_usage_perc")
        running = cluster.metrics("vllm:num_requests_running")
        return set(usage) == names and not any(usage.values()) and not any(running.values())

    cluster.wait_for(idle, "every replica idle, no block held", timeout=30)
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'vllm:num_requests_running{engine="1",model_name=' in text  # vLLM's labels kept


def test_client_leaving_mid_stream_aborts_on_the_replica(cluster):
    """The server closes the stream; the actor call is cancelled, the engine aborts
    the request and its blocks come back, long before its 500 tokens."""
    before = sum(cluster.metrics("vllm:generation_tokens_total").values())
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": "A very long story:", "max_tokens": 500, "ignore_eos": True,
            "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # leaving: httpx closes the connection

    def freed() -> bool:
        running = cluster.metrics("vllm:num_requests_running")
        usage = cluster.metrics("vllm:kv_cache_usage_perc")
        return set(running) == set(cluster.client.names) and not any(running.values()) \
            and not any(usage.values())

    cluster.wait_for(freed, "the aborted request's blocks freed", timeout=60)
    assert sum(cluster.metrics("vllm:generation_tokens_total").values()) - before < 400
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert any(line.startswith("vllm:request_success_total{") and 'reason="abort"' in line
               and not line.endswith(" 0.0") for line in text.splitlines())


def test_dead_replica_ends_streams_cleanly_retries_queued_and_comes_back(cluster, ray_cluster):
    """A replica killed while one request streams and one waits in its queue: the
    stream ends with an error event, the waiting request is retried on the other
    replica and completes, the router avoids the dead one, Ray restarts it."""
    client = cluster.client
    owner, _ = cluster.served_by(lambda: cluster.chat(SYSTEM, "Hello", max_tokens=2))
    i = client.names.index(owner)
    events: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Tell me about gears."}],
                "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()

    queued: list[dict] = []
    t1 = threading.Thread(target=stream)
    t1.start()
    assert streaming.wait(60)
    t2 = threading.Thread(target=lambda: queued.append(
        cluster.chat(SYSTEM, "And brakes?", max_tokens=5)))
    t2.start()
    cluster.wait_for(lambda: cluster.metrics("vllm:num_requests_waiting").get(owner) == 1,
                     f"the second request waiting on {owner}")
    ray_cluster.kill(client.actors[i], no_restart=False)
    t1.join(60)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable" and "died mid-stream" in error["message"]
    # Ray needs seconds to restart it (a new process loads the model): meanwhile
    # the prefix's owner is out of the router's choice
    assert not client.router.replicas[i].healthy
    other, _ = cluster.served_by(lambda: cluster.chat(SYSTEM, "Saddles?", max_tokens=2))
    assert other != owner
    t2.join(120)
    assert queued and queued[0]["usage"]["completion_tokens"] == 5  # retried elsewhere
    assert client.num_retries >= 1
    cluster.wait_for(lambda: client.router.replicas[i].healthy, f"{owner} restarted",
                     timeout=120)
    assert owner in cluster.metrics("vllm:kv_cache_usage_perc")


def test_bad_input_is_a_400_streamed_or_not(cluster):
    """The replica validates in another process; the server waits for its verdict
    before the first response byte, so a streaming request gets a 400 too."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}
    for stream in (False, True):
        r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120,
                       json={**body, "stream": stream})
        assert r.status_code == 400, (stream, r.text)
        assert "context length" in r.json()["error"]["message"]


def test_a_cluster_too_small_is_a_clear_error(ray_cluster):
    from tandem.distributed.client import RayEngineClient

    with pytest.raises(ValueError, match="3 replicas x 1 CPUs do not fit"):
        RayEngineClient(replica_config(), ReplicaSpec(replicas=3))
