//! `corral top`: the live view in a terminal, in the spirit of varnishstat
//! and top. It reads `/stats` of one or more admin listeners (with
//! `--fleet`, the first one's `/stats?fleet=1`: every instance sharing its
//! Redis), redraws in place every interval, and exits on `q` or Ctrl-C,
//! leaving the terminal as it found it. `--once --json` prints one reading
//! as JSON (the `/stats?fleet=1` form) for scripts; `--once` alone prints
//! the view once, with rates made of two readings `--interval` apart. What
//! an operator must see first (an open Redis breaker, an open circuit,
//! keys in back-off) heads the view, in reverse red on a terminal.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use crate::ops::stats::{Fleet, OUTCOMES, Summary, Traffic};

/// What `corral top` was asked.
pub struct Args {
    /// Admin listeners, e.g. `http://127.0.0.1:9080` (a bare
    /// `host:port` is taken as http).
    pub admins: Vec<String>,
    /// The admin token, when the view is guarded.
    pub token: Option<String>,
    pub fleet: bool,
    pub once: bool,
    pub json: bool,
    pub interval: Duration,
}

pub fn run(args: Args) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("corral top: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let client = match reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy()
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("corral top: {e}");
                return ExitCode::FAILURE;
            }
        };
        if args.once {
            return once(&client, &args).await;
        }
        interactive(&client, &args).await
    })
}

async fn once(client: &reqwest::Client, args: &Args) -> ExitCode {
    let first = match read(client, args).await {
        Ok(fleet) if args.json => {
            print!("{}", crate::ops::json_line(&fleet));
            return ExitCode::SUCCESS;
        }
        Ok(fleet) => fleet,
        Err(e) => {
            eprintln!("corral top: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Rates need two readings: the second, an interval later.
    tokio::time::sleep(args.interval).await;
    match read(client, args).await {
        Err(e) => {
            eprintln!("corral top: {e}");
            ExitCode::FAILURE
        }
        Ok(fleet) => {
            use std::io::IsTerminal;
            let dt = seconds_between(&first, &fleet);
            let emphasis = std::io::stdout().is_terminal();
            print!("{}", view(&fleet, Some(&first), dt, emphasis));
            ExitCode::SUCCESS
        }
    }
}

/// One reading of every admin listener asked, as one fleet.
async fn read(client: &reqwest::Client, args: &Args) -> Result<Fleet, String> {
    let mut instances: Vec<Summary> = Vec::new();
    let mut source = "top";
    let mut withheld = 0;
    for (i, admin) in args.admins.iter().enumerate() {
        let base = if admin.contains("://") {
            admin.trim_end_matches('/').to_owned()
        } else {
            format!("http://{}", admin.trim_end_matches('/'))
        };
        let fleet = args.fleet && i == 0;
        let url = format!("{base}/stats{}", if fleet { "?fleet=1" } else { "" });
        let mut req = client.get(&url);
        if let Some(t) = &args.token {
            req = req.bearer_auth(t);
        }
        let res = req.send().await.map_err(|e| format!("{url}: {e}"))?;
        let status = res.status();
        let body = res.text().await.map_err(|e| format!("{url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{url} answered {status}: {}", body.trim()));
        }
        let got: Vec<Summary> = if fleet {
            let f: Fleet = serde_json::from_str(&body).map_err(|e| format!("{url}: {e}"))?;
            if f.source == "redis" {
                source = "redis";
            }
            withheld = f.withheld;
            f.instances
        } else {
            vec![serde_json::from_str(&body).map_err(|e| format!("{url}: {e}"))?]
        };
        for s in got {
            if !instances.iter().any(|o| o.instance == s.instance) {
                instances.push(s);
            }
        }
    }
    let mut fleet = Fleet::of(source, instances);
    fleet.withheld = withheld;
    Ok(fleet)
}

async fn interactive(client: &reqwest::Client, args: &Args) -> ExitCode {
    use crossterm::event::{Event, EventStream, KeyCode, KeyEventKind, KeyModifiers};
    use futures_util::StreamExt;
    if let Err(e) = crossterm::terminal::enable_raw_mode() {
        eprintln!("corral top: not a terminal ({e}); use --once");
        return ExitCode::FAILURE;
    }
    let mut out = std::io::stdout();
    // The alternate screen: the shell's own screen comes back on exit.
    let _ = write!(out, "\x1b[?1049h\x1b[?25l");
    let mut keys = EventStream::new();
    let mut tick = tokio::time::interval(args.interval);
    let mut before: Option<Fleet> = None;
    let code = loop {
        tokio::select! {
            _ = tick.tick() => {
                let screen = match read(client, args).await {
                    Ok(fleet) => {
                        let dt = before.as_ref().map_or(0.0, |b| seconds_between(b, &fleet));
                        let s = view(&fleet, before.as_ref(), dt, true);
                        before = Some(fleet);
                        s
                    }
                    Err(e) => format!("corral top: {e}\n(retrying; q quits)\n"),
                };
                // Raw mode: each line must return the carriage itself.
                let _ = write!(out, "\x1b[H\x1b[2J{}", screen.replace('\n', "\r\n"));
                let _ = out.flush();
            }
            key = keys.next() => match key {
                Some(Ok(Event::Key(k))) if k.kind != KeyEventKind::Release => {
                    let ctrl_c = k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Char('Q') | KeyCode::Esc) {
                        break ExitCode::SUCCESS;
                    }
                }
                Some(Ok(_)) => {}
                None | Some(Err(_)) => break ExitCode::SUCCESS,
            },
            _ = tokio::signal::ctrl_c() => break ExitCode::SUCCESS,
        }
    };
    let _ = write!(out, "\x1b[?25h\x1b[?1049l");
    let _ = out.flush();
    let _ = crossterm::terminal::disable_raw_mode();
    code
}

fn seconds_between(before: &Fleet, now: &Fleet) -> f64 {
    let at = |f: &Fleet| f.instances.iter().map(|i| i.at_ms).max().unwrap_or(0);
    (at(now).saturating_sub(at(before))) as f64 / 1000.0
}

/// Per second between two readings of a counter (0 when it went back).
fn per_second(now: u64, before: Option<u64>, dt: f64) -> Option<f64> {
    let before = before?;
    (dt > 0.0).then(|| now.saturating_sub(before) as f64 / dt)
}

fn rate_text(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |r| format!("{r:.1}"))
}

