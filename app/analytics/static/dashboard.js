// The rtrl analytics dashboard: reads /analytics/* (the sign-in cookie goes along) and draws SVG.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c"];
const STATUS_COLORS = {
  production: "#2b8a3e", canary: "#e67700", candidate: "#2f6fde",
  retired: "#9aa3b5", rolled_back: "#b3261e",
};
const ARM_METRICS = [
  ["acceptance_rate", "Acceptance rate"], ["kept", "Kept (edit survival)"],
  ["dissatisfied_rate", "Dissatisfied follow-ups"], ["mean_reward", "Mean reward"],
  ["latency_p50_ms", "Latency p50 (ms)"], ["latency_p95_ms", "Latency p95 (ms)"],
  ["latency_p99_ms", "Latency p99 (ms)"], ["malformed_call_rate", "Malformed tool calls"],
  ["edit_rate", "Edit rate"], ["error_rate", "Error rate"],
];

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!response.ok) {
    throw new Error(`${path}: ${response.status}`);
  }
  return response.json();
}

function node(tag, attributes = {}, parent = null, text = null) {
  const element = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    element.setAttribute(name, String(value));
  }
  if (text !== null) element.textContent = text;
  if (parent) parent.appendChild(element);
  return element;
}

function format(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Math.abs(value) >= 100 ? value.toFixed(0) : value.toPrecision(digits);
}

function scale(domainLow, domainHigh, rangeLow, rangeHigh) {
  const span = domainHigh - domainLow || 1;
  return (value) => rangeLow + ((value - domainLow) / span) * (rangeHigh - rangeLow);
}

function chartBox(parent, title, width, height) {
  const box = node("div", { class: "chart" }, parent);
  node("h3", {}, box, title);
  return node("svg:svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" }, box);
}

// The comparison shown: CUPED's when it was asked for and could be made.
function versus(metric, results) {
  return (results.cuped && metric.cuped) || metric.vs_control;
}

// One metric: a dot per arm, an error bar for each treatment arm, a dashed line at control.
function drawArmMetric(parent, results, metric, title) {
  const arms = results.arms.filter((arm) => arm.metrics[metric] && arm.metrics[metric].value !== null);
  if (arms.length === 0) return;
  const control = arms.find((arm) => arm.is_control);
  const controlValue = control ? control.metrics[metric].value : null;
  const intervals = arms.map((arm) => {
    const m = arm.metrics[metric];
    const vs = versus(m, results);
    if (arm.is_control || !vs || vs.ci_low === null || controlValue === null) return [m.value, m.value];
    return [controlValue + vs.ci_low, controlValue + vs.ci_high];
  });
  const values = intervals.flat().concat(arms.map((arm) => arm.metrics[metric].value));
  let low = Math.min(...values);
  let high = Math.max(...values);
  const pad = (high - low) * 0.15 || Math.abs(high) * 0.1 || 1;
  low -= pad;
  high += pad;
  const width = 330;
  const rowHeight = 26;
  const height = 30 + rowHeight * arms.length;
  const svg = chartBox(parent, title, width, height);
  svg.setAttribute("data-metric", metric);
  const x = scale(low, high, 90, width - 12);
  node("svg:line", { class: "axis", x1: 90, x2: width - 12, y1: height - 18, y2: height - 18 }, svg);
  node("svg:text", { x: 90, y: height - 4 }, svg, format(low));
  node("svg:text", { x: width - 12, y: height - 4, "text-anchor": "end" }, svg, format(high));
  if (controlValue !== null) {
    node("svg:line", { class: "control", x1: x(controlValue), x2: x(controlValue), y1: 4, y2: height - 18 }, svg);
  }
  arms.forEach((arm, index) => {
    const y = 16 + index * rowHeight;
    const color = COLORS[index % COLORS.length];
    const metricValue = arm.metrics[metric];
    node("svg:text", { x: 4, y: y + 4 }, svg, arm.arm);
    const [from, to] = intervals[index];
    if (from !== to) {
      node("svg:line", { class: "bar", x1: x(from), x2: x(to), y1: y, y2: y, stroke: color }, svg);
      for (const end of [from, to]) {
        node("svg:line", { class: "bar", x1: x(end), x2: x(end), y1: y - 5, y2: y + 5, stroke: color }, svg);
      }
    }
    const dot = node("svg:circle", { cx: x(metricValue.value), cy: y, r: 4, fill: color }, svg);
    const vs = versus(metricValue, results);
    const detail = vs
      ? `${format(metricValue.value)} (Δ ${format(vs.difference)}, p=${format(vs.p_value, 2)})`
      : format(metricValue.value);
    node("svg:title", {}, dot, `${arm.arm}: ${detail}`);
  });
}

