//! deploy/grafana/ and deploy/prometheus/: the dashboard and the alert rules read only metrics a real corral exports, and pass promtool.

use super::*;

fn dashboard_path() -> PathBuf {
    deploy_dir().join("grafana").join("corral.json")
}

fn rules_path() -> PathBuf {
    deploy_dir().join("prometheus").join("corral-alerts.yml")
}

fn rules_test_path() -> PathBuf {
    deploy_dir()
        .join("prometheus")
        .join("corral-alerts.test.yml")
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read(&dashboard_path()))
        .unwrap_or_else(|e| panic!("deploy/grafana/corral.json does not parse: {e}"))
}

/// Every `expr` of the dashboard (the panels' queries), in order.
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<String> {
    fn walk(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    match v {
                        serde_json::Value::String(s) if key == "expr" => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// The template variables' queries (`label_values(...)`: not PromQL).
fn dashboard_variable_queries(dashboard: &serde_json::Value) -> Vec<String> {
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("the dashboard has templating.list");
    variables
        .iter()
        .filter(|v| v["type"] == "query")
        .flat_map(|v| [&v["query"]["query"], &v["query"], &v["definition"]])
        .filter_map(|q| q.as_str().map(str::to_owned))
        .collect()
}

#[derive(Debug, Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
struct Rule {
    alert: Option<String>,
    expr: String,
    #[serde(rename = "for")]
    hold: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

fn rules() -> Vec<Rule> {
    let file: RuleFile = parse("deploy/prometheus/corral-alerts.yml", &read(&rules_path()));
    file.groups.into_iter().flat_map(|g| g.rules).collect()
}

/// The metric names a PromQL expression reads, crudely: every identifier
/// (`[A-Za-z0-9_:]+`) that starts with `prefix` (`corral_` for corral's
/// metrics, `corral:` for recorded series). Label values in quotes never
/// start with either here.
fn metric_names(expr: &str, prefix: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|token| token.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// A histogram's family name: `_bucket`, `_sum` and `_count` stripped.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// Where each `corral_` metric is used: the name, then the files naming it.
fn used_metrics() -> BTreeMap<String, Vec<&'static str>> {
    let dashboard = dashboard();
    let mut used: BTreeMap<String, Vec<&'static str>> = BTreeMap::new();
    let dashboard_exprs = dashboard_exprs(&dashboard)
        .into_iter()
        .chain(dashboard_variable_queries(&dashboard));
    let rule_exprs = rules().into_iter().map(|r| r.expr);
    for (file, exprs) in [
        (
            "deploy/grafana/corral.json",
            dashboard_exprs.collect::<Vec<_>>(),
        ),
        (
            "deploy/prometheus/corral-alerts.yml",
            rule_exprs.collect::<Vec<_>>(),
        ),
    ] {
        for expr in &exprs {
            for name in metric_names(expr, "corral_") {
                let files = used.entry(name).or_default();
                if !files.contains(&file) {
                    files.push(file);
                }
            }
        }
    }
    used
}

/// `promtool`, or `None` when CORRAL_SKIP_PROMTOOL=1 and it is missing.
pub(super) fn promtool() -> Option<PathBuf> {
    if let Some(path) = which("promtool") {
        return Some(path);
    }
    if std::env::var("CORRAL_SKIP_PROMTOOL").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED: promtool is not on PATH and CORRAL_SKIP_PROMTOOL=1");
        return None;
    }
    panic!(
        "promtool is not on PATH: install Debian's `prometheus` package \
         (apt-get install prometheus; scripts/test does so as root), \
         or set CORRAL_SKIP_PROMTOOL=1 to skip this test"
    );
}

pub(super) async fn run_promtool(promtool: &Path, args: &[&str]) -> String {
    let output = output_within(
        tokio::process::Command::new(promtool)
            .args(args)
            .current_dir(workspace_root()),
        DEADLINE,
        &format!("promtool {}", args.join(" ")),
    )
    .await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool {} ({}):\n{text}",
        args.join(" "),
        output.status
    );
    text
}

#[tokio::test]
async fn promtool_checks_the_alert_rules_and_their_unit_tests_pass() {
    let Some(promtool) = promtool() else { return };
    let rules = rules_path().display().to_string();
    let checked = run_promtool(&promtool, &["check", "rules", &rules]).await;
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tests = rules_test_path().display().to_string();
    let tested = run_promtool(&promtool, &["test", "rules", &tests]).await;
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every panel query is PromQL Prometheus accepts: promtool checks them as
/// recording rules, with Grafana's variables given values.
#[tokio::test]
async fn every_dashboard_query_is_valid_promql() {
    let Some(promtool) = promtool() else { return };
    let exprs = dashboard_exprs(&dashboard());
    let mut yaml = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__range", "1h")
            .replace("$instance", ".*")
            .replace("$route", ".*");
        assert!(!expr.contains('$'), "a Grafana variable left in {expr}");
        let quoted = serde_json::to_string(&expr).expect("quote the expression");
        yaml.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {quoted}\n"
        ));
    }
    let scratch = TempDir::new("deploy-dashboard").expect("create a scratch dir");
    let path = scratch.path().join("dashboard-queries.yml");
    std::fs::write(&path, &yaml).expect("write the queries");
    let path = path.display().to_string();
    let checked = run_promtool(&promtool, &["check", "rules", &path]).await;
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{checked}\n{yaml}"
    );
}

