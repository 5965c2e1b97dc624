#!/usr/bin/env python3
"""Renders bench/results/latest.md from a bench/run.sh run: the records it
wrote (raw/records.jsonl) and the oha JSON files they name.

    bench/report.py RAW_DIR OUT.md [--elapsed SECONDS] [--duration 10s]

Every ratio compares a system with nginx in the same run (run 1 with run 1),
so the two runs show the noise of the ratio as well as of the numbers.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

SYSTEMS = ["corral", "nginx", "varnish"]


def sh(*cmd: str) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (p.stdout + p.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "n/a"


def load_oha(raw: str, name: str) -> dict:
    """The numbers the tables use from one oha JSON file (times in ms)."""
    try:
        with open(os.path.join(raw, name)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {"missing": True}
    s, lp = d.get("summary", {}), d.get("latencyPercentiles", {})
    codes = {k: v for k, v in (d.get("statusCodeDistribution") or {}).items()}
    errors = d.get("errorDistribution") or {}
    aborted = sum(v for k, v in errors.items() if "deadline" in k)
    ms = lambda v: None if v is None else v * 1000.0
    return {
        "rps": s.get("requestsPerSec"),
        "p50": ms(lp.get("p50")),
        "p99": ms(lp.get("p99")),
        "max": ms(s.get("slowest")),
        "codes": codes,
        "ok": codes.get("200", 0),
        "answers": sum(codes.values()),
        "errors": sum(errors.values()) - aborted,
        "error_kinds": {k: v for k, v in errors.items() if "deadline" not in k},
        "aborted": aborted,
    }


def load_capacity(raw: str, name: str) -> dict:
    """The numbers the tables use from one capacity-load JSON line, shaped
    as load_oha's (times in ms); `failed` answers count as errors."""
    try:
        with open(os.path.join(raw, name)) as f:
            d = json.loads(f.read())
    except (OSError, ValueError):
        return {"missing": True}
    answers, failed = d.get("answers", 0), d.get("failed", 0)
    return {
        "rps": d.get("rps"),
        "p50": d.get("p50_ms"),
        "p99": d.get("p99_ms"),
        "max": None,
        "codes": {"200": answers},
        "ok": answers,
        "answers": answers,
        "errors": failed,
        "error_kinds": {},
        "aborted": 0,
        "seconds": d.get("seconds"),
    }


def merge(parts: list) -> dict:
    """Five oha runs against five instances, seen as one load."""
    parts = [p for p in parts if not p.get("missing")]
    if not parts:
        return {"missing": True}
    codes: dict = {}
    for p in parts:
        for k, v in p["codes"].items():
            codes[k] = codes.get(k, 0) + v
    vals = lambda k: [p[k] for p in parts if p[k] is not None]
    return {
        "p50": statistics.median(vals("p50")) if vals("p50") else None,
        "p99": max(vals("p99"), default=None),
        "max": max(vals("max"), default=None),
        "codes": codes,
        "ok": codes.get("200", 0),
        "answers": sum(codes.values()),
        "errors": sum(p["errors"] for p in parts),
        "error_kinds": {},
        "aborted": sum(p["aborted"] for p in parts),
    }


def f_ms(v) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def f_num(v) -> str:
    return "–" if v is None else f"{v:,.0f}"


def f_ratio(a, b) -> str:
    if a is None or not b:
        return "–"
    return f"{a / b:.2f}×"


def cpu_per_answer(r: dict):
    """Server CPU (all of the system's processes) per answer, in µs."""
    m = r.get("m", {})
    if r.get("server_cpu") is None or not m.get("answers"):
        return None
    return r["server_cpu"] / m["answers"] * 1e6


def client_busy(r: dict, seconds: float):
    """How busy oha's core was during the load, 0..1."""
    if r.get("client_cpu") is None or not seconds:
        return None
    return r["client_cpu"] / seconds


def f_us(v) -> str:
    return "–" if v is None else f"{v:.1f}"


def f_pct(v) -> str:
    return "–" if v is None else f"{v * 100:.0f}%"


def non200(m: dict) -> str:
    bad = {k: v for k, v in m["codes"].items() if k != "200"}
    parts = [f"{v}×{k}" for k, v in sorted(bad.items())]
    if m["errors"]:
        parts.append(f"{m['errors']} conn. errors")
    return ", ".join(parts) if parts else "0"