function drawArmTable(table, results) {
  table.replaceChildren();
  const head = node("tr", {}, node("thead", {}, table));
  ["metric", ...results.arms.map((arm) => arm.arm)].forEach((label) => node("th", {}, head, label));
  const body = node("tbody", {}, table);
  const rows = [
    ["users", (arm) => String(arm.users)],
    ["switched users (left out)", (arm) => String(arm.switched_users)],
    ["requests", (arm) => String(arm.requests)],
  ];
  for (const [metric, title] of ARM_METRICS) {
    rows.push([title, (arm) => {
      const m = arm.metrics[metric];
      if (!m) return "–";
      const vs = versus(m, results);
      if (!vs) return format(m.value);
      const lift = vs.relative_difference === null ? "" : ` ${(vs.relative_difference * 100).toFixed(1)}%`;
      const saved = vs.variance_reduction === null || vs.variance_reduction === undefined
        ? "" : `, CUPED −${(vs.variance_reduction * 100).toFixed(0)}% variance`;
      return `${format(m.value)} (${vs.difference >= 0 ? "+" : ""}${format(vs.difference)}${lift}, ` +
        `[${format(vs.ci_low)}, ${format(vs.ci_high)}], p=${format(vs.p_value, 2)}${saved})`;
    }]);
  }
  for (const [label, cell] of rows) {
    const row = node("tr", {}, body);
    node("td", {}, row, label);
    results.arms.forEach((arm) => node("td", {}, row, cell(arm)));
  }
}

async function showExperiment(id) {
  const cuped = document.getElementById("cuped-toggle").checked ? "?cuped=true" : "";
  const results = await api(`/analytics/experiments/${encodeURIComponent(id)}/results${cuped}`);
  const experiment = results.experiment;
  document.getElementById("experiment-summary").textContent =
    `${experiment.name}: ${experiment.status}, route ${experiment.route}, arms ` +
    experiment.arms.map((arm) => `${arm.name}=${arm.checkpoint} (${arm.weight_bps / 100}%)`).join(", ");
  const ratio = document.getElementById("sample-ratio");
  const srm = results.sample_ratio;
  ratio.className = srm && srm.mismatch ? "mismatch" : "muted";
  ratio.textContent = srm
    ? `Sample ratio of users at first exposure ${srm.mismatch ? "MISMATCH — results unreliable" : "OK"} ` +
      `(χ² p=${format(srm.p_value, 2)} over ${srm.ramp_periods} ramp period${srm.ramp_periods === 1 ? "" : "s"})`
    : "Sample ratio: no users yet";
  const charts = document.getElementById("arm-charts");
  charts.replaceChildren();
  for (const [metric, title] of ARM_METRICS) drawArmMetric(charts, results, metric, title);
  drawArmTable(document.getElementById("arm-table"), results);
}

// One line per checkpoint over time.
function drawTrend(parent, series, field, title) {
  const lines = series
    .map((s) => ({ name: s.checkpoint, points: s.buckets.filter((b) => b[field] !== null).map((b) => [Date.parse(b.start), b[field]]) }))
    .filter((line) => line.points.length > 0);
  if (lines.length === 0) return;
  const all = lines.flatMap((line) => line.points);
  const times = all.map((p) => p[0]);
  const values = all.map((p) => p[1]);
  const width = 480;
  const height = 220;
  const svg = chartBox(parent, title, width, height);
  svg.setAttribute("data-trend", field);
  const x = scale(Math.min(...times), Math.max(...times), 48, width - 110);
  const low = Math.min(...values);
  const high = Math.max(...values);
  const y = scale(low - (high - low) * 0.1, high + (high - low) * 0.1, height - 24, 10);
  node("svg:line", { class: "axis", x1: 48, x2: width - 110, y1: height - 24, y2: height - 24 }, svg);
  node("svg:line", { class: "axis", x1: 48, x2: 48, y1: 10, y2: height - 24 }, svg);
  node("svg:text", { x: 44, y: y(high) + 4, "text-anchor": "end" }, svg, format(high));
  node("svg:text", { x: 44, y: y(low) + 4, "text-anchor": "end" }, svg, format(low));
  node("svg:text", { x: 48, y: height - 8 }, svg, new Date(Math.min(...times)).toISOString().slice(0, 10));
  node("svg:text", { x: width - 110, y: height - 8, "text-anchor": "end" }, svg,
    new Date(Math.max(...times)).toISOString().slice(0, 10));
  lines.forEach((line, index) => {
    const color = COLORS[index % COLORS.length];
    const d = line.points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    node("svg:path", { d, fill: "none", stroke: color, "stroke-width": 2 }, svg);
    line.points.forEach((p) => node("svg:circle", { cx: x(p[0]), cy: y(p[1]), r: 2.5, fill: color }, svg));
    node("svg:text", { x: width - 104, y: 20 + index * 16, fill: color }, svg, line.name);
  });
}