#[test]
fn the_dashboard_has_its_variables_and_covers_what_operators_watch() {
    let dashboard = dashboard();
    let schema = dashboard["schemaVersion"].as_u64().unwrap_or(0);
    assert!(schema >= 36, "schemaVersion {schema}: Grafana 9 or later");
    let variables: BTreeMap<&str, &serde_json::Value> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .map(|v| (v["name"].as_str().expect("a variable name"), v))
        .collect();
    assert_eq!(variables["datasource"]["type"], "datasource");
    assert_eq!(variables["datasource"]["query"], "prometheus");
    for name in ["instance", "route"] {
        let variable = variables
            .get(name)
            .unwrap_or_else(|| panic!("no `{name}` variable: {variables:?}"));
        assert_eq!(variable["type"], "query", "{name}");
        assert_eq!(variable["datasource"]["uid"], "${datasource}", "{name}");
    }

    // Every query goes to the chosen data source and honours `instance`.
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = Vec::new();
    for panel in panels {
        ids.push(panel["id"].as_u64().expect("a panel id"));
        for target in panel["targets"].as_array().into_iter().flatten() {
            assert_eq!(
                target["datasource"]["uid"], "${datasource}",
                "{}",
                panel["title"]
            );
            let expr = target["expr"].as_str().expect("a query");
            assert!(
                !expr.contains("corral_") || expr.contains("instance=~\"$instance\""),
                "panel {}: {expr} ignores $instance",
                panel["title"]
            );
        }
    }
    let count = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), count, "panel ids are unique");

    let used = used_metrics();
    for name in [
        "corral_requests_total",
        "corral_origin_fetches_total",
        "corral_origin_fetch_duration_seconds_bucket",
        "corral_flights_in_progress",
        "corral_flight_waiters_bucket",
        "corral_origin_backoff_keys",
        "corral_origin_circuit_open",
        "corral_redis_connected",
        "corral_redis_breaker_open",
        "corral_redis_errors_total",
        "corral_l2_reads_total",
        "corral_l1_bytes",
        "corral_l1_limit_bytes",
        "corral_fill_buffer_bytes",
        "corral_fill_memory_limit_bytes",
        "corral_ahead_buffer_bytes",
        "corral_sealed_bytes",
    ] {
        assert!(
            used.get(name)
                .is_some_and(|f| f.contains(&"deploy/grafana/corral.json")),
            "the dashboard does not show {name}"
        );
    }
    let exprs = dashboard_exprs(&dashboard);
    assert!(
        exprs
            .iter()
            .any(|e| e.starts_with("sum by (cache) (rate(corral_requests_total")),
        "no panel splits client requests by outcome"
    );

    // The memory panels draw the limits corral exports: nothing records
    // `corral:` series any more, so one would draw nothing.
    let rule_exprs = rules().into_iter().map(|r| r.expr);
    for expr in exprs.iter().cloned().chain(rule_exprs) {
        let recorded = metric_names(&expr, "corral:");
        assert!(
            recorded.is_empty(),
            "{expr} reads {recorded:?}, which nothing records: use the limits \
             corral exports (corral_l1_limit_bytes, corral_fill_memory_limit_bytes)"
        );
    }
}

#[test]
fn the_alerts_cover_corrals_failures_and_name_their_severity() {
    let rules = rules();
    let alerts: BTreeMap<&str, &Rule> = rules
        .iter()
        .filter_map(|r| r.alert.as_deref().map(|a| (a, r)))
        .collect();
    for (alert, reads) in [
        ("CorralScrapeDown", "up{job=\"corral\"}"),
        ("CorralOriginCircuitOpen", "corral_origin_circuit_open"),
        ("CorralRedisBreakerOpen", "corral_redis_breaker_open"),
        ("CorralRedisDisconnected", "corral_redis_connected"),
        ("CorralWaitListFull", "corral_wait_list_full_total"),
        ("CorralOriginBackoff", "corral_origin_backoff_keys"),
        ("CorralL1MemoryNearBound", "corral_l1_limit_bytes"),
        (
            "CorralFillMemoryNearBound",
            "corral_fill_memory_limit_bytes",
        ),
        ("CorralHigh5xxRate", "cache=\"error\""),
        ("CorralOverloaded", "corral_overloaded"),
        ("CorralLeaseTimeouts", "corral_lease_total"),
        ("CorralUpstreamServerDown", "corral_upstream_server_up"),
        ("CorralDescriptorsNearLimit", "process_max_fds"),
    ] {
        let rule = alerts
            .get(alert)
            .unwrap_or_else(|| panic!("no alert {alert}; have {:?}", alerts.keys()));
        assert!(rule.expr.contains(reads), "{alert}: {}", rule.expr);
    }
    assert_eq!(
        alerts["CorralOriginCircuitOpen"].hold.as_deref(),
        Some("1m")
    );
    for (name, rule) in &alerts {
        let severity = rule.labels.get("severity").map(String::as_str);
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{name}: severity {severity:?}"
        );
        assert!(
            rule.annotations.contains_key("summary"),
            "{name} has no summary"
        );
        assert!(rule.hold.is_some(), "{name} fires on one evaluation");
    }
    let groups: RuleFile = parse("corral-alerts.yml", &read(&rules_path()));
    assert!(
        groups.groups.iter().all(|g| !g.name.is_empty()),
        "every group is named"
    );
}

