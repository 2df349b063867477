"""Measure a live server for ``tandem doctor``: detect what it is, then probe it.

Detection reads only what each server type exposes by default:

* tandem: ``/v1/models``, ``/metrics`` with vLLM's names, ``/api/version`` with
  a ``tandem_version``, and the ``tandem`` object in OpenAI final responses;
* vLLM: ``/metrics`` with ``vllm:`` names, no ``tandem`` object;
* llama-server: ``/props`` (or ``/slots``);
* Ollama: ``GET /`` answering "Ollama is running", ``/api/tags``, ``/api/ps``.

The probes are few and bounded (each request has a timeout, nothing is
retried, prompts are capped by the server's context window), and run one
after another so that each measures one thing: a warm-up request (a cold
start shows here), a short and a long prompt (TTFT against prompt length:
the prefill rate), a streaming request (decode speed and inter-token
latency), and a long prompt sent while a stream runs (does the second wait
for the first? does the stream stutter during its prefill?). ``/metrics`` is
read before and polled throughout. Every prompt is fresh random text, so no
prefix-cache hit flatters prefill.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from tandem.diagnosis.measurements import Measurements, MetricsSample, Probe
from tandem.tools.bench.client import (
    RequestFunc,
    RequestInput,
    RequestResult,
    ollama,
    openai_completions,
    send,
)
from tandem.tools.bench.datasets import SampleRequest
from tandem.tools.bench.runner import make_client
from tandem.tools.bench.server_metrics import KV_USAGE, PREEMPTIONS, RUNNING, WAITING, Snapshot
from tandem.tools.bench.target import still_loading
from tandem.tools.bench.tokens import WORDS, PromptBuilder, ServerTokenizer

# A server that refuses the first request as overloaded is asked again this many
# times, this far apart, before the refusal is the finding.
OVERLOAD_TRIES = 4
OVERLOAD_WAIT_S = 2.0


def _overloaded(error: str) -> bool:
    return error.startswith("HTTP 503") or "overload" in error.lower()


class DoctorError(ValueError):
    """A condition the user must fix (unreachable, not an LLM server, wrong key): one line."""


@dataclass
class ProbeConfig:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the served name to send; default: the first listed
    short_len: int = 64
    long_len: int = 1024
    probe_output: int = 16  # output tokens of the short and long probes
    stream_output: int = 48  # output tokens of the streaming probe (and the pair's first)
    timeout_s: float = 120.0
    token_ids: bool | None = None  # None: text when the server takes it, else token ids
    vocab_size: int = 100
    seed: int | None = None
    metrics_interval_s: float = 0.05
    ttft_target_s: float = 1.0


@dataclass
class ServerInfo:
    kind: str
    detected_from: list[str]
    models: list[str]
    max_model_len: int | None = None
    model_bytes: float | None = None
    model_bytes_source: str = ""
    quantization_level: str | None = None
    has_metrics: bool = False
    gpu_share: float | None = None
    slots: int | None = None
    tokenizer: ServerTokenizer | None = None


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/v1/`` -> ``http://host:port``."""
    u = url.strip().rstrip("/")
    if not u:
        raise DoctorError("no URL given")
    if "://" not in u:
        u = "http://" + u
    if not u.startswith(("http://", "https://")):
        raise DoctorError(f"{url!r}: only http:// and https:// URLs can be diagnosed")
    if u.endswith("/v1"):
        u = u[:-3]
    return u


