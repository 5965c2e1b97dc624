// corral's live page: reads /stats?fleet=1 every second and shows rates
// (from two readings), totals, flights, instances and bounds; on opening
// it reads /history, so its chart starts 15 minutes back. Everything from
// the data path is set as text (textContent), never as markup.
"use strict";

const OUTCOMES = ["hit", "stale", "miss", "collapsed", "pass", "error"];
const COLOURS = {
  hit: "#2f6f4f", stale: "#8a9a3b", miss: "#c76b00", collapsed: "#3d6fb6",
  pass: "#7a7a7a", error: "#b33a3a", origin: "#1d2327", errors: "#e0452b",
};
// What the chart draws: the outcomes, the origin's requests and its errors.
const SERIES = OUTCOMES.concat(["origin", "errors"]);
const WINDOW_MS = 15 * 60 * 1000;
// The chart spans what it has, at least two minutes and at most 15.
const LEAST_MS = 2 * 60 * 1000;
// Time-axis steps: about five ticks over the span.
const STEPS_MS = [15, 30, 60, 120, 180, 300].map((s) => s * 1000);

// Each instance's last reading and the rates it gave: an instance's
// figures change only when it reports (the others' through their
// heartbeats, every 2 s), so each rate is made of that instance's own two
// readings, and the fleet's are their sum.
const seen = new Map(); // instance -> { at, summary, rates }
let readings = 0;
// Oldest first: { at (ms), v: {series: rate}, trouble: a circuit or the
// Redis breaker was open }.
const history = [];

function byId(id) { return document.getElementById(id); }

function text(id, value) {
  const el = byId(id);
  if (el) el.textContent = value;
}

