// corral's live page: reads /stats?fleet=1 every second and shows rates
// (from two readings), totals, flights, instances and bounds. Everything
// from the data path is set as text (textContent), never as markup.
"use strict";

const OUTCOMES = ["hit", "stale", "miss", "collapsed", "pass", "error"];
const COLOURS = {
  hit: "#2f6f4f", stale: "#8a9a3b", miss: "#c76b00", collapsed: "#3d6fb6",
  pass: "#7a7a7a", error: "#b33a3a", origin: "#1d2327",
};
const HISTORY = 120;

// Each instance's last reading and the rates it gave: an instance's
// figures change only when it reports (the others' through their
// heartbeats, every 2 s), so each rate is made of that instance's own two
// readings, and the fleet's are their sum.
const seen = new Map(); // instance -> { at, summary, rates }
let readings = 0;
const history = []; // { rates: {outcome: rate}, origin: rate }

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
  const r = { origin: rate(t.origin_requests, b.origin_requests, dt) };
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
  const out = { origin: 0 };
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
    ]);
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

  // Instances gone from the fleet are forgotten.
  [...seen.keys()].forEach((k) => { if (!perInstance.has(k)) seen.delete(k); });
  if (have) {
    history.push({ rates, origin: originRate });
    while (history.length > HISTORY) history.shift();
    chart();
  }
}

function chart() {
  const svg = byId("chart");
  const ns = "http://www.w3.org/2000/svg";
  const w = 600;
  const h = 160;
  let max = 1;
  history.forEach((p) => OUTCOMES.concat(["origin"]).forEach((o) => {
    max = Math.max(max, o === "origin" ? p.origin : p.rates[o]);
  }));
  const lines = OUTCOMES.concat(["origin"]).map((o) => {
    const points = history.map((p, i) => {
      const x = (w * (HISTORY - history.length + i)) / (HISTORY - 1);
      const v = o === "origin" ? p.origin : p.rates[o];
      return x.toFixed(1) + "," + (h - 4 - ((h - 8) * v) / max).toFixed(1);
    }).join(" ");
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points);
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLOURS[o]);
    line.setAttribute("stroke-width", o === "origin" ? "2.5" : "1.5");
    if (o === "origin") line.setAttribute("stroke-dasharray", "4 3");
    return line;
  });
  svg.replaceChildren(...lines);
}

function legend() {
  const items = OUTCOMES.concat(["origin"]).map((o) => {
    const li = document.createElement("li");
    li.textContent = o === "origin" ? "origin requests" : o;
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

document.addEventListener("DOMContentLoaded", () => {
  legend();
  tick();
  setInterval(tick, 1000);
});