def _json(r: httpx.Response | None) -> Any:
    if r is None or r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def detect(client: httpx.Client, base: str, model: str | None = None) -> ServerInfo:
    """What kind of server answers at ``base``, its model, size and context window."""

    def get(path: str) -> httpx.Response | None:
        try:
            r = client.get(base + path)
        except httpx.HTTPError:
            return None
        if r.status_code in (401, 403):
            raise DoctorError(f"{base}{path} answered {r.status_code}: pass --api-key")
        return r

    try:  # the first call tells "nothing listens there" apart from "not an LLM server"
        v1 = client.get(base + "/v1/models")
    except httpx.HTTPError as e:
        raise DoctorError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    if v1.status_code in (401, 403):
        raise DoctorError(f"{base}/v1/models answered {v1.status_code}: pass --api-key")
    found: list[str] = []
    v1_models = _json(v1)
    listed = v1_models.get("data") if isinstance(v1_models, dict) else None
    openai_models = [m for m in listed or [] if isinstance(m, dict) and m.get("id")]
    if openai_models:
        found.append("/v1/models")
    metrics = get("/metrics")
    snap = Snapshot.parse(metrics.text) if metrics is not None and metrics.status_code == 200 \
        else None
    has_vllm = snap is not None and snap.has_vllm_names
    if has_vllm:
        found.append("/metrics with vllm: names")
    version = _json(get("/api/version"))
    tandem = isinstance(version, dict) and "tandem_version" in version
    if tandem:
        found.append("/api/version (tandem_version)")
    props = _json(get("/props"))
    llama = isinstance(props, dict) and (
        "default_generation_settings" in props or "total_slots" in props)
    slots: int | None = None
    if llama:
        found.append("/props")
        slots = props.get("total_slots") if isinstance(props.get("total_slots"), int) else None
    elif not tandem and not has_vllm:
        slot_list = _json(get("/slots"))
        if isinstance(slot_list, list) and slot_list and isinstance(slot_list[0], dict):
            llama, slots = True, len(slot_list)
            found.append("/slots")
    root = get("/")
    ollama_root = root is not None and root.status_code == 200 and \
        root.text.strip() == "Ollama is running"
    tags = _json(get("/api/tags"))
    tag_models = tags.get("models") if isinstance(tags, dict) else None
    if ollama_root and isinstance(tag_models, list):
        found.append('GET / ("Ollama is running") and /api/tags')

    if tandem:
        kind = "tandem"
    elif llama:
        kind = "llama-server"
    elif has_vllm:
        kind = "vllm"
    elif ollama_root and isinstance(tag_models, list):
        kind = "ollama"
    elif openai_models:
        kind = "openai"
    else:
        raise DoctorError(
            f"{base} does not look like an LLM server: none of /v1/models, /api/tags, "
            "/props, /metrics answered like one"
        )

    info = ServerInfo(kind, found, [], has_metrics=has_vllm, slots=slots)
    if kind == "ollama":
        names = [str(m.get("name") or m.get("model")) for m in tag_models or []
                 if isinstance(m, dict)]
    else:
        names = [str(m["id"]) for m in openai_models]
    if not names:
        raise DoctorError(still_loading(client, base) or
                          f"{base} lists no model; pass --model-name")
    info.models = names
    chosen = model or names[0]
    entry = next((m for m in openai_models if m.get("id") == chosen), None)
    if entry is not None and isinstance(entry.get("max_model_len"), int):
        info.max_model_len = entry["max_model_len"]
    if info.slots is None and entry is not None and isinstance(entry.get("max_num_seqs"), int):
        info.slots = entry["max_num_seqs"]  # tandem's
    meta = entry.get("meta") if isinstance(entry, dict) else None
    if isinstance(meta, dict) and isinstance(meta.get("size"), (int, float)):  # llama-server
        info.model_bytes, info.model_bytes_source = float(meta["size"]), "/v1/models meta.size"
    if llama and info.max_model_len is None:
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        if isinstance(n_ctx, int):
            info.max_model_len = n_ctx
    tag = _find_tag(tag_models, chosen)
    if tag is not None and isinstance(tag.get("size"), (int, float)) and tag["size"] > 0:
        info.model_bytes = float(tag["size"])
        info.model_bytes_source = "the server's /api/tags size"
        details = tag.get("details")
        if isinstance(details, dict) and details.get("quantization_level"):
            info.quantization_level = str(details["quantization_level"])
    if kind in ("ollama", "tandem"):
        ps = _json(get("/api/ps"))
        running = _find_tag(ps.get("models") if isinstance(ps, dict) else None, chosen)
        if running is not None:
            size, vram = running.get("size"), running.get("size_vram")
            if isinstance(size, (int, float)) and size > 0 and isinstance(vram, (int, float)):
                info.gpu_share = vram / size
            if info.max_model_len is None and isinstance(running.get("context_length"), int):
                info.max_model_len = running["context_length"]
    if kind != "ollama":
        info.tokenizer = ServerTokenizer.probe(client, base, chosen)
    return info


def _find_tag(models: Any, name: str) -> dict | None:
    if not isinstance(models, list):
        return None
    for m in models:
        if isinstance(m, dict) and name in (m.get("name"), m.get("model"),
                                            f"{m.get('name')}".removesuffix(":latest")):
            return m
    return None


def metrics_sample(snap: Snapshot) -> MetricsSample:
    return MetricsSample(snap.value(WAITING), snap.value(RUNNING), snap.value(KV_USAGE),
                         snap.value(PREEMPTIONS))


