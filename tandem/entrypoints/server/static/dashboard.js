// The dashboard: one EventSource on dashboard/events, one frame a second.
// Every number shown keeps its raw value in data-value (tests compare those).
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY_S = 300;
const COLORS = { prompt: "#e08a1e", gen: "#3b7dd8", p50: "#2f9e5b", p95: "#d18a12",
  p99: "#d0443a", slo: "#888", running: "#3b7dd8", waiting: "#d0443a" };

// ----------------------------------------------------------------- numbers
function num(v, digits = 0) {
  return v === null || v === undefined ? "–"
    : v.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function dur(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${num(s * 1e3)} ms` : `${num(s, 2)} s`;
}
function pct(x) { return x === null || x === undefined ? "–" : `${num(100 * x, 1)}%`; }
function show(id, value, text) {
  const el = $(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text;
}

// ------------------------------------------------------------------ charts
// Each chart: series names -> point keys; data[0] is time (unix seconds).
const CHARTS = {
  batch: { title: "requests", series: [["running", "running"], ["waiting", "waiting"]] },
  throughput: { title: "tokens/s",
    series: [["prompt", "prompt_tok_s"], ["generation", "generation_tok_s"]] },
  ttft: { title: "TTFT (s)", slo: "ttft_s",
    series: [["p50", "ttft_p50"], ["p95", "ttft_p95"], ["p99", "ttft_p99"]] },
  itl: { title: "inter-token latency (s)", slo: "itl_s",
    series: [["p50", "itl_p50"], ["p95", "itl_p95"], ["p99", "itl_p99"]] },
  scheduler: { title: "step composition",
    series: [["tokens/step", "tokens_per_step"], ["prefill share", "prefill_share"]] },
};
const colorOf = { running: COLORS.running, waiting: COLORS.waiting, prompt: COLORS.prompt,
  generation: COLORS.gen, p50: COLORS.p50, p95: COLORS.p95, p99: COLORS.p99,
  "tokens/step": COLORS.gen, "prefill share": COLORS.prompt };

const points = [];
let slo = { ttft_s: null, itl_s: null };
const plots = {};

function chartWidth(el) { return Math.max(280, el.clientWidth - 4); }

function makeChart(name) {
  const spec = CHARTS[name];
  const el = $(`chart-${name}`);
  const series = [{}];
  for (const [label] of spec.series) {
    const s = { label, stroke: colorOf[label], width: 1.5, points: { show: false } };
    if (label === "prefill share") {
      s.scale = "share";
      s.value = (u, v) => pct(v);
    }
    series.push(s);
  }
  if (spec.slo) {
    series.push({ label: "SLO", stroke: COLORS.slo, dash: [6, 4], width: 1, points: { show: false } });
  }
  const axes = [{}, { label: spec.title, size: 60 }];
  const scales = { x: { time: true } };
  if (name === "scheduler") {
    axes.push({ side: 1, scale: "share", values: (u, vs) => vs.map((v) => pct(v)), size: 60 });
    scales.share = { range: [0, 1] };
  }
  plots[name] = new uPlot({ width: chartWidth(el), height: 150, series, axes, scales,
    legend: { live: true }, cursor: { drag: { x: false, y: false } } }, chartData(name), el);
}

function chartData(name) {
  const spec = CHARTS[name];
  const data = [points.map((p) => p.t)];
  for (const [, key] of spec.series) data.push(points.map((p) => p[key]));
  if (spec.slo) data.push(points.map(() => slo[spec.slo]));
  return data;
}

function redraw() {
  for (const name of Object.keys(plots)) plots[name].setData(chartData(name));
}

function addPoints(list) {
  for (const p of list) points.push(p);
  const oldest = points.length ? points[points.length - 1].t - HISTORY_S : 0;
  while (points.length && points[0].t < oldest) points.shift();
}

// ------------------------------------------------------------------ panels
function renderDoctor(doc) {
  const panel = $("doctor");
  const problem = doc.findings.some((f) => f.severity === "problem");
  panel.classList.toggle("problem", problem);
  panel.classList.toggle("healthy", !problem);
  $("verdict").textContent = doc.verdict;
  const ul = $("findings");
  ul.replaceChildren();
  for (const f of doc.findings) {
    const li = document.createElement("li");
    const phase = document.createElement("span");
    phase.className = "phase";
    phase.textContent = `${f.phase}: `;
    const knob = document.createElement("span");
    knob.className = "knob";
    knob.textContent = f.knob ? ` → ${f.knob}` : "";
    li.append(phase, f.evidence, knob);
    ul.append(li);
  }
}

function renderRequests(rows, notShown) {
  const body = $("requests");
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.state = r.state;
    const total = r.num_prompt_tokens + r.num_output_tokens;
    const state = r.state === "prefill"
      ? `prefill ${num(100 * r.num_computed_tokens / Math.max(total, 1))}%` : r.state;
    const cells = [r.request_id, state, num(r.num_prompt_tokens), num(r.num_cached_tokens),
      num(r.num_output_tokens), num(r.output_tokens_per_s, 1), num(r.num_preemptions),
      dur(r.age_s)];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      if (i === 1) {
        const span = document.createElement("span");
        span.className = `state ${r.state}`;
        span.textContent = text;
        td.append(span);
      } else {
        td.textContent = text;
      }
      tr.append(td);
    });
    body.append(tr);
  }
  show("requests-count", rows.length + notShown,
    `${rows.length + notShown} in the engine${notShown ? `, ${notShown} not shown` : ""}`);
}

function render(f) {
  $("model").textContent = f.model;
  const win = `(last ${num(f.window_s)} s)`;
  for (const el of document.querySelectorAll(".window:not(#requests-count)")) el.textContent = win;
  const n = f.now;
  show("now-running", n.running, num(n.running));
  show("now-waiting", n.waiting, num(n.waiting));
  show("now-preempted", n.preempted, num(n.preempted));
  show("now-kv", n.kv_blocks_used, `${num(n.kv_blocks_used)} / ${num(n.kv_blocks_total)}`);
  $("now-kv-bar").style.width = `${100 * n.kv_usage}%`;
  show("now-hit-rate", n.prefix_cache_hit_rate, pct(n.prefix_cache_hit_rate));
  show("now-threads", n.cpu_threads, num(n.cpu_threads));

  const t = f.totals;
  show("tp-prompt", f.point.prompt_tok_s, num(f.point.prompt_tok_s, 1));
  show("tp-generation", f.point.generation_tok_s, num(f.point.generation_tok_s, 1));
  show("total-prompt-tokens", t.prompt_tokens, num(t.prompt_tokens));
  show("total-generation-tokens", t.generation_tokens, num(t.generation_tokens));
  show("total-requests", t.requests, num(t.requests));
  show("total-rejections", t.rejections, num(t.rejections));
  show("total-preemptions", t.preemptions, num(t.preemptions));

  slo = f.slo;
  for (const [key, lat] of Object.entries(f.latency)) {
    const limit = key === "ttft" ? slo.ttft_s : key === "itl" ? slo.itl_s : null;
    for (const q of ["p50", "p95", "p99"]) {
      const id = `lat-${key}-${q}`;
      show(id, lat[q], dur(lat[q]));
      $(id).classList.toggle("over", limit !== null && lat[q] !== null && lat[q] > limit);
    }
    show(`lat-${key}-count`, lat.count, num(lat.count));
  }
  show("slo-ttft", slo.ttft_s, dur(slo.ttft_s));
  show("slo-itl", slo.itl_s, dur(slo.itl_s));

  const s = f.scheduler;
  show("sched-steps", s.steps_per_s, num(s.steps_per_s, 1));
  show("sched-tokens", s.tokens_per_step, num(s.tokens_per_step, 1));
  show("sched-prefill", s.prefill_share, pct(s.prefill_share));
  show("sched-preemptions", s.preemptions, num(s.preemptions));

  renderDoctor(f.doctor);
  renderRequests(f.requests, f.requests_not_shown);
}

// ------------------------------------------------------------------- feed
function connect() {
  const status = $("status");
  const es = new EventSource("dashboard/events");
  es.addEventListener("history", (e) => {
    points.length = 0;
    addPoints(JSON.parse(e.data).history);
  });
  es.onmessage = (e) => {
    const f = JSON.parse(e.data);
    addPoints([f.point]);
    render(f);
    if (!Object.keys(plots).length) Object.keys(CHARTS).forEach(makeChart);
    redraw();
    status.textContent = `live, ${new Date(f.point.t * 1000).toLocaleTimeString()}`;
    status.className = "status live";
    document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
  };
  es.onerror = () => {
    // A refused feed (429: viewer cap; 401: key) is closed for good; a dropped one retries.
    status.textContent = es.readyState === EventSource.CLOSED
      ? "feed refused: too many viewers, or the API key is missing (reload to retry)"
      : "disconnected, retrying…";
    status.className = "status down";
  };
}

window.addEventListener("resize", () => {
  for (const [name, u] of Object.entries(plots)) {
    u.setSize({ width: chartWidth($(`chart-${name}`)), height: 150 });
  }
});
connect();