/// What must be seen first, one line (empty when all is well): instances
/// whose Redis breaker is open, routes whose circuit is open, keys in
/// back-off. `emphasis`: in reverse red, for a terminal.
fn alarms(fleet: &Fleet, emphasis: bool) -> String {
    let mut parts = Vec::new();
    let breakers: Vec<String> = fleet
        .instances
        .iter()
        .filter(|i| i.redis.breaker_open || i.redis.primaries.iter().any(|p| p.breaker_open))
        .map(|i| printable(&i.instance, 28))
        .collect();
    if !breakers.is_empty() {
        parts.push(format!("REDIS BREAKER OPEN: {}", breakers.join(", ")));
    }
    let mut circuits: Vec<String> = fleet
        .instances
        .iter()
        .flat_map(|i| i.routes.iter())
        .filter(|r| r.circuit == "open")
        .map(|r| printable(&r.name, 24))
        .collect();
    circuits.sort();
    circuits.dedup();
    if !circuits.is_empty() {
        parts.push(format!("CIRCUIT OPEN: {}", circuits.join(", ")));
    }
    let backoff: usize = fleet.instances.iter().map(|i| i.flights.backoff_keys).sum();
    if backoff > 0 {
        parts.push(format!("BACK-OFF: {backoff} keys"));
    }
    if parts.is_empty() {
        return String::new();
    }
    let text = format!("!! {} !!", parts.join("  "));
    if emphasis {
        format!("\x1b[1;37;41m{text}\x1b[0m\n\n")
    } else {
        format!("{text}\n\n")
    }
}

/// The text view of one reading (`before`, `dt` seconds earlier, makes
/// the rates); `emphasis`: the alarms in colour, for a terminal.
pub fn view(fleet: &Fleet, before: Option<&Fleet>, dt: f64, emphasis: bool) -> String {
    let mut s = title(fleet);
    s += &alarms(fleet, emphasis);
    totals(&mut s, &fleet.totals, before.map(|b| &b.totals), dt);
    routes(&mut s, fleet);
    flights(&mut s, fleet);
    instances(&mut s, fleet);
    bounds(&mut s, fleet);
    s
}

