"use strict";
// The status page: /metrics and /server_info read every second, each model's figures shown as the
// server states them (gauges and totals as they are; rates and percentiles from the change of its
// counters and histograms over the last minutes), plots drawn from the same readings.
(() => {
  const WINDOW_S = 300;  // percentiles and plots cover the last five minutes
  const $ = (id) => document.getElementById(id);
  const history = [];  // {t, models: {name: figures}} per reading, oldest first

  // Prometheus text -> [{name, labels, value}]
  function parse(text) {
    const out = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      for (const pair of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
      out.push({ name: m[1], labels, value: Number(m[4]) });
    }
    return out;
  }

  function byModel(samples) {
    const models = {};
    for (const s of samples) {
      const model = s.labels.model_name;
      if (model === undefined) continue;
      const figures = (models[model] = models[model] || { buckets: {} });
      const add = (key) => { figures[key] = (figures[key] || 0) + s.value; };
      switch (s.name) {
        case "vllm:num_requests_running": add("running"); break;
        case "vllm:num_requests_waiting": add("waiting"); break;
        case "vllm:kv_cache_usage_perc": figures.kv = s.value; break;
        case "vllm:prefix_cache_hits_total": add("prefixHits"); break;
        case "vllm:prefix_cache_queries_total": add("prefixQueries"); break;
        case "vllm:prompt_tokens_total": add("promptTokens"); break;
        case "vllm:generation_tokens_total": add("generationTokens"); break;
        case "vllm:request_success_total": add("finished"); break;
        case "vllm:num_preemptions_total": add("preemptions"); break;
        case "vllm:time_to_first_token_seconds_bucket":
        case "vllm:inter_token_latency_seconds_bucket": {
          const key = s.name.startsWith("vllm:time") ? "ttft" : "itl";
          const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
          const buckets = (figures.buckets[key] = figures.buckets[key] || {});
          buckets[le] = (buckets[le] || 0) + s.value;
          break;
        }
        default:
      }
    }
    return models;
  }

  // The q-quantile of the observations between two cumulative bucket readings, interpolated in its bucket.
  function quantile(now, then, q) {
    if (!now) return null;
    const bounds = Object.keys(now).map(Number).sort((a, b) => a - b);
    const counts = bounds.map((b) => now[b] - ((then && then[b]) || 0));
    const total = counts[counts.length - 1];
    if (!total) return null;
    const rank = q * total;
    for (let i = 0; i < bounds.length; i++) {
      if (counts[i] >= rank) {
        const lower = i ? bounds[i - 1] : 0;
        const below = i ? counts[i - 1] : 0;
        if (!isFinite(bounds[i])) return lower;
        return lower + (bounds[i] - lower) * ((rank - below) / Math.max(1e-9, counts[i] - below));
      }
    }
    return bounds[bounds.length - 2];
  }

  function seconds(value) {
    if (value === null) return "\u2013";
    return value < 1 ? (value * 1000).toFixed(0) + " ms" : value.toFixed(2) + " s";
  }

  // Over the readings of the window; with no observation there yet, over everything since the server started.
  function percentiles(f, oldest, key) {
    const qs = [0.5, 0.9, 0.99];
    let values = qs.map((q) => quantile(f.buckets[key], oldest && oldest.buckets[key], q));
    let suffix = "";
    if (values[0] === null) {
      values = qs.map((q) => quantile(f.buckets[key], null, q));
      if (values[0] !== null) suffix = " (since start)";
    }
    return values.map(seconds).join(" / ") + suffix;
  }

  function card(name, f, previous, oldest) {
    const dt = previous ? (f.t - previous.t) : 0;
    const rate = (key) => (previous && dt > 0 ? ((f[key] || 0) - (previous[key] || 0)) / dt : 0);
    const section = document.createElement("article");
    section.className = "model-card";
    const title = document.createElement("h2");
    title.textContent = name;
    section.append(title);
    const rows = [
      ["running", "Running requests", String(f.running || 0)],
      ["waiting", "Waiting requests", String(f.waiting || 0)],
      ["kv", "KV cache use", ((f.kv || 0) * 100).toFixed(1) + " %"],
      ["prefix", "Prefix cache hits", f.prefixQueries ? (100 * f.prefixHits / f.prefixQueries).toFixed(1) + " %" : "\u2013"],
      ["prompt-rate", "Prompt tokens/s", rate("promptTokens").toFixed(1)],
      ["generation-rate", "Generated tokens/s", rate("generationTokens").toFixed(1)],
      ["ttft", "Time to first token p50 / p90 / p99", percentiles(f, oldest, "ttft")],
      ["itl", "Inter-token latency p50 / p90 / p99", percentiles(f, oldest, "itl")],
      ["finished", "Requests finished", String(f.finished || 0)],
      ["prompt-tokens", "Prompt tokens", String(f.promptTokens || 0)],
      ["generation-tokens", "Generated tokens", String(f.generationTokens || 0)],
      ["preemptions", "Preemptions", String(f.preemptions || 0)],
    ];
    const list = document.createElement("dl");
    for (const [key, label, value] of rows) {
      const dt_ = document.createElement("dt");
      dt_.textContent = label;
      const dd = document.createElement("dd");
      dd.dataset.metric = key;
      dd.textContent = value;
      list.append(dt_, dd);
    }
    section.append(list);
    return section;
  }

  function plot(canvas, series, colors, scaleMax) {
    const ctx = canvas.getContext("2d");
    const { width, height } = canvas;
    ctx.clearRect(0, 0, width, height);
    const max = Math.max(scaleMax || 0, 1e-9, ...series.flat());
    ctx.strokeStyle = "#8884";
    ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
    ctx.fillStyle = "#888";
    ctx.font = "11px sans-serif";
    ctx.fillText(max.toFixed(max < 10 ? 1 : 0), 4, 12);
    series.forEach((points, i) => {
      ctx.strokeStyle = colors[i];
      ctx.beginPath();
      points.forEach((v, j) => {
        const x = points.length < 2 ? 0 : (j / (points.length - 1)) * (width - 2) + 1;
        const y = height - 2 - (v / max) * (height - 16);
        if (j) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
      });
      ctx.stroke();
    });
  }

  function drawCharts() {
    const totals = history.map((h) => {
      const sum = (key) => Object.values(h.models).reduce((a, f) => a + (f[key] || 0), 0);
      return { t: h.t, prompt: sum("promptTokens"), gen: sum("generationTokens"), running: sum("running"),
        waiting: sum("waiting"), kv: Math.max(0, ...Object.values(h.models).map((f) => f.kv || 0)) };
    });
    const rates = (key) => totals.slice(1).map((p, i) => Math.max(0, (p[key] - totals[i][key]) / Math.max(1e-3, p.t - totals[i].t)));
    plot($("chart-tokens"), [rates("prompt"), rates("gen")], ["#3b82f6", "#16a34a"]);
    plot($("chart-requests"), [totals.map((p) => p.running), totals.map((p) => p.waiting)], ["#16a34a", "#f59e0b"]);
    plot($("chart-kv"), [totals.map((p) => p.kv * 100)], ["#a855f7"], 100);
  }

  async function settings() {
    try {
      const info = await craneApi.json("/server_info");
      // A server of several models (its router) lists them instead: name, state and task, path.
      const entries = info.settings ? Object.entries(info.settings)
        : (info.models || []).map((m) => ["model " + m.id, { value: m.state + ", " + m.task, source: m.root }]);
      const rows = entries.map(([key, entry]) => {
        const tr = document.createElement("tr");
        for (const value of [key, JSON.stringify(entry && entry.value !== undefined ? entry.value : entry),
          entry && entry.source !== undefined ? String(entry.source) : ""]) {
          const td = document.createElement("td");
          td.textContent = value;
          tr.append(td);
        }
        return tr;
      });
      $("settings").tBodies[0].replaceChildren(...rows);
      return true;
    } catch (err) {
      return false;
    }
  }

  let haveSettings = false;
  let askedKey = false;

  async function refresh() {
    try {
      const models = byModel(parse(await craneApi.text("/metrics")));
      const t = performance.now() / 1000;
      for (const f of Object.values(models)) f.t = t;
      const previous = history.length ? history[history.length - 1] : null;
      history.push({ t, models });
      while (history.length > 2 && t - history[0].t > WINDOW_S) history.shift();
      const oldest = history.length > 1 ? history[0] : null;
      $("models").replaceChildren(...Object.entries(models).map(([name, f]) =>
        card(name, f, previous && previous.models[name], oldest && oldest.models[name])));
      drawCharts();
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
      $("notice").hidden = true;
      if (!haveSettings) haveSettings = await settings();
    } catch (err) {
      $("notice").textContent = err.message;
      $("notice").hidden = false;
      if (err.status === 401 && !askedKey) {
        askedKey = true;
        craneApi.setApiKey((window.prompt("This server wants an API key (kept in this tab only)") || "").trim());
      }
    }
    setTimeout(refresh, 1000);
  }

  refresh();
})();