function fmt(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (Math.abs(n) >= 100 || Number.isInteger(n)) return Math.round(n).toLocaleString("en-US");
  return n.toFixed(1);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function duration(ms) {
  if (ms < 1000) return ms + " ms";
  const s = Math.floor(ms / 1000);
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min";
  return Math.floor(s / 3600) + " h";
}

function clients(t) { return OUTCOMES.reduce((a, o) => a + (t.requests[o] || 0), 0); }
function saved(t) { return Math.max(0, clients(t) - t.origin_requests); }

// Per-second rate of a counter between two readings (0 when it went back:
// the instance restarted).
function rate(now, before, dt) {
  if (before === undefined || dt <= 0) return 0;
  return Math.max(0, (now - before) / dt);
}

// The rates of one traffic record between two readings.
function trafficRates(t, b, dt) {
  const r = {
    origin: rate(t.origin_requests, b.origin_requests, dt),
    errors: rate(t.origin_errors || 0, b.origin_errors || 0, dt),
  };
  OUTCOMES.forEach((o) => { r[o] = rate(t.requests[o] || 0, b.requests[o], dt); });
  return r;
}

// An instance's rates: from its own last two readings; those of its last
// report when it has not reported since; none before its second.
function instanceRates(summary) {
  const last = seen.get(summary.instance);
  if (last && summary.at_ms === last.at) return last.rates;
  let rates = null;
  if (last && summary.at_ms > last.at) {
    const dt = (summary.at_ms - last.at) / 1000;
    const routes = {};
    summary.routes.forEach((r) => {
      const b = last.summary.routes.find((x) => x.name === r.name);
      if (b) routes[r.name] = trafficRates(r, b, dt);
    });
    rates = { totals: trafficRates(summary.totals, last.summary.totals, dt), routes };
  }
  seen.set(summary.instance, { at: summary.at_ms, summary, rates });
  return rates;
}

function sumRates(list) {
  const out = { origin: 0, errors: 0 };
  OUTCOMES.forEach((o) => { out[o] = 0; });
  list.forEach((r) => { if (r) Object.keys(out).forEach((k) => { out[k] += r[k] || 0; }); });
  return out;
}

function row(cells, classes) {
  const tr = document.createElement("tr");
  cells.forEach((c, i) => {
    const td = document.createElement("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c;
    if (classes && classes[i]) td.className = classes[i];
    tr.appendChild(td);
  });
  return tr;
}

function fill(tableId, rows) {
  const body = byId(tableId).tBodies[0];
  body.replaceChildren(...rows);
}

function bar(used, limit) {
  const outer = document.createElement("div");
  outer.className = "bar";
  const inner = document.createElement("div");
  const share = limit > 0 ? Math.min(1, used / limit) : 0;
  inner.style.width = (share * 100).toFixed(1) + "%";
  if (share > 0.85) outer.className = "bar near";
  outer.appendChild(inner);
  return outer;
}

function render(fleet) {
  const t = fleet.totals;
  const perInstance = new Map(fleet.instances.map((i) => [i.instance, instanceRates(i)]));
  const known = [...perInstance.values()].filter((r) => r);
  const have = known.length > 0;
  const rates = sumRates(known.map((r) => r.totals));
  const clientRate = OUTCOMES.reduce((a, o) => a + rates[o], 0);
  const originRate = rates.origin;

  text("total-clients", fmt(clients(t)));
  text("total-origin", fmt(t.origin_requests));
  text("total-saved", fmt(saved(t)));
  text("saved-hit", fmt(t.saved.hit || 0));
  text("saved-collapsed", fmt(t.saved.collapsed || 0));
  text("saved-stale", fmt(t.saved.stale || 0));
  text("rate-clients", have ? fmt(clientRate) : "–");
  text("rate-origin", have ? fmt(originRate) : "–");
  text("rate-saved", have ? fmt(Math.max(0, clientRate - originRate)) : "–");
  text("rate-origin-errors", have ? fmt(rates.errors) : "–");
  text("total-origin-errors", fmt(t.origin_errors || 0));
  // Fresh answers only: a stale one (an origin outage served from the
  // store) is shown beside the ratio, never inside it.
  text("hit-ratio", clientRate > 0 ? (rates.hit / clientRate * 100).toFixed(1) + " %" : "–");
  text("stale-ratio", clientRate > 0 ? (rates.stale / clientRate * 100).toFixed(1) + " %" : "–");

  fill("outcomes", OUTCOMES.map((o) => {
    const tr = row([o, have ? fmt(rates[o]) : "–", fmt(t.requests[o] || 0)]);
    tr.dataset.outcome = o;
    return tr;
  }));

  // Routes, summed over the instances.
  const routes = new Map();
  fleet.instances.forEach((i) => i.routes.forEach((r) => {
    const into = routes.get(r.name) || { requests: {}, origin_requests: 0, open: false, rates: [] };
    OUTCOMES.forEach((o) => { into.requests[o] = (into.requests[o] || 0) + (r.requests[o] || 0); });
    into.origin_requests += r.origin_requests;
    into.open = into.open || r.circuit === "open";
    const ir = perInstance.get(i.instance);
    if (ir && ir.routes[r.name]) into.rates.push(ir.routes[r.name]);
    routes.set(r.name, into);
  }));
  fill("routes", [...routes.entries()].map(([name, r]) => {
    const known = r.rates.length > 0;
    const rr = sumRates(r.rates);
    const all = OUTCOMES.reduce((a, o) => a + rr[o], 0);
    const tr = row([
      name, known ? fmt(all) : "–", ...OUTCOMES.map((o) => (known ? fmt(rr[o]) : "–")),
      known ? fmt(rr.origin) : "–", fmt(saved(r)),
      all > 0 ? (rr.hit / all * 100).toFixed(1) + " %" : "–",
      r.open ? "open" : "closed",
    ], [null, null, null, null, null, null, null, null, null, null, null, r.open ? "open" : null]);
    tr.dataset.route = name;
    return tr;
  }));

  // Flights, busiest first, over every instance.
  const flights = [];
  let inProgress = 0;
  let backoff = 0;
  fleet.instances.forEach((i) => {
    inProgress += i.flights.in_progress;
    backoff += i.flights.backoff_keys;
    i.flights.busiest.forEach((f) => flights.push({ ...f, instance: i.instance }));
  });
  flights.sort((a, b) => b.waiting - a.waiting);
  text("flights-in-progress", fmt(inProgress));
  text("backoff-keys", fmt(backoff));
  fill("flights", flights.slice(0, 10).map((f) =>
    row([f.key, fmt(f.waiting), duration(f.age_ms), f.instance], ["key"])));
  const backedOff = [];
  fleet.instances.forEach((i) => (i.flights.backoff || []).forEach((b) =>
    backedOff.push(row([b.key, duration(b.remaining_ms), i.instance], ["key"]))));
  fill("backoff", backedOff.slice(0, 10));

  // Instances.
  text("instance-count", fmt(fleet.instances.length));
  const withheld = fleet.withheld ? `; ${fleet.withheld} more withheld: their view needs a token` : "";
  text("fleet-source", (fleet.source === "redis" ? "(every instance sharing this Redis" : "(this instance") + withheld + ")");
  fill("instances", fleet.instances.map((i) => {
    const ir = perInstance.get(i.instance);
    const ic = ir ? OUTCOMES.reduce((a, o) => a + ir.totals[o], 0) : null;
    const redis = i.redis.mode === "off" ? "off"
      : i.redis.mode + ", " + i.redis.link + (i.redis.breaker_open ? ", breaker open" : "")
        + (i.redis.primaries && i.redis.primaries.length
          ? ", primaries: " + i.redis.primaries.map((p) => p.node + (p.breaker_open ? " (breaker open)" : "")).join(", ")
          : "");
    const l2 = i.redis.l2_reads;
    const tr = row([
      i.instance, i.listen, duration(i.uptime_s * 1000),
      ir ? fmt(ic) : "–", ir ? fmt(ir.totals.origin) : "–",
      redis, fmt(l2.hit || 0) + " / " + fmt(l2.miss || 0) + " / " + fmt(l2.corrupt || 0),
    ], [null, null, null, null, null, breakerOpen(i) ? "alarm" : null]);
    tr.dataset.instance = i.instance;
    return tr;
  }));

  // Bounds.
  const bounds = [];
  fleet.instances.forEach((i) => i.bounds.forEach((b) => {
    const show = b.unit === "bytes" ? bytes : fmt;
    bounds.push(row([i.instance, b.name, show(b.used), show(b.limit), bar(b.used, b.limit)]));
  }));
  fill("bounds", bounds);

  const circuits = [...routes.entries()].filter(([, r]) => r.open).map(([name]) => name);
  const breakers = fleet.instances.filter(breakerOpen).map((i) => i.instance);
  alarms(circuits, breakers, backoff);

  // Instances gone from the fleet are forgotten.
  [...seen.keys()].forEach((k) => { if (!perInstance.has(k)) seen.delete(k); });
  const at = Math.max(...fleet.instances.map((i) => i.at_ms));
  if (have && (history.length === 0 || at > history[history.length - 1].at)) {
    history.push({ at, v: rates, trouble: circuits.length > 0 || breakers.length > 0 });
    chart();
  }
}

// An instance's Redis breaker (or a Cluster primary's) is open.
function breakerOpen(i) {
  return i.redis.breaker_open || (i.redis.primaries || []).some((p) => p.breaker_open);
}

// The banner over the page: what an operator must see first.
function alarms(circuits, breakers, backoff) {
  const el = byId("alarms");
  const parts = [];
  if (breakers.length) parts.push("Redis breaker open: " + breakers.join(", "));
  if (circuits.length) parts.push("circuit open: " + circuits.join(", "));
  if (backoff > 0) parts.push("keys in back-off: " + fmt(backoff));
  el.textContent = parts.join(" · ");
  el.hidden = parts.length === 0;
  el.dataset.breaker = breakers.length ? "open" : "closed";
  el.dataset.circuit = circuits.length ? "open" : "closed";
}

// The least of 1, 2 and 5 times a power of ten that is at least v (1 at
// least): the top of the rate axis.
function niceCeil(v) {
  if (v <= 1) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((n) => n >= v);
}

// The past this instance kept (/history), as the chart's first points:
// a page opened during an incident shows what led to it.
async function loadHistory() {
  try {
    const res = await fetch("history", { cache: "no-store", credentials: "same-origin" });
    if (!res.ok) return;
    const points = (await res.json()).points || [];
    for (let i = 1; i < points.length; i++) {
      const [b, p] = [points[i - 1], points[i]];
      history.push({
        at: p.at_ms,
        v: trafficRates(p, b, (p.at_ms - b.at_ms) / 1000),
        trouble: p.redis_breaker_open || p.circuits_open.length > 0,
      });
    }
    const svg = byId("chart");
    svg.dataset.historyPoints = String(points.length);
    if (points.length) svg.dataset.since = String(points[0].at_ms);
    if (history.length) chart();
  } catch (e) {
    // The live readings go on without the past.
  }
}

// Rates over the last 15 minutes (or what there is of them): a time axis
// (clock time), a rate axis (requests / s), and the times a circuit or the
// Redis breaker was open shaded.
function chart() {
  const svg = byId("chart");
  const ns = "http://www.w3.org/2000/svg";
  const [w, h, left, right, top, bottom] = [720, 220, 56, 12, 10, 24];
  const pw = w - left - right;
  const ph = h - top - bottom;
  const end = history[history.length - 1].at;
  while (history.length > 1 && history[0].at < end - WINDOW_MS) history.shift();
  const start = Math.min(history[0].at, end - LEAST_MS);
  const span = end - start;
  const step = STEPS_MS.find((s) => s * 5 >= span) || STEPS_MS[STEPS_MS.length - 1];
  let max = 0;
  history.forEach((p) => SERIES.forEach((o) => { max = Math.max(max, p.v[o] || 0); }));
  const ceiling = niceCeil(max);
  const x = (at) => left + (pw * (at - start)) / span;
  const y = (v) => top + ph - (ph * v) / ceiling;
  const el = (name, attrs, content) => {
    const e = document.createElementNS(ns, name);
    Object.entries(attrs).forEach(([k, v]) => e.setAttribute(k, String(v)));
    if (content !== undefined) e.textContent = content;
    return e;
  };
  const out = [];
  history.forEach((p, i) => {
    if (!p.trouble) return;
    const from = i > 0 ? history[i - 1].at : p.at - 1000;
    out.push(el("rect", {
      class: "trouble", x: x(from).toFixed(1), y: top,
      width: Math.max(1, x(p.at) - x(from)).toFixed(1), height: ph,
    }));
  });
  [0, 0.5, 1].forEach((f) => {
    const at = y(ceiling * f).toFixed(1);
    out.push(el("line", { class: "grid", x1: left, x2: w - right, y1: at, y2: at }));
    out.push(el("text", { class: "axis-y", x: left - 6, y: Number(at) + 4, "text-anchor": "end" },
      fmt(ceiling * f) + " /s"));
  });
  const clock = step < 60000
    ? { hour: "2-digit", minute: "2-digit", second: "2-digit" }
    : { hour: "2-digit", minute: "2-digit" };
  for (let t = Math.ceil(start / step) * step; t <= end; t += step) {
    const at = x(t).toFixed(1);
    out.push(el("line", { class: "grid", x1: at, x2: at, y1: top, y2: top + ph }));
    out.push(el("text", { class: "axis-x", x: at, y: h - 6, "text-anchor": "middle" },
      new Date(t).toLocaleTimeString([], clock)));
  }
  SERIES.forEach((o) => {
    const points = history.map((p) => x(p.at).toFixed(1) + "," + y(p.v[o] || 0).toFixed(1)).join(" ");
    const line = el("polyline", { points, fill: "none", stroke: COLOURS[o],
      "stroke-width": o === "origin" || o === "errors" ? "2.5" : "1.5", "data-series": o });
    if (o === "origin") line.setAttribute("stroke-dasharray", "4 3");
    out.push(line);
  });
  svg.replaceChildren(...out);
  svg.dataset.points = String(history.length);
}

function legend() {
  const items = SERIES.map((o) => {
    const li = document.createElement("li");
    li.textContent = { origin: "origin requests", errors: "origin errors" }[o] || o;
    li.setAttribute("data-colour", COLOURS[o]);
    li.style.color = COLOURS[o];
    return li;
  });
  byId("legend").replaceChildren(...items);
}

async function tick() {
  const status = byId("status");
  try {
    const res = await fetch("stats?fleet=1", { cache: "no-store", credentials: "same-origin" });
    if (!res.ok) throw new Error("/stats answered " + res.status);
    const fleet = await res.json();
    const at = Math.max(...fleet.instances.map((i) => i.at_ms));
    render(fleet);
    readings += 1;
    status.className = "status";
    status.textContent = "updated " + new Date(at).toLocaleTimeString() + " · " +
      fleet.instances.length + (fleet.instances.length === 1 ? " instance" : " instances");
    document.body.dataset.updates = String(readings);
  } catch (e) {
    status.className = "status error";
    status.textContent = "no figures: " + e.message;
  }
}

document.addEventListener("DOMContentLoaded", async () => {
  legend();
  await loadHistory();
  tick();
  setInterval(tick, 1000);
});