/// The first line: how many instances, and where the list came from.
fn title(fleet: &Fleet) -> String {
    format!(
        "corral top - {} instance(s) ({}){}   q quits\n\n",
        fleet.instances.len(),
        if fleet.source == "redis" {
            "fleet"
        } else {
            "as listed"
        },
        if fleet.withheld > 0 {
            format!(
                ", {} more withheld: their view needs a token",
                fleet.withheld
            )
        } else {
            String::new()
        }
    )
}

/// The fleet's totals and outcomes, with their rates since `b`.
fn totals(s: &mut String, t: &Traffic, b: Option<&Traffic>, dt: f64) {
    let total = t.clients();
    let saved = total.saturating_sub(t.origin_requests);
    *s += &format!(
        "client requests {total:>12}  {:>10}/s\norigin requests {:>12}  {:>10}/s\norigin errors   {:>12}  {:>10}/s\nsaved           {saved:>12}  (hit {}, collapsed {}, stale {})\n\n",
        rate_text(per_second(total, b.map(Traffic::clients), dt)),
        t.origin_requests,
        rate_text(per_second(
            t.origin_requests,
            b.map(|b| b.origin_requests),
            dt
        )),
        t.origin_errors,
        rate_text(per_second(t.origin_errors, b.map(|b| b.origin_errors), dt)),
        t.saved.get("hit").copied().unwrap_or(0),
        t.saved.get("collapsed").copied().unwrap_or(0),
        t.saved.get("stale").copied().unwrap_or(0),
    );
    *s += &format!("{:<10} {:>12} {:>10}\n", "outcome", "total", "per s");
    for o in OUTCOMES {
        let n = t.requests.get(o).copied().unwrap_or(0);
        let r = per_second(n, b.map(|b| b.requests.get(o).copied().unwrap_or(0)), dt);
        *s += &format!("{o:<10} {n:>12} {:>10}\n", rate_text(r));
    }
}

/// Each route's requests, origin requests, saved and circuit, summed over
/// the instances.
fn routes(s: &mut String, fleet: &Fleet) {
    *s += &format!(
        "\n{:<24} {:>10} {:>10} {:>10} {:>8}\n",
        "route", "requests", "origin", "saved", "circuit"
    );
    let mut routes: Vec<(String, u64, u64, bool)> = Vec::new();
    for i in &fleet.instances {
        for r in &i.routes {
            let c = r.traffic.clients();
            match routes.iter_mut().find(|x| x.0 == r.name) {
                Some(x) => {
                    x.1 += c;
                    x.2 += r.traffic.origin_requests;
                    x.3 |= r.circuit == "open";
                }
                None => routes.push((
                    r.name.clone(),
                    c,
                    r.traffic.origin_requests,
                    r.circuit == "open",
                )),
            }
        }
    }
    for (name, c, o, open) in &routes {
        *s += &format!(
            "{:<24} {c:>10} {o:>10} {:>10} {:>8}\n",
            printable(name, 24),
            c.saturating_sub(*o),
            if *open { "OPEN" } else { "closed" }
        );
    }
}

/// The busiest flights and the keys in back-off.
fn flights(s: &mut String, fleet: &Fleet) {
    let mut flights: Vec<(&str, usize, u64)> = fleet
        .instances
        .iter()
        .flat_map(|i| {
            i.flights
                .busiest
                .iter()
                .map(|f| (f.key.as_str(), f.waiting, f.age_ms))
        })
        .collect();
    flights.sort_by_key(|f| std::cmp::Reverse(f.1));
    let in_progress: usize = fleet.instances.iter().map(|i| i.flights.in_progress).sum();
    let backoff: usize = fleet.instances.iter().map(|i| i.flights.backoff_keys).sum();
    *s += &format!("\nflights in progress {in_progress}, keys in back-off {backoff}\n");
    for (key, waiting, age) in flights.iter().take(5) {
        *s += &format!(
            "  {waiting:>6} waiting {age:>7} ms  {}\n",
            printable(key, 60)
        );
    }
    for i in &fleet.instances {
        for b in i.flights.backoff.iter().take(5) {
            *s += &format!(
                "  back-off {:>7} ms left  {}\n",
                b.remaining_ms,
                printable(&b.key, 60)
            );
        }
    }
}