function drawLineage(parent, checkpoints) {
  parent.replaceChildren();
  if (checkpoints.length === 0) return;
  const byName = new Map(checkpoints.map((c) => [c.name, c]));
  const depth = (c, seen = 0) => (c.parent && byName.has(c.parent) && seen < 1000 ? 1 + depth(byName.get(c.parent), seen + 1) : 0);
  const rowHeight = 24;
  const width = 640;
  const height = 16 + rowHeight * checkpoints.length;
  const svg = node("svg:svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "data-lineage": "" }, parent);
  const position = new Map();
  checkpoints.forEach((c, row) => position.set(c.name, [20 + depth(c) * 28, 14 + row * rowHeight]));
  for (const c of checkpoints) {
    if (c.parent && position.has(c.parent)) {
      const [x1, y1] = position.get(c.parent);
      const [x2, y2] = position.get(c.name);
      node("svg:path", { d: `M${x1},${y1} V${y2} H${x2}`, fill: "none", class: "axis" }, svg);
    }
  }
  for (const c of checkpoints) {
    const [cx, cy] = position.get(c.name);
    node("svg:circle", { cx, cy, r: 6, fill: STATUS_COLORS[c.status] || "#5b6477" }, svg);
    const superseded = c.superseded_by ? ` (superseded by ${c.superseded_by})` : "";
    node("svg:text", { x: cx + 12, y: cy + 4 }, svg, `${c.name} · ${c.status}${superseded}`);
  }
}

function drawTrainingRuns(table, runs) {
  table.replaceChildren();
  const head = node("tr", {}, node("thead", {}, table));
  ["run", "started", "status", "samples", "precision", "mean |Δ|", "max |Δ|", "KL", "capped", "outcome"]
    .forEach((h) => node("th", {}, head, h));
  const body = node("tbody", {}, table);
  if (runs.length === 0) {
    node("td", { colspan: 10 }, node("tr", {}, body), "No training runs.");
  }
  for (const run of runs) {
    const row = node("tr", { "data-run": run.id }, body);
    const precision = run.dtype ? `${run.dtype} × ${run.ranks}` : "–";
    const capped = run.drift_capped_share === null ? "–" : `${(100 * run.drift_capped_share).toFixed(2)}%`;
    const outcome = run.checkpoint ? `published ${run.checkpoint}` : run.reason || "";
    [`${run.id} (${run.trigger || "–"})`, run.started_at.slice(0, 16).replace("T", " "), run.status,
      run.sample_count, precision, format(run.drift_mean_abs, 2), format(run.drift_max_abs, 2),
      format(run.drift_kl, 2), capped, outcome]
      .forEach((cell) => node("td", {}, row, String(cell)));
    if (run.status === "refused") row.lastChild.setAttribute("class", "mismatch");
  }
}

function interval(low, high) {
  return low === null || high === null ? "" : ` [${format(low)}, ${format(high)}]`;
}

function drawPredictions(summaryTable, table, scoreboard) {
  summaryTable.replaceChildren();
  const summaryHead = node("tr", {}, node("thead", {}, summaryTable));
  ["metric", "compared", "sign agrees", "realized in interval", "consistent", "mean |error|", "unreliable"]
    .forEach((h) => node("th", {}, summaryHead, h));
  const summaryBody = node("tbody", {}, summaryTable);
  const share = (value) => (value === null ? "–" : `${Math.round(100 * value)}%`);
  for (const score of scoreboard.scores) {
    const row = node("tr", { "data-metric": score.metric }, summaryBody);
    [score.metric, score.compared, share(score.sign_agreement), share(score.realized_in_interval),
      share(score.consistent), format(score.mean_abs_error), share(score.unreliable_share)]
      .forEach((cell) => node("td", {}, row, String(cell)));
  }
  table.replaceChildren();
  const head = node("tr", {}, node("thead", {}, table));
  ["run", "candidate", "metric", "predicted", "realized", "sign", "in interval", "trust"]
    .forEach((h) => node("th", {}, head, h));
  const body = node("tbody", {}, table);
  if (scoreboard.records.length === 0) {
    node("td", { colspan: 8 }, node("tr", {}, body), "No predictions yet.");
  }
  const yesNo = (value) => (value === null ? "–" : value ? "yes" : "no");
  for (const record of scoreboard.records) {
    for (const metric of record.metrics) {
      const row = node("tr", { "data-run": record.training_run_id }, body);
      [record.training_run_id, record.checkpoint || record.status, metric.metric,
        format(metric.predicted) + interval(metric.predicted_ci_low, metric.predicted_ci_high),
        metric.realized === null ? "awaiting canary" : format(metric.realized) + interval(metric.realized_ci_low, metric.realized_ci_high),
        yesNo(metric.sign_agrees), yesNo(metric.realized_in_interval),
        metric.reliable ? "reliable" : `unreliable: ${metric.unreliable.join("; ")}`]
        .forEach((cell) => node("td", {}, row, String(cell)));
      if (!metric.reliable) row.lastChild.setAttribute("class", "mismatch");
    }
  }
}

function drawAlerts(table, alerts) {
  table.replaceChildren();
  const head = node("tr", {}, node("thead", {}, table));
  ["when", "checkpoint", "metric", "canary", "control", "threshold"].forEach((h) => node("th", {}, head, h));
  const body = node("tbody", {}, table);
  if (alerts.length === 0) {
    node("td", { colspan: 6 }, node("tr", {}, body), "No alerts.");
  }
  for (const alert of alerts) {
    const row = node("tr", {}, body);
    [alert.created_at.slice(0, 16).replace("T", " "), `${alert.checkpoint} vs ${alert.control_checkpoint}`,
      alert.metric, format(alert.canary_value), format(alert.control_value), format(alert.threshold)]
      .forEach((cell) => node("td", {}, row, cell));
  }
}

async function main() {
  const status = document.getElementById("status");
  try {
    const [experiments, series, checkpoints, alerts, runs, scoreboard] = await Promise.all([
      api("/analytics/experiments"),
      api("/analytics/timeseries?bucket=day"),
      api("/analytics/lineage"),
      api("/analytics/alerts"),
      api("/analytics/training-runs"),
      api("/analytics/predictions"),
    ]);
    const select = document.getElementById("experiment-select");
    for (const experiment of experiments) {
      node("option", { value: experiment.id }, select, `${experiment.name} (${experiment.status})`);
    }
    const show = () => showExperiment(select.value).catch((e) => { status.textContent = e.message; });
    select.addEventListener("change", show);
    document.getElementById("cuped-toggle").addEventListener("change", show);
    const trends = document.getElementById("trend-charts");
    drawTrend(trends, series.series, "mean_reward", "Mean reward per checkpoint (daily)");
    drawTrend(trends, series.series, "kept", "Kept rate per checkpoint (daily)");
    drawTrend(trends, series.series, "dissatisfied_rate", "Dissatisfied rate per checkpoint (daily)");
    drawLineage(document.getElementById("lineage-chart"), checkpoints);
    drawAlerts(document.getElementById("alerts-table"), alerts);
    drawTrainingRuns(document.getElementById("training-runs-table"), runs);
    drawPredictions(document.getElementById("predictions-summary"),
      document.getElementById("predictions-table"), scoreboard);
    if (experiments.length > 0) await showExperiment(experiments[0].id);
    document.body.setAttribute("data-ready", "true");
  } catch (error) {
    status.textContent = `Could not load: ${error.message}`;
    document.body.setAttribute("data-ready", "error");
  }
}

document.addEventListener("DOMContentLoaded", main);