def _peak(samples: list[tuple[float, MetricsSample]], t0: float = -math.inf,
          t1: float = math.inf) -> MetricsSample | None:
    inside = [s for t, s in samples if t0 <= t <= t1]
    if not inside:
        return None

    def top(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    return MetricsSample(top([s.waiting for s in inside]), top([s.running for s in inside]),
                         top([s.kv_usage for s in inside]), top([s.preemptions for s in inside]))


class _Poller:
    """Polls /metrics while the probes run: the gauges' peaks, on the probes' clock."""

    def __init__(self, client: httpx.AsyncClient, base: str, interval: float) -> None:
        self.client, self.base, self.interval = client, base, interval
        self.samples: list[tuple[float, MetricsSample]] = []
        self._task: asyncio.Task | None = None

    async def scrape(self) -> MetricsSample | None:
        try:
            r = await self.client.get(self.base + "/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        snap = Snapshot.parse(r.text)
        return metrics_sample(snap) if snap.has_vllm_names else None

    async def _run(self) -> None:
        while True:
            s = await self.scrape()
            if s is not None:
                self.samples.append((time.perf_counter(), s))
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


class _Prompts:
    """Fresh prompts of about ``n`` tokens: exact via the server's tokenizer, else words."""

    def __init__(self, info: ServerInfo, cfg: ProbeConfig) -> None:
        self.rng = np.random.default_rng(cfg.seed)
        self.token_ids = bool(cfg.token_ids)
        self.builder = PromptBuilder(info.tokenizer, self.rng, cfg.vocab_size)

    def make(self, n: int, out: int) -> SampleRequest:
        if self.token_ids:
            return SampleRequest(self.builder.ids(n), n, out)
        if self.builder.tokenizer is not None:
            return SampleRequest(self.builder.text(n), n, out)
        # No tokenizer to count with: common words are about one token each; the
        # server's own count (usage, prompt_eval_count) replaces this estimate.
        picked = self.rng.choice(len(WORDS), size=max(1, n))
        return SampleRequest(" ".join(WORDS[i] for i in picked), n, out)


def to_probe(name: str, r: RequestResult, t0: float) -> Probe:
    """The bench client's result as the doctor's Probe (server split included)."""
    srv = r.server or {}
    p = Probe(
        name=name, ok=r.success, error=r.error, prompt_tokens=r.prompt_len,
        output_tokens=r.output_tokens, sent_s=r.start_time - t0,
        ttft_s=r.ttft if r.success else math.nan,
        e2e_s=r.latency if r.success else math.nan, itl_s=list(r.itl),
    )
    if "prefill_s" in srv:
        p.server_prefill_s = srv["prefill_s"]
    if "decode_s" in srv:
        p.server_decode_s = srv["decode_s"]
    if "queue_s" in srv:
        p.server_queue_s = srv["queue_s"]
    if "load_s" in srv:
        p.load_s = srv["load_s"]
    if "prompt_eval_count" in srv:  # Ollama: computed (not cached) prompt tokens
        p.computed_prompt_tokens = int(srv["prompt_eval_count"])
        p.prompt_tokens = max(p.computed_prompt_tokens, 1) if p.computed_prompt_tokens \
            else p.prompt_tokens
    elif "prompt_tokens" in srv:  # tandem's object
        p.cached_tokens = int(srv.get("cached_tokens", 0))
        p.computed_prompt_tokens = int(srv["prompt_tokens"]) - p.cached_tokens
    if "preemptions" in srv:
        p.preemptions = int(srv["preemptions"])
    return p


class Prober:
    def __init__(self, cfg: ProbeConfig, info: ServerInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.base = normalize_url(cfg.url)
        self.model = cfg.model or info.models[0]
        if info.kind == "ollama":
            self.func: RequestFunc = ollama
            self.endpoint = self.base + "/api/generate"
        else:
            self.func = openai_completions
            self.endpoint = self.base + "/v1/completions"
        # ignore_eos keeps replies at the asked length where the server knows the flag.
        self.ignore_eos = info.kind in ("tandem", "vllm", "llama-server")
        self.prompts = _Prompts(info, cfg)
        self.tandem_object = False
        self._n = 0

    async def request(self, client: httpx.AsyncClient, name: str, sample: SampleRequest,
                      t0: float) -> Probe:
        self._n += 1
        inp = RequestInput(self.endpoint, self.model, sample, f"doctor-{name}-{self._n}",
                           self.ignore_eos, {"temperature": 0.0})
        r = await send(self.func, client, inp, self.cfg.timeout_s)
        if r.server is not None and self.info.kind != "ollama":
            self.tandem_object = True
        return to_probe(name, r, t0)

    def lengths(self) -> tuple[int, int, int, int]:
        """(short, long, probe output, stream output), capped by the context window."""
        c = self.cfg
        out, stream_out = c.probe_output, c.stream_output
        long_len = c.long_len
        window = self.info.max_model_len
        if window:
            long_len = min(long_len, window - out - 8)
            stream_out = min(stream_out, max(2, window // 4))
        short_len = min(c.short_len, max(1, long_len // 4))
        if long_len < 2 or short_len < 1:
            raise DoctorError(f"the server's context window ({window}) is too small to probe")
        return short_len, long_len, out, stream_out

    async def run(self) -> Measurements:
        info = self.info
        m = Measurements(self.base, info.kind, self.model, list(info.detected_from),
                         info.max_model_len, model_bytes=info.model_bytes,
                         model_bytes_source=info.model_bytes_source,
                         quantization_level=info.quantization_level, gpu_share=info.gpu_share,
                         slots=info.slots, ttft_target_s=self.cfg.ttft_target_s)
        short_len, long_len, out, stream_out = self.lengths()
        async with make_client(None, self.cfg.headers) as client:
            poller = _Poller(client, self.base, self.cfg.metrics_interval_s)
            if info.has_metrics:
                m.metrics_before = await poller.scrape()
                poller.start()
            try:
                await self._probe(client, m, short_len, long_len, out, stream_out, poller)
            finally:
                await poller.stop()
            if info.has_metrics:
                m.metrics_after = await poller.scrape()
                m.metrics_peak = _peak(poller.samples)
        if self.tandem_object and m.kind != "tandem":
            m.kind = "tandem"
            m.detected_from.append("the tandem object in responses")
        elif self.tandem_object:
            m.detected_from.append("the tandem object in responses")
        if long_len < 4 * short_len:
            m.notes.append(f"the context window only allows a {long_len}-token long prompt: "
                           "the prefill comparison is coarse")
        if self.prompts.token_ids:
            m.notes.append("prompts were random token ids (the server takes no text)")
        elif self.prompts.builder.tokenizer is None:
            m.notes.append("prompt lengths were estimated (no /tokenize); the server's counts "
                           "are shown where it reports them")
        return m

    async def _probe(self, client: httpx.AsyncClient, m: Measurements, short_len: int,
                     long_len: int, out: int, stream_out: int, poller: _Poller) -> None:
        t0 = time.perf_counter()
        warm = self.prompts.make(8, 2)
        m.warmup = await self.request(client, "first request", warm, t0)
        if (not m.warmup.ok and m.warmup.error.startswith("HTTP 400") and self.cfg.token_ids
                is None and m.kind != "ollama" and not self.prompts.token_ids):
            self.prompts.token_ids = True  # a server without a tokenizer: send token ids
            m.warmup = await self.request(client, "first request", self.prompts.make(8, 2), t0)
        for _ in range(OVERLOAD_TRIES - 1):  # an overloaded server: wait as it asks
            if m.warmup.ok or not _overloaded(m.warmup.error):
                break
            await asyncio.sleep(OVERLOAD_WAIT_S)
            m.warmup = await self.request(client, "first request", warm, t0)
        if not m.warmup.ok and _overloaded(m.warmup.error):
            return  # that is the diagnosis (diagnose's rejected rule), not an error
        if not m.warmup.ok:
            raise DoctorError(f"{self.endpoint} failed a 2-token request: {m.warmup.error}")
        m.short = await self.request(client, "short", self.prompts.make(short_len, out), t0)
        m.long = await self.request(client, "long", self.prompts.make(long_len, out), t0)
        m.stream = await self.request(client, "stream",
                                      self.prompts.make(short_len, stream_out), t0)
        # The pair: a stream, and a long prompt sent once the stream is decoding.
        s = m.stream
        delay = 0.0
        if s.ok:
            delay = s.ttft_s + 3 * (s.itl_p50_s if s.itl_s else 0.0)
        first_sample = self.prompts.make(short_len, stream_out)
        second_sample = self.prompts.make(long_len, 4)
        tp = time.perf_counter()
        first = asyncio.create_task(self.request(client, "pair first", first_sample, tp))
        await asyncio.sleep(delay)
        second = asyncio.create_task(self.request(client, "pair second", second_sample, tp))
        m.pair_first, m.pair_second = await first, await second
        m.pair_metrics_peak = _peak(poller.samples, tp, time.perf_counter())


def collect(cfg: ProbeConfig) -> Measurements:
    """Detect the server and run every probe (DoctorError for what the user must fix)."""
    base = normalize_url(cfg.url)
    # Open for the whole run: the server's /tokenize counts every prompt's tokens.
    with httpx.Client(headers=cfg.headers, timeout=httpx.Timeout(10.0)) as client:
        info = detect(client, base, cfg.model)
        if cfg.model is not None and cfg.model not in info.models and \
                f"{cfg.model}:latest" not in info.models:
            raise DoctorError(f"{base} serves {', '.join(info.models)}, not {cfg.model!r}")
        return asyncio.run(Prober(cfg, info).run())