def table(head: list, rows: list) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("out")
    ap.add_argument("--elapsed", type=int, default=None)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--commit", default=None, help="what the binaries were built from")
    a = ap.parse_args()
    recs = []
    with open(os.path.join(a.raw, "records.jsonl")) as f:
        for line in f:
            if line.strip():
                recs.append(json.loads(line))
    for r in recs:
        if "oha" in r:
            ms = [load_oha(a.raw, n) for n in r["oha"]]
            r["m"] = ms[0] if len(ms) == 1 else merge(ms)
        if "capacity" in r:
            r["m"] = load_capacity(a.raw, r["capacity"])
        if r.get("headers"):
            try:
                with open(os.path.join(a.raw, r["headers"])) as f:
                    r["sample"] = f.read().strip()
            except OSError:
                r["sample"] = ""

    def pick(scenario, **kw):
        rs = [r for r in recs if r["scenario"] == scenario and all(r.get(k) == v for k, v in kw.items())]
        rs.sort(key=lambda r: (r["run"], SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 9))
        return rs

    def nginx_rec(scenario, r, **kw):
        n = pick(scenario, system="nginx", run=r["run"], **kw)
        return n[0] if n else {}

    def nginx_of(scenario, r, **kw):
        m = nginx_rec(scenario, r, **kw).get("m", {})
        return {} if m.get("missing") else m

    def cpu_cells(r, nr):
        """CPU µs per answer, its ratio to nginx's (record `nr`), oha's core."""
        c = cpu_per_answer(r)
        return [f_us(c), f_ratio(c, cpu_per_answer(nr)), f_pct(client_busy(r, secs))]

    secs = float(a.duration.rstrip("s") or 0)

    def hit_rows(scenario, recs_, width, cells):
        """The rows of a hit table: body, system, run, req/s, p50 and p99
        against nginx's, then `cells(record, its numbers, nginx's record)`;
        `width` columns in all."""
        rows = []
        for size in sorted({r["size"] for r in recs_}):
            for r in pick(scenario, size=size):
                m, n = r["m"], nginx_of(scenario, r, size=size)
                if m.get("missing"):
                    rows.append([f"{size // 1024} KiB", r["system"], r["run"], "no data"] + [""] * (width - 4))
                    continue
                rows.append([
                    f"{size // 1024} KiB", r["system"], r["run"], f_num(m["rps"]), f_ratio(m["rps"], n.get("rps")),
                    f_ms(m["p50"]), f_ms(m["p99"]), f_ratio(m["p99"], n.get("p99")),
                    *cells(r, m, nginx_rec(scenario, r, size=size)),
                ])
        return rows


    L = []
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    built = a.commit or "built from commit " + sh("git", "rev-parse", "--short", "HEAD")
    cpu = "n/a"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "n/a")
    except OSError:
        pass
    L.append("# corral load benchmark: latest results\n")
    L.append(
        f"Produced by `bench/run.sh` on {now}; binaries {built}"
        + (f", in {a.elapsed // 60} min {a.elapsed % 60} s." if a.elapsed is not None else ".")
    )
    L.append(
        f"Machine: {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, shared with other work. "
        "Each server is pinned to core 0 with one worker (nginx `worker_processes 1`, "
        "varnishd `thread_pools=1`, corral `TOKIO_WORKER_THREADS=1`), the demo origin and Redis on core 0 too; "
        "oha is pinned to core 1 with one thread. Access logs off. Loopback only, so throughput is "
        "bounded by the one client core as much as by the server: read the ratios, not the absolute numbers."
    )
    L.append(
        f"Versions: {sh('oha', '--version')}; {sh('nginx', '-v')}; {sh('varnishd', '-V')}; "
        f"{sh('redis-server', '--version').split(' sha=')[0]}."
    )
    skips = [r for r in recs if r["scenario"] == "skip"]
    if skips:
        L.append("\nSkipped: " + "; ".join(f"{r['system']} ({r['reason']})" for r in skips) + ".")
    L.append(
        "\nEach scenario ran twice (run 1, run 2; the order of the systems is reversed in run 2). "
        "`×nginx` divides by nginx's number from the same run. Latencies in ms. "
        "`origin hits` come from the demo origin's per-path counters; every system uses its own paths."
    )

    # (a)
    hit = pick("hit")
    if hit:
        L.append(
            f"\n## (a) Cache hit: one hot key, 50 connections, {a.duration}\n\n"
            "`CPU µs/answer` is the server's CPU time (every process of the system, user + kernel) during the load "
            "divided by the answers it gave; `oha core` is how busy the client's core was. With oha's core near 100% "
            "the client, not the server, sets req/s: CPU per answer is then the fairer comparison.\n"
        )
        rows = hit_rows("hit", hit, 13, lambda r, m, nr: [*cpu_cells(r, nr), non200(m), r["origin_hits"]])
        L.append(table(["body", "system", "run", "req/s", "req/s ×nginx", "p50", "p99", "p99 ×nginx",
                        "CPU µs/answer", "CPU ×nginx", "oha core", "non-200", "origin hits"], rows))

    # (a2)
    cap = pick("capacity")
    if cap:
        L.append(
            f"\n## (a2) Cache hit at capacity: one hot key, 64 connections, {a.duration}\n\n"
            "As (a), but the load is `capacity-load` (one request in flight per keep-alive connection, as with oha, "
            "at a fraction of oha's CPU per answer), so the server's core, not the client's, is full: `server core` "
            "is the system's CPU seconds per second of load. req/s, p99 and CPU per answer are then the server's "
            "own. p50/p99 within 1/32 of the value.\n"
        )
        def capacity_cells(r, m, nr):
            c = cpu_per_answer(r)
            busy = r["server_cpu"] / m["seconds"] if r.get("server_cpu") is not None and m.get("seconds") else None
            return [f_us(c), f_ratio(c, cpu_per_answer(nr)), f_pct(busy), m["errors"]]

        rows = hit_rows("capacity", cap, 12, capacity_cells)
        L.append(table(["body", "system", "run", "req/s", "req/s ×nginx", "p50", "p99", "p99 ×nginx",
                        "CPU µs/answer", "CPU ×nginx", "server core", "failed"], rows))

    # (b)
    st = pick("stampede")
    if st:
        L.append("\n## (b) Stampede: 1000 concurrent requests (`-n 1000 -c 1000`) for a cold key, origin delay 200 ms\n")
        rows = []
        for r in st:
            m, n = r["m"], nginx_of("stampede", r)
            if m.get("missing"):
                rows.append([r["system"], r["run"], r["origin_hits"], "no data", "", "", "", "", ""])
                continue
            rows.append([
                r["system"], r["run"], r["origin_hits"], f"{m['ok']}/1000", f_ms(m["p50"]), f_ms(m["p99"]),
                f_ratio(m["p99"], n.get("p99")), f_ms(m["max"]), non200(m),
            ])
        L.append(table(["system", "run", "origin hits", "200s", "p50", "p99", "p99 ×nginx", "max", "non-200"], rows))

    # (b2)
    tt = pick("ttfb")
    if tt:
        L.append(
            "\n## (b2) Time to first byte: 1000 callers at once on a cold key, a 5 MB answer the origin trickles out over 2 s\n\n"
            "`ttfb-load`: 1000 connections, one GET each at the same instant; times from that instant to each "
            "caller's first body byte and to its last, over the answers that arrived whole (200, exactly their "
            "Content-Length). The origin sends its first chunk at once, so a cache that streams gives every caller "
            "bytes within milliseconds; one that waits for the whole answer gives them ~2 s.\n"
        )
        rows = []
        for r in tt:
            try:
                with open(os.path.join(a.raw, r["ttfb"])) as f:
                    m = json.loads(f.read().strip() or "{}")
            except (OSError, ValueError):
                m = {}
            t, w = m.get("ttfb_ms") or {}, m.get("total_ms") or {}
            rows.append([
                r["system"], r["run"], r["origin_hits"], f"{m.get('whole', 0)}/{m.get('n', 1000)}",
                f_ms(t.get("p50")), f_ms(t.get("p99")), f_ms(t.get("max")), f_ms(w.get("p50")), f_ms(w.get("p99")),
            ])
        L.append(table(["system", "run", "origin hits", "whole 200s", "first byte p50", "first byte p99",
                        "first byte max", "last byte p50", "last byte p99"], rows))

    # (c)
    fl = pick("fleet")
    if fl:
        L.append(
            "\n## (c) Five instances, 200 concurrent requests on each at once (1000 in all), cold key, origin delay 300 ms\n\n"
            "corral: five instances sharing one Redis. nginx: five instances, each with its own cache. "
            "p50 is the median of the five instances' p50, p99 and max the worst instance's.\n"
        )
        rows = []
        for r in fl:
            m, n = r["m"], nginx_of("fleet", r)
            leases = "–" if r.get("leases_left") is None else r["leases_left"]
            if m.get("missing"):
                rows.append([r["system"], r["run"], r["origin_hits"], "no data", "", "", "", "", "", leases])
                continue
            rows.append([
                r["system"], r["run"], r["origin_hits"], f"{m['ok']}/1000", f_ms(m["p50"]), f_ms(m["p99"]),
                f_ratio(m["p99"], n.get("p99")), f_ms(m["max"]), non200(m), leases,
            ])
        L.append(table(["system", "run", "origin hits", "200s", "p50", "p99", "p99 ×nginx", "max", "non-200", "Redis leases left"], rows))

    # (d)
    hs = pick("hotset")
    if hs:
        L.append(
            f"\n## (d) Hot set: 10,000 keys, Zipf (s = 1) mix, 1 KiB bodies, 50 connections, {a.duration}\n\n"
            "Every run starts cold (its own key space): the first request for each key is a miss. "
            "`keys fetched` is how many distinct keys reached the origin, `origin hits` how many requests did; "
            "a cache that fetches each key once has the two equal.\n"
        )
        rows = []
        for r in hs:
            m, n = r["m"], nginx_of("hotset", r)
            if m.get("missing"):
                rows.append([r["system"], r["run"], "no data", "", "", "", "", "", "", "", "", "", ""])
                continue
            nr = nginx_rec("hotset", r)
            rows.append([
                r["system"], r["run"], f_num(m["rps"]), f_ratio(m["rps"], n.get("rps")), f_ms(m["p50"]),
                f_ms(m["p99"]), f_ratio(m["p99"], n.get("p99")), *cpu_cells(r, nr),
                r.get("origin_hits"), r.get("keys_fetched"), non200(m),
            ])
        L.append(table(["system", "run", "req/s", "req/s ×nginx", "p50", "p99", "p99 ×nginx", "CPU µs/answer",
                        "CPU ×nginx", "oha core", "origin hits", "keys fetched", "non-200"], rows))

    # (e)
    fa = pick("failing")
    if fa:
        L.append(
            f"\n## (e) Failing origin: a stale key (`max-age=1, stale-if-error=60`), origin answering 503, 50 connections, {a.duration}\n\n"
            "Every 200 in the window is a stale copy (the origin answers nothing but 503). "
            "`origin hits` counts requests that reached the failing origin during the window.\n"
        )
        rows = []
        for r in fa:
            m = r["m"]
            if m.get("missing"):
                rows.append([r["system"], r["run"], "no data", "", "", "", "", "", ""])
                continue
            per = f"{r['origin_hits'] / m['ok']:.3f}" if m["ok"] else "–"
            rows.append([
                r["system"], r["run"], f_num(m["answers"]), f_num(m["ok"]), non200(m), r["origin_hits"], per,
                f_ms(m["p99"]), f"`{r.get('sample', '')}`",
            ])
        L.append(table(["system", "run", "answers", "stale 200s", "errors", "origin hits", "origin hits per stale answer", "p99", "one answer mid-window"], rows))

    # (f)
    sw = pick("swr")
    if sw:
        L.append(
            f"\n## (f) stale-while-revalidate: origin takes 2 s (`max-age=1, stale-while-revalidate=30`), load starts after expiry, 50 connections, {a.duration}\n\n"
            "p99 should stay at hit speed (compare with (a) 1 KiB); each refresh takes 2 s at the origin.\n"
        )
        rows = []
        for r in sw:
            m, n = r["m"], nginx_of("swr", r)
            if m.get("missing"):
                rows.append([r["system"], r["run"], "no data", "", "", "", "", "", "", ""])
                continue
            rows.append([
                r["system"], r["run"], f_num(m["rps"]), f_ms(m["p50"]), f_ms(m["p99"]), f_ratio(m["p99"], n.get("p99")),
                f_ms(m["max"]), r["origin_hits"], non200(m), f"`{r.get('sample', '')}`",
            ])
        L.append(table(["system", "run", "req/s", "p50", "p99", "p99 ×nginx", "max", "origin hits", "non-200", "one answer mid-window"], rows))

    # Targets of issue 4, corral against nginx, judged on every run.
    def ratios(scenario, key, **kw):
        out = []
        for r in pick(scenario, system="corral", **kw):
            n = nginx_of(scenario, r, **kw)
            if not r["m"].get("missing") and n.get(key) and r["m"].get(key) is not None:
                out.append(r["m"][key] / n[key])
        return out

    def verdict(ok, have) -> str:
        return "n/a" if not have else ("met" if ok else "**not met**")

    rows = []
    if hit:
        for size in sorted({r["size"] for r in hit}):
            rr, pr = ratios("hit", "rps", size=size), ratios("hit", "p99", size=size)
            rows.append([
                f"hit {size // 1024} KiB: req/s ≥ 1.2× nginx, p99 ≤ nginx",
                ", ".join(f"{x:.2f}×" for x in rr) + " / p99 " + ", ".join(f"{x:.2f}×" for x in pr),
                verdict(rr and pr and min(rr) >= 1.2 and max(pr) <= 1.0, bool(rr)),
            ])
            cr, busy = [], []
            for r in pick("hit", system="corral", size=size):
                c, nc = cpu_per_answer(r), cpu_per_answer(nginx_rec("hit", r, size=size))
                if c and nc:
                    cr.append(c / nc)
                b = client_busy(nginx_rec("hit", r, size=size), secs)
                if b is not None:
                    busy.append(b)
            if cr:
                rows.append([
                    f"hit {size // 1024} KiB, client-independent: server CPU per answer ≤ nginx's / 1.2 (≤ 0.83×)",
                    ", ".join(f"{x:.2f}×" for x in cr)
                    + (f" (oha's core {', '.join(f_pct(b) for b in busy)} busy under nginx)" if busy else ""),
                    verdict(max(cr) <= 1 / 1.2, True),
                ])
    if cap:
        for size in sorted({r["size"] for r in cap}):
            rr, pr = ratios("capacity", "rps", size=size), ratios("capacity", "p99", size=size)
            cr = []
            for r in pick("capacity", system="corral", size=size):
                c, nc = cpu_per_answer(r), cpu_per_answer(nginx_rec("capacity", r, size=size))
                if c and nc:
                    cr.append(c / nc)
            rows.append([
                f"hit {size // 1024} KiB at capacity: req/s ≥ 1.2× nginx, p99 ≤ nginx, CPU per answer ≤ 0.83×",
                ", ".join(f"{x:.2f}×" for x in rr) + " / p99 " + ", ".join(f"{x:.2f}×" for x in pr)
                + " / CPU " + ", ".join(f"{x:.2f}×" for x in cr),
                verdict(rr and pr and cr and min(rr) >= 1.2 and max(pr) <= 1.0 and max(cr) <= 1 / 1.2, bool(rr)),
            ])
    if st:
        pr = ratios("stampede", "p99")
        rows.append(["stampede: p99 ≤ 0.6× nginx", ", ".join(f"{x:.2f}×" for x in pr), verdict(pr and max(pr) <= 0.6, bool(pr))])
    if fl:
        ch = [r["origin_hits"] for r in pick("fleet", system="corral")]
        nh = [r["origin_hits"] for r in pick("fleet", system="nginx")]
        rows.append(["five instances: 1 origin hit (nginx 5)", f"corral {ch}, nginx {nh}", verdict(ch and all(h == 1 for h in ch), bool(ch))])
    if hs:
        rr = ratios("hotset", "rps")
        rows.append(["hot set: req/s ≥ 1.2× nginx", ", ".join(f"{x:.2f}×" for x in rr), verdict(rr and min(rr) >= 1.2, bool(rr))])
    if fa:
        c = pick("failing", system="corral")
        errs = [r["m"]["answers"] - r["m"]["ok"] + r["m"]["errors"] for r in c if not r["m"].get("missing")]
        oh = [r["origin_hits"] for r in c]
        nh = [r["origin_hits"] for r in pick("failing", system="nginx")]
        window = secs
        rows.append([
            f"failing origin: stale for the whole window (0 errors), at most one origin request per second "
            f"(a 1 s back-off) = {window:.0f} in {a.duration}",
            f"errors {errs}, origin hits {oh} (nginx {nh})",
            verdict(errs and all(e == 0 for e in errs) and all(h <= window for h in oh), bool(errs)),
        ])
    if rows:
        L.append("\n## Targets of issue 4 (corral against nginx, every run)\n")
        L.append(table(["target", "measured", "verdict"], rows))
    L.append("")
    with open(a.out, "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
