// FastServe dashboard: polls /dashboard/data once a second (serving/dashboard.py documents the JSON),
// fills every element that has data-field="path.in.the.json" using its data-fmt, and draws the charts on
// plain canvases. No libraries, nothing fetched from elsewhere. The API key, if the server needs one,
// comes from the page's fragment: /dashboard#key=KEY (a fragment is never sent to the server or logged).
"use strict";

const POLL_MS = 1000;
const KEY = new URLSearchParams(location.hash.slice(1)).get("key");
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
                "#475569", "#ea580c"];

// -- formatting (tests/test_dashboard.py mirrors these rules) ------------------------------------------
const FORMATS = {
  text: (v) => String(v),
  int: (v) => String(Math.round(v)),
  f1: (v) => v.toFixed(1),
  f2: (v) => v.toFixed(2),
  ms: (v) => (v * 1000).toFixed(1),
  mib: (v) => (v / 1048576).toFixed(2),
  pct: (v) => v.toFixed(0),
  dur: (v) => { const s = Math.floor(v); return `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m${String(s % 60).padStart(2, "0")}s`; },
};

function fmt(kind, v) {
  return v === null || v === undefined ? "–" : FORMATS[kind](v);
}

function lookup(obj, path) {
  for (const part of path.split(".")) {
    if (obj === null || obj === undefined) return undefined;
    obj = obj[part];
  }
  return obj;
}

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(e.style, v);  // CSSOM: the page's CSP forbids style attributes
    else e.setAttribute(k, v);
  }
  if (text !== undefined) e.textContent = text;
  return e;
}

function field(tag, path, kind) {
  return el(tag, {"data-field": path, "data-fmt": kind});
}

// -- charts ---------------------------------------------------------------------------------------------
// Each chart: a title, a y unit, and series computed from a sample; drawn over the kept history.
const CHARTS = [
  {id: "chart-requests", title: "Requests", series: () => [
    ["running", (s) => s.requests.running], ["waiting", (s) => s.requests.waiting],
    ["batch", (s) => s.requests.batch_size]]},
  {id: "chart-queues", title: "MLFQ queue lengths", series: (s) =>
    s.scheduler.queue_lengths.map((_, i) => [`Q${i + 1}`, (x) => x.scheduler.queue_lengths[i] ?? 0])},
  {id: "chart-kv", title: "KV blocks in use", series: () => [
    ["device", (s) => s.kv.device_used], ["host", (s) => s.kv.host_used]]},
  {id: "chart-swap", title: "Swap traffic, MiB/s", series: () => [
    ["offload", (s) => s.kv.offload_bytes_per_s / 1048576], ["upload", (s) => s.kv.upload_bytes_per_s / 1048576],
    ["misses/s", (s) => s.kv.swap_misses_per_s]]},
  {id: "chart-rps", title: "Requests/s", series: () => [["finished", (s) => s.throughput.requests_per_s]]},
  {id: "chart-tps", title: "Tokens/s", series: () => [["generated", (s) => s.throughput.tokens_per_s]]},
  {id: "chart-latency", title: "Latency over the last minute, ms", series: () => [
    ["TTFT p50", (s) => ms(s.latency.ttft_s, "p50")], ["TTFT p99", (s) => ms(s.latency.ttft_s, "p99")],
    ["per-token p50", (s) => ms(s.latency.per_token_s, "p50")],
    ["per-token p99", (s) => ms(s.latency.per_token_s, "p99")]]},
  {id: "chart-gpu", title: "GPU utilization, %", series: (s) =>
    s.devices.map((d, i) => [`GPU ${d.id}`, (x) => x.devices[i]?.utilization_pct ?? null])},
];

function ms(summary, p) {
  return summary ? summary[p] * 1000 : null;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const mag = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= v) return m * mag;
  return 10 * mag;
}