/// The memory alerts and panels compare what corral holds with the limits
/// it exports: `corral_fill_memory_limit_bytes` is `cache.fill_memory`, and
/// `corral_l1_limit_bytes` is what L1's entries may weigh, `cache.memory`
/// less the side tables' share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_exports_the_memory_limits_the_alerts_compare_with() {
    let origin = Origin::new().route("/", Reply::ok("hello")).start().await;
    let config = Config::single(origin.url())
        .cache("memory", "64MiB")
        .cache("fill_memory", "24MiB");
    let proxy = Proxy::new(config).start().await;
    let scrape = corral_tests::lifecycle::scrape(&proxy).await;
    let gauge = |name: &str| {
        scrape
            .value(name, &[])
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{}", scrape.text()))
    };
    let fill = gauge("corral_fill_memory_limit_bytes");
    assert_eq!(fill, (24u64 << 20) as f64, "cache.fill_memory is 24MiB");
    let l1 = gauge("corral_l1_limit_bytes");
    assert!(
        l1 > 0.0 && l1 <= (64u64 << 20) as f64,
        "corral_l1_limit_bytes {l1}: L1's entries get part of cache.memory (64MiB)"
    );
}

/// Names the dashboard or the alerts may use that a short run does not
/// show: each appears only after its event (a full wait list, a failed
/// Redis call, a skipped origin request). Each must still be a name
/// crates/corral/src/telemetry/metrics.rs writes.
const EXPORTED_ON_EVENT: [&str; 3] = [
    "corral_wait_list_full_total",
    "corral_redis_errors_total",
    "corral_origin_skipped_total",
];

/// A renamed or misspelt metric breaks the dashboard and the alerts
/// silently: every `corral_` name they read must be in a real corral's
/// /metrics (after a hit, a miss, a collapsed flight, a pass and a 5xx,
/// with Redis), or be one of the few exported only on an event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alerts_read_only_metrics_corral_exports() {
    let used = used_metrics();
    assert!(
        used.len() >= 15,
        "the dashboard and the alerts name only {} metrics: {used:?}",
        used.len()
    );

    let redis = corral_tests::Redis::start().await;
    let origin = Origin::new()
        .route(
            "/cached",
            Reply::ok("kept").header("cache-control", "max-age=60"),
        )
        .route(
            "/slow",
            Reply::ok("shared")
                .header("cache-control", "max-age=60")
                .delay(Duration::from_millis(700)),
        )
        .route(
            "/private",
            Reply::ok("mine").header("cache-control", "no-store"),
        )
        .route("/broken", Reply::status(500, "down"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).redis(&redis.url()))
        .start()
        .await;
    let client = corral_tests::Client::new();

    let miss = client.get(&proxy.url("/cached")).await;
    assert!(!miss.cache_status().is_hit(), "{miss:?}");
    let hit = client.get(&proxy.url("/cached")).await;
    assert!(hit.cache_status().is_hit(), "{hit:?}");
    // A leader at the origin, then followers that wait on its flight.
    let slow = proxy.url("/slow");
    let (leader, followers) = tokio::join!(client.get(&slow), async {
        origin.wait_hits("/slow", 1, DEADLINE).await;
        client.burst(3, &slow, &[]).await
    });
    assert_eq!(leader.status, 200);
    assert!(
        followers.iter().any(|a| a.cache_status().collapsed()),
        "{followers:?}"
    );
    let pass = client.get(&proxy.url("/private")).await;
    assert_eq!(pass.status, 200);
    let error = client.get(&proxy.url("/broken")).await;
    assert_eq!(error.status, 500);

    let scrape = corral_tests::lifecycle::scrape(&proxy).await;
    let metrics_rs = workspace_root().join("crates/corral/src/telemetry/metrics.rs");
    let source = read(&metrics_rs);
    let written = |name: &str| source.contains(&format!("\"{}\"", family(name)));
    for name in EXPORTED_ON_EVENT {
        assert!(
            written(name),
            "{name} is allowed to be absent from the scrape, but {} does not export it",
            metrics_rs.display()
        );
        assert!(
            used.contains_key(name),
            "{name} is allowed to be absent but nothing reads it: drop it from the list"
        );
    }
    let mut unknown = Vec::new();
    for (name, files) in &used {
        let exported = scrape.has(name) || (EXPORTED_ON_EVENT.contains(&family(name)));
        if !exported {
            unknown.push(format!("{name} (in {})", files.join(", ")));
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics corral does not export: {}\n--- /metrics:\n{}",
        unknown.join("; "),
        scrape.text()
    );
}