/// A line per instance: its traffic and its Redis link.
fn instances(s: &mut String, fleet: &Fleet) {
    *s += &format!(
        "\n{:<28} {:<22} {:>10} {:>10}  redis\n",
        "instance", "listen", "requests", "origin"
    );
    for i in &fleet.instances {
        *s += &format!(
            "{:<28} {:<22} {:>10} {:>10}  {} {}{}{}\n",
            printable(&i.instance, 28),
            printable(&i.listen, 22),
            i.totals.clients(),
            i.totals.origin_requests,
            printable(&i.redis.mode, 10),
            printable(&i.redis.link, 14),
            if i.redis.breaker_open {
                " breaker open"
            } else {
                ""
            },
            open_primaries(i)
        );
    }
}

/// Each instance's bounds: used, limit, share.
fn bounds(s: &mut String, fleet: &Fleet) {
    *s += "\nbounds\n";
    for i in &fleet.instances {
        for b in &i.bounds {
            let share = if b.limit > 0 {
                b.used as f64 * 100.0 / b.limit as f64
            } else {
                0.0
            };
            *s += &format!(
                "  {:<28} {:<24} {:>14} of {:>14} {share:>5.1}%\n",
                printable(&i.instance, 28),
                printable(&b.name, 24),
                b.used,
                b.limit
            );
        }
    }
}

/// `(breaker open: a, b)` for a Cluster's primaries whose breaker is open.
fn open_primaries(i: &Summary) -> String {
    let open: Vec<String> = i
        .redis
        .primaries
        .iter()
        .filter(|p| p.breaker_open)
        .map(|p| printable(&p.node, 40))
        .collect();
    if open.is_empty() {
        String::new()
    } else {
        format!(" (breaker open: {})", open.join(", "))
    }
}

/// `text` cut to `width` characters with every control character (a
/// terminal escape from a forged heartbeat, say) replaced.
fn printable(text: &str, width: usize) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(width)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(breaker: bool, circuit: &str, backoff: usize) -> Fleet {
        let summary = Summary {
            instance: "a\x1b[2J".to_owned(),
            listen: "127.0.0.1:8080".to_owned(),
            version: "0".to_owned(),
            uptime_s: 1,
            guarded: false,
            at_ms: 1000,
            totals: Traffic::default(),
            routes: vec![crate::ops::stats::RouteTraffic {
                name: "api".to_owned(),
                traffic: Traffic::default(),
                circuit: circuit.to_owned(),
            }],
            flights: crate::ops::stats::FlightsView {
                backoff_keys: backoff,
                ..Default::default()
            },
            redis: crate::ops::stats::RedisView {
                breaker_open: breaker,
                ..Default::default()
            },
            bounds: Vec::new(),
        };
        Fleet::of("local", vec![summary])
    }

    #[test]
    fn an_open_breaker_circuit_and_back_off_head_the_view() {
        assert_eq!(alarms(&fleet(false, "closed", 0), true), "");
        let calm = view(&fleet(false, "closed", 0), None, 0.0, true);
        assert!(!calm.contains("!!"), "{calm}");
        let plain = alarms(&fleet(true, "open", 3), false);
        assert_eq!(
            plain,
            "!! REDIS BREAKER OPEN: a?[2J  CIRCUIT OPEN: api  BACK-OFF: 3 keys !!\n\n"
        );
        let loud = alarms(&fleet(true, "closed", 0), true);
        assert!(
            loud.starts_with("\x1b[1;37;41m!! REDIS BREAKER OPEN"),
            "{loud:?}"
        );
        let v = view(&fleet(false, "open", 0), None, 0.0, false);
        assert!(v.starts_with("corral top"), "{v}");
        assert!(v.contains("\n!! CIRCUIT OPEN: api !!\n"), "{v}");
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(printable("a\x1b[2Jb\nc", 80), "a?[2Jb?c");
        assert_eq!(printable("abcdef", 3), "abc");
    }
}
