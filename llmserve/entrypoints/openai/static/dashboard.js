// The dashboard: polls /dashboard/stats once a second and draws its points on hand-written canvas
// line charts. Every number comes from the server's metrics registry (the same as /metrics).
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = ["#1f6feb", "#d9480f", "#2b8a3e", "#862e9c"];
const TILES = [
  ["total_requests", "requests finished", (v) => String(v)],
  ["total_tokens", "tokens (prompt + generated)", (v) => String(v)],
  ["avg_latency_ms", "mean latency", (v) => `${v.toFixed(0)} ms`],
  ["avg_ttft_ms", "mean TTFT", (v) => `${v.toFixed(0)} ms`],
  ["avg_tpot_ms", "mean TPOT", (v) => `${v.toFixed(1)} ms`],
  ["avg_tokens_per_second", "tokens/s per request", (v) => v.toFixed(1)],
  ["avg_batch_size", "mean batch size", (v) => v.toFixed(2)],
  ["num_requests_running", "running", (v) => String(v)],
  ["num_requests_waiting", "waiting", (v) => String(v)],
  ["kv_cache_usage_perc", "KV cache in use", (v) => `${(100 * v).toFixed(1)}%`],
  ["prefix_cache_hit_rate", "prefix-cache hit rate", (v) => `${(100 * v).toFixed(1)}%`],
  ["spec_decode_acceptance_rate", "draft acceptance", (v) => `${(100 * v).toFixed(1)}%`],
  ["num_preemptions", "preemptions", (v) => String(v)],
];
const CHARTS = [
  ["requests", "Running and waiting requests", [["num_requests_running", "running"], ["num_requests_waiting", "waiting"]], ""],
  ["kv", "KV cache usage", [["kv_cache_usage_perc", "in use"]], "%"],
  ["tokens", "Tokens per second", [["prompt_tokens_per_second", "prompt"], ["generation_tokens_per_second", "generated"]], ""],
  ["ttft", "Time to first token (ms)", [["ttft_p50_ms", "p50"], ["ttft_p90_ms", "p90"], ["ttft_p99_ms", "p99"]], ""],
  ["tpot", "Time per output token (ms)", [["tpot_p50_ms", "p50"], ["tpot_p90_ms", "p90"], ["tpot_p99_ms", "p99"]], ""],
  ["prefix", "Prefix-cache hit rate", [["prefix_cache_hit_rate", "hits / lookups"]], "%"],
  ["spec", "Speculative acceptance", [["spec_decode_acceptance_rate", "accepted / drafted"]], "%"],
  ["preemptions", "Preemptions per second", [["preemptions_per_second", "preempted"]], ""],
];

function buildPage() {
  for (const [key, name] of TILES) {
    const tile = document.createElement("div");
    tile.className = "tile";
    const value = document.createElement("div");
    value.className = "value";
    value.id = `tile-${key}`;
    value.textContent = "–";
    const label = document.createElement("div");
    label.className = "name";
    label.textContent = name;
    tile.append(value, label);
    $("tiles").append(tile);
  }
  for (const [id, title, series] of CHARTS) {
    const box = document.createElement("div");
    box.className = "chart";
    const heading = document.createElement("h2");
    heading.textContent = title;
    const canvas = document.createElement("canvas");
    canvas.id = `chart-${id}`;
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label", title);
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach(([key, name], i) => {
      const item = document.createElement("span");
      item.style.setProperty("--swatch", COLORS[i]);
      item.id = `latest-${key}`;
      item.dataset.name = name;
      item.textContent = name;
      legend.append(item);
    });
    box.append(heading, canvas, legend);
    $("charts").append(box);
  }
}

function format(value, unit) {
  if (value === null || value === undefined) return "–";
  if (unit === "%") return `${(100 * value).toFixed(1)}%`;
  return Math.abs(value) >= 100 ? value.toFixed(0) : value.toFixed(2);
}

// One line per series over the last five minutes; gaps where a point has no value (null).
function drawChart(canvas, points, series, unit) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  const pad = { left: 44, right: 6, top: 6, bottom: 18 };
  const values = points.flatMap((p) => series.map(([key]) => p[key])).filter((v) => v !== null && v !== undefined);
  const highest = Math.max(0, ...values);
  const top = unit === "%" ? 1 : highest > 0 ? 1.1 * highest : 1; // an idle chart still has a scale
  const oldest = points.length ? -points[0].t : 0;
  const span = Math.min(300, Math.max(60, oldest)); // the time watched, from one to five minutes
  const x = (t) => pad.left + (width - pad.left - pad.right) * (1 + t / span);
  const y = (v) => height - pad.bottom - (height - pad.top - pad.bottom) * (v / top);
  ctx.strokeStyle = "#d7d9dd";
  ctx.fillStyle = "#5f6368";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const v = top * fraction;
    ctx.beginPath();
    ctx.moveTo(pad.left, y(v));
    ctx.lineTo(width - pad.right, y(v));
    ctx.stroke();
    ctx.fillText(format(v, unit), 2, y(v) + 4);
  }
  ctx.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`, pad.left, height - 4);
  ctx.fillText("now", width - pad.right - 22, height - 4);
  series.forEach(([key], i) => {
    ctx.strokeStyle = COLORS[i];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const point of points) {
      const v = point[key];
      if (v === null || v === undefined || point.t < -span) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(point.t), y(v)); else ctx.moveTo(x(point.t), y(v));
      drawing = true;
    }
    ctx.stroke();
    ctx.fillStyle = COLORS[i];
    points.forEach((point, j) => { // a point with no neighbour draws no line: mark it
      const v = point[key], near = (k) => points[k] && points[k][key] !== null && points[k][key] !== undefined;
      if (v === null || v === undefined || point.t < -span || near(j - 1) || near(j + 1)) return;
      ctx.beginPath();
      ctx.arc(x(point.t), y(v), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    });
  });
}

let last = null;

function render(stats) {
  $("model-info").textContent = `${stats.model} · updated ${new Date().toLocaleTimeString()}`;
  for (const [key, , show] of TILES) {
    const value = stats.summary[key];
    $(`tile-${key}`).textContent = value === undefined ? "–" : show(value);
  }
  for (const [id, , series, unit] of CHARTS) {
    drawChart($(`chart-${id}`), stats.points, series, unit);
    const latest = stats.points[stats.points.length - 1] || {};
    for (const [key] of series) {
      const item = $(`latest-${key}`);
      item.textContent = `${item.dataset.name}: ${format(latest[key], unit)}`;
    }
  }
  last = stats;
}

async function poll() {
  try {
    const response = await fetch("/dashboard/stats");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    $("model-info").textContent = `cannot read /dashboard/stats: ${error.message || error}`;
  }
  setTimeout(poll, 1000);
}

buildPage();
window.addEventListener("resize", () => { if (last) render(last); });
poll();