function drawChart(canvas, samples, series, spanS) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 48, right = 8, top = 8, bottom = 18;
  const pw = w - left - right, ph = h - top - bottom;
  const tEnd = samples.length ? samples[samples.length - 1].time : 0;
  let max = 0;
  const values = series.map(([, f]) => samples.map((s) => f(s)));
  for (const vs of values) for (const v of vs) if (v !== null && v > max) max = v;
  max = niceMax(max);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#64748b";
  ctx.strokeStyle = "#e2e8f0";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + ph - (ph * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + pw, y); ctx.stroke();
    const label = max * i / 4;
    ctx.fillText(String(label >= 100 ? Math.round(label) : +label.toPrecision(3)), 4, y + 4);
  }
  for (const [i, label] of [[0, `-${Math.round(spanS / 60)} min`], [1, "now"]]) {
    ctx.fillText(label, i === 0 ? left : left + pw - ctx.measureText(label).width, h - 4);
  }
  values.forEach((vs, k) => {
    ctx.strokeStyle = COLORS[k % COLORS.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    vs.forEach((v, j) => {
      if (v === null || v === undefined) { pen = false; return; }
      const x = left + pw * (1 - (tEnd - samples[j].time) / spanS);
      const y = top + ph - (ph * v) / max;
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  });
}

function renderCharts(samples, spanS) {
  const box = document.getElementById("charts");
  const latest = samples[samples.length - 1];
  for (const chart of CHARTS) {
    const series = latest ? chart.series(latest) : [];
    let fig = document.getElementById(chart.id);
    if (!fig) {
      fig = el("figure", {id: chart.id});
      fig.append(el("figcaption", {}, chart.title), el("canvas"), el("div", {class: "keys"}));
      box.append(fig);
    }
    fig.hidden = series.length === 0;
    if (fig.hidden) continue;
    drawChart(fig.querySelector("canvas"), samples, series, spanS);
    const keys = fig.querySelector(".keys");
    keys.replaceChildren(...series.map(([name], k) => {
      const span = el("span", {}, name);
      span.prepend(el("i", {class: "sw", style: {background: COLORS[k % COLORS.length]}}));
      return span;
    }));
  }
}

// -- tables ---------------------------------------------------------------------------------------------
const RECENT_COLUMNS = [
  ["request", "request_id", "text"], ["reason", "finish_reason", "text"], ["prompt", "prompt_tokens", "int"],
  ["output", "output_tokens", "int"], ["n", "n", "int"], ["TTFT", "ttft_s", "ms"], ["e2e", "e2e_s", "ms"],
  ["per token", "per_token_s", "ms"], ["queued", "queued_s", "ms"], ["executing", "executing_s", "ms"],
  ["swap wait", "swap_wait_s", "ms"], ["preempted", "preemptions", "int"], ["ago, s", "age_s", "f1"],
];

function renderRecent(requests) {
  const table = document.getElementById("recent");
  const head = el("tr");
  for (const [title] of RECENT_COLUMNS) head.append(el("th", {}, title));
  head.append(el("th", {}, "breakdown"));
  const longest = Math.max(1e-9, ...requests.map((r) => r.queued_s + r.executing_s + r.swap_wait_s));
  const rows = requests.map((r, i) => {
    const tr = el("tr");
    for (const [, key, kind] of RECENT_COLUMNS) tr.append(field("td", `recent_requests.${i}.${key}`, kind));
    const bar = el("div", {class: "bar"});
    for (const [part, cls] of [["queued_s", "queued"], ["executing_s", "executing"], ["swap_wait_s", "swap"]]) {
      bar.append(el("i", {class: `sw ${cls}`, style: {width: `${(100 * r[part] / longest).toFixed(1)}%`}}));
    }
    const td = el("td");
    td.append(bar);
    tr.append(td);
    return tr;
  });
  table.replaceChildren(head, ...rows);
}

function renderDevices(rows) {
  const table = document.getElementById("devices");
  if (!rows.length) { table.replaceChildren(); return; }
  const head = el("tr");
  for (const t of ["device", "name", "worker", "memory used, MiB", "memory total, MiB", "utilization, %", "error"]) {
    head.append(el("th", {}, t));
  }
  table.replaceChildren(head, ...rows.map((d, i) => {
    const tr = el("tr");
    tr.append(field("td", `now.devices.${i}.id`, "int"), field("td", `now.devices.${i}.name`, "text"),
              el("td", {}, d.worker ? `rank ${d.worker.rank} (tp ${d.worker.tp_rank}, pp ${d.worker.pp_stage}, cuda:${d.worker.cuda_device})` : "–"),
              field("td", `now.devices.${i}.memory_used_bytes`, "mib"),
              field("td", `now.devices.${i}.memory_total_bytes`, "mib"),
              field("td", `now.devices.${i}.utilization_pct`, "pct"), field("td", `now.devices.${i}.error`, "text"));
    return tr;
  }));
}

function renderQueues(lengths) {
  const box = document.getElementById("queues");
  if (box.dataset.count !== String(lengths.length)) {
    box.dataset.count = String(lengths.length);
    box.replaceChildren(...(lengths.length ? lengths.map((_, i) => {
      const chip = el("span", {class: "chip"}, `Q${i + 1} `);
      chip.append(field("b", `now.scheduler.queue_lengths.${i}`, "int"));
      return chip;
    }) : [el("span", {class: "note"}, "this policy has no queues")]));
  }
}

// -- the loop -------------------------------------------------------------------------------------------
let samples = [];
let lastSeq = 0;
let spanS = 300;

function render(data) {
  if (data.seq < lastSeq) samples = [];  // the server restarted
  for (const s of data.history) if (!samples.length || s.seq > samples[samples.length - 1].seq) samples.push(s);
  spanS = data.history_s;
  const keep = Math.round(data.history_s / data.interval_s);
  if (samples.length > keep) samples = samples.slice(samples.length - keep);
  lastSeq = data.seq;
  const now = data.now;
  if (now) {
    renderQueues(now.scheduler.queue_lengths);
    renderDevices(now.devices);
  }
  renderRecent(data.recent_requests);
  document.getElementById("device-note").hidden = !data.device_note;
  for (const node of document.querySelectorAll("[data-field]")) {
    node.textContent = fmt(node.dataset.fmt, lookup(data, node.dataset.field));
  }
  renderCharts(samples, spanS);
  document.body.dataset.seq = String(data.seq);  // what tests wait on: every number above is of this sample
}

function setStatus(text, ok) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = ok ? "status ok" : "status bad";
}

async function poll() {
  try {
    const headers = KEY ? {Authorization: `Bearer ${KEY}`} : {};
    const resp = await fetch(`/dashboard/data?since=${lastSeq}`, {headers, cache: "no-store"});
    if (resp.ok) {
      render(await resp.json());
      setStatus("live", true);
    } else {
      setStatus(resp.status === 401 ? "needs the API key: open /dashboard#key=KEY" : `HTTP ${resp.status}`, false);
    }
  } catch (e) {
    setStatus(`server unreachable (${e.message})`, false);
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => renderCharts(samples, spanS));
poll();
