//! The config loader's tests: what parses, what is refused, and the
//! message (file, line, field) each refusal carries.

use super::*;

const FILE: &str = "corral.yaml";

/// Lines 1-7 of a valid config with one route; `extra` starts at line 8 inside that route.
fn route_with(extra: &str) -> String {
    format!(
        "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache:
  memory: 256MiB
routes:
  - name: api
    upstream: http://127.0.0.1:3000
{extra}"
    )
}

/// `text` parsed; a `redis:` block section that says nothing of
/// `auth` gets `auth: none` (the key is the environment's, which unit
/// tests do not set; `redis_auth_*` tests cover it).
fn config(text: &str) -> Config {
    let text = if text.contains("\n  auth") {
        text.to_owned()
    } else {
        text.replacen("\nredis:\n", "\nredis:\n  auth: none\n", 1)
    };
    parse(FILE, &text).unwrap_or_else(|e| panic!("config refused: {e}"))
}

fn refused(text: &str) -> ConfigError {
    match parse(FILE, text) {
        Ok(config) => panic!("config accepted: {config:?}"),
        Err(error) => error,
    }
}

/// Asserts line, column and field, and returns the message.
fn assert_at(error: &ConfigError, line: u32, column: u32, field: &str) -> String {
    assert_eq!(
        (error.line, error.column, error.field.as_str()),
        (Some(line), Some(column), field),
        "{error}"
    );
    assert_eq!(error.file, FILE);
    error.message.clone()
}

#[test]
fn example_file_loads() {
    let path = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/corral.yaml"
    ));
    let config = load(path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.listen, "127.0.0.1:8080".parse().expect("address"));
    assert_eq!(config.admin, "127.0.0.1:9080".parse().expect("address"));
    assert_eq!(config.cache.memory, 256 * 1024 * 1024);
    assert_eq!(config.routes.len(), 1);
    let route = &config.routes[0];
    assert_eq!(route.name, "api");
    assert_eq!(route.host, None);
    assert_eq!(route.path_prefix, "/");
    assert_eq!(route.upstream, "http://127.0.0.1:3000/");
    assert_eq!(route.cache.ignore_query, ["utm_*", "fbclid"]);
    assert_eq!(
        route.cache.targeted_fields,
        ["corral-cache-control", "cdn-cache-control"]
    );
    assert_eq!(route.coalesce.on_timeout, OnTimeout::Fetch);
    assert!(config.redis.is_none(), "the example runs without Redis");
}

#[test]
fn missing_file_is_a_read_error_without_position() {
    let error = match load(Path::new("/nonexistent/corral.yaml")) {
        Ok(_) => panic!("loaded a missing file"),
        Err(error) => error,
    };
    assert_eq!(error.file, "/nonexistent/corral.yaml");
    assert_eq!((error.line, error.column), (None, None));
    assert_eq!(error.field, "");
    assert!(
        error.message.starts_with("cannot read config file: "),
        "{error}"
    );
}

#[test]
fn minimal_config_gets_every_default() {
    let config = config(
        "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache:
  memory: 64MiB
routes:
  - name: api
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3000
",
    );
    let server = &config.server;
    assert_eq!(server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(server.max_header_size, 16 * 1024);
    assert_eq!(server.shutdown_grace, Duration::from_secs(30));
    assert_eq!(config.cache.memory, 64 * 1024 * 1024);
    assert_eq!(config.cache.max_object_size, 8 * 1024 * 1024);

    let route = &config.routes[0];
    assert_eq!(route.host, None);
    assert_eq!(route.path_prefix, "/");
    assert_eq!(route.upstream.host(), Some("127.0.0.1"));
    assert_eq!(route.upstream.port_u16(), Some(3000));
    assert_eq!(route.timeouts.connect, Duration::from_secs(2));
    assert_eq!(route.timeouts.response_headers, Duration::from_secs(15));
    assert_eq!(route.timeouts.total, Duration::from_secs(60));

    let cache = &route.cache;
    assert!(cache.enabled);
    assert_eq!(cache.default_ttl, None);
    assert!(cache.heuristic_freshness);
    assert_eq!(cache.stale_while_revalidate.default, Duration::ZERO);
    assert_eq!(cache.stale_while_revalidate.max, Duration::from_secs(3600));
    assert_eq!(cache.stale_if_error.default, Duration::ZERO);
    assert_eq!(cache.stale_if_error.max, Duration::from_secs(86_400));
    assert_eq!(cache.ttl_jitter, 0);
    assert_eq!(cache.early_refresh_beta, 1.0);
    assert!(cache.ignore_query.is_empty());
    assert_eq!(cache.identity_headers, ["authorization"]);
    assert_eq!(cache.identity_cookies, ["*"]);
    assert!(!cache.store_set_cookie);
    assert_eq!(cache.hit_for_pass, Duration::from_secs(10));
    assert_eq!(cache.targeted_fields, ["cdn-cache-control"]);

    let coalesce = &route.coalesce;
    assert!(coalesce.enabled);
    assert_eq!(coalesce.lock_timeout, Duration::from_secs(5));
    assert_eq!(coalesce.on_timeout, OnTimeout::Fetch);
}

#[test]
fn every_field_of_the_documented_shape_is_read() {
    let config = config(
        "\
listen: 0.0.0.0:8080
admin: 127.0.0.1:9080
server: { header_read_timeout: 5s, max_header_size: 32KiB, shutdown_grace: 1m }
cache: { memory: 1GB, max_object_size: 1MB }
routes:
  - name: api
    match: { host: API.Example.com, path_prefix: /v1 }
    upstream: http://127.0.0.1:3000
    timeouts: { connect: 250ms, response_headers: 1.5s, total: 2m }
    cache:
      enabled: false
      default_ttl: 30s
      heuristic_freshness: false
      stale_while_revalidate: { default: 10s, max: 1h }
      stale_if_error: { default: 1m, max: 1d }
      stale_max_ratio: 0.5
      ttl_jitter: 10
      early_refresh_beta: 0
      ignore_query: [utm_*, fbclid]
      no_vary_search: true
      identity: { headers: [Authorization, X-Api-Key], cookies: [session] }
      store_set_cookie: true
      hit_for_pass: 0s
    coalesce: { enabled: false, lock_timeout: 100ms, on_timeout: stale }
  - name: static
    match: { host: api.example.com }
    upstream: http://10.0.0.2
",
    );
    assert_eq!(config.server.header_read_timeout, Duration::from_secs(5));
    assert_eq!(config.server.max_header_size, 32 * 1024);
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(60));
    assert_eq!(config.cache.memory, 1_000_000_000);
    assert_eq!(config.cache.max_object_size, 1_000_000);

    let api = &config.routes[0];
    assert_eq!(api.host.as_deref(), Some("api.example.com"));
    assert_eq!(api.path_prefix, "/v1");
    assert_eq!(api.timeouts.connect, Duration::from_millis(250));
    assert_eq!(api.timeouts.response_headers, Duration::from_millis(1500));
    assert_eq!(api.timeouts.total, Duration::from_secs(120));
    let cache = &api.cache;
    assert!(!cache.enabled);
    assert_eq!(cache.default_ttl, Some(Duration::from_secs(30)));
    assert!(!cache.heuristic_freshness);
    assert_eq!(
        cache.stale_while_revalidate.default,
        Duration::from_secs(10)
    );
    assert_eq!(cache.stale_if_error.default, Duration::from_secs(60));
    assert_eq!(cache.stale_if_error.max, Duration::from_secs(86_400));
    assert_eq!(cache.stale_max_ratio, Some(0.5));
    assert!(cache.no_vary_search);
    assert_eq!(cache.ttl_jitter, 10);
    assert_eq!(cache.early_refresh_beta, 0.0);
    assert_eq!(cache.identity_headers, ["authorization", "x-api-key"]);
    assert_eq!(cache.identity_cookies, ["session"]);
    assert!(cache.store_set_cookie);
    assert_eq!(cache.hit_for_pass, Duration::ZERO);
    assert!(!api.coalesce.enabled);
    assert_eq!(api.coalesce.lock_timeout, Duration::from_millis(100));
    assert_eq!(api.coalesce.on_timeout, OnTimeout::Stale);

    let static_route = &config.routes[1];
    assert_eq!(static_route.path_prefix, "/");
    assert_eq!(static_route.upstream.host(), Some("10.0.0.2"));
}

#[test]
fn unknown_field_in_route_cache_names_line_and_path() {
    let error = refused(
        "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache: { memory: 256MiB }
routes:
- name: api
  cache:
    bogus: 1
  upstream: http://127.0.0.1:3000
",
    );
    let message = assert_at(&error, 7, 5, "routes[0].cache.bogus");
    assert!(
        error
            .to_string()
            .starts_with("corral.yaml:7:5: routes[0].cache.bogus: unknown field `bogus`"),
        "{error}"
    );
    assert!(message.contains("default_ttl"), "{message}");
}

#[test]
fn an_ip_limit_counts_one_ipv6_customer_by_its_64_unless_told() {
    let limit = |c: &Config| {
        (
            c.routes[0].limits[0].ipv4_prefix,
            c.routes[0].limits[0].ipv6_prefix,
        )
    };
    let plain = config(&route_with(
        "    limits: [{ name: a, key: ip, rate: 3/min }]\n",
    ));
    assert_eq!(limit(&plain), (32, 64), "the defaults");
    let each = config(&route_with(
        "    limits: [{ name: a, key: ip, rate: 3/min, ipv6_prefix: 128 }]\n",
    ));
    assert_eq!(limit(&each), (32, 128));
}

#[test]
fn backoff_after_counts_failures_in_a_row_and_is_at_least_one() {
    let routes = |c: &Config| c.routes[0].backoff;
    assert_eq!(routes(&config(&route_with(""))).after, 2, "the default");
    let set = config(&route_with("    backoff: { min: 2s, after: 1 }\n"));
    assert_eq!(routes(&set).after, 1);
    assert_eq!(routes(&set).min, std::time::Duration::from_secs(2));
    let error = refused(&route_with("    backoff: { after: 0 }\n"));
    assert_at(&error, 8, 23, "routes[0].backoff.after");
    let error = refused(&route_with("    backoff: { after: twice }\n"));
    assert_at(&error, 8, 23, "routes[0].backoff.after");
}

#[test]
fn unknown_field_in_flow_mapping_and_at_top_level() {
    let error = refused(&route_with("    coalesce: { enabled: true, wait: 5s }\n"));
    assert_at(&error, 8, 32, "routes[0].coalesce.wait");

    let text = route_with("").replace("routes:", "listen_on: 1\nroutes:");
    let error = refused(&text);
    assert_at(&error, 5, 1, "listen_on");
}

#[test]
fn stale_after_defaults_to_two_seconds_and_refuses_zero() {
    let config = config(&route_with("    timeouts: { stale_after: 500ms }\n"));
    assert_eq!(
        config.routes[0].timeouts.stale_after,
        Duration::from_millis(500)
    );
    assert_eq!(
        TimeoutsConfig::default().stale_after,
        Duration::from_secs(2)
    );
    let error = refused(&route_with("    timeouts:\n      stale_after: 0s\n"));
    assert_at(&error, 9, 20, "routes[0].timeouts.stale_after");
}

#[test]
fn bad_duration_names_the_field() {
    let error = refused(&route_with("    coalesce:\n      lock_timeout: 5x\n"));
    let message = assert_at(&error, 9, 21, "routes[0].coalesce.lock_timeout");
    assert_eq!(message, "unknown unit `x` in `5x` (units: ms, s, m, h, d)");
}

#[test]
fn bare_number_duration_is_refused() {
    let error = refused(&route_with("    timeouts:\n      total: 30\n"));
    let message = assert_at(&error, 9, 14, "routes[0].timeouts.total");
    assert!(message.contains("missing unit"), "{message}");
}

#[test]
fn sizes_parse_with_binary_and_decimal_units() {
    let text = route_with("").replace("memory: 256MiB", "memory: 256MiB\n  max_object_size: 1GB");
    let text = text.replace("memory: 256MiB", "memory: 2GiB");
    let config = config(&format!("server:\n  max_header_size: 16KiB\n{text}"));
    assert_eq!(config.cache.memory, 2 * 1024 * 1024 * 1024);
    assert_eq!(config.cache.max_object_size, 1_000_000_000);
    assert_eq!(config.server.max_header_size, 16_384);

    let config = self::config(&route_with(""));
    assert_eq!(config.cache.memory, 268_435_456);
}

#[test]
fn ambiguous_size_unit_is_refused() {
    let error = refused(&route_with("").replace("256MiB", "256M"));
    let message = assert_at(&error, 4, 11, "cache.memory");
    assert!(message.contains("ambiguous unit `M`"), "{message}");
}

#[test]
fn duplicate_route_names_are_refused_at_the_second() {
    let error = refused(&route_with(
        "  - name: api\n    match: { path_prefix: /other }\n    upstream: http://127.0.0.1:3001\n",
    ));
    let message = assert_at(&error, 8, 11, "routes[1].name");
    assert_eq!(
        message,
        "duplicate route name `api` (already used by routes[0])"
    );
}

#[test]
fn identical_matches_are_refused() {
    let error = refused(&route_with(
        "  - name: web\n    upstream: http://127.0.0.1:3001\n",
    ));
    let message = assert_at(&error, 8, 5, "routes[1].match");
    assert!(message.contains("never be used"), "{message}");
}

#[test]
fn prefixes_that_differ_only_in_case_are_one_match_unless_both_are_case_sensitive() {
    let two = |a: &str, b: &str| {
        format!(
            "  - name: lower\n    match: {{ path_prefix: /api{a} }}\n    upstream: http://127.0.0.1:3001\n  - name: upper\n    match: {{ path_prefix: /API{b} }}\n    upstream: http://127.0.0.1:3002\n"
        )
    };
    let error = refused(&route_with(&two("", "")));
    let message = assert_at(&error, 12, 27, "routes[2].match.path_prefix");
    assert!(message.contains("never be used"), "{message}");
    let error = refused(&route_with(&two(", case_sensitive: true", "")));
    assert!(error.to_string().contains("never be used"), "{error}");
    let both = ", case_sensitive: true";
    let config = config(&route_with(&two(both, both)));
    assert!(config.routes[1].case_sensitive && config.routes[2].case_sensitive);
    assert!(!config.routes[0].case_sensitive);
    assert!(!config.routes[0].underscores_in_headers);
    let config = self::config(&route_with("    underscores_in_headers: true\n"));
    assert!(config.routes[0].underscores_in_headers);
}

#[test]
fn listen_equal_to_admin_is_refused() {
    let error = refused(&route_with("").replace("127.0.0.1:9080", "127.0.0.1:8080"));
    let message = assert_at(&error, 2, 8, "admin");
    assert!(message.contains("overlaps listen"), "{message}");

    // Port 0 lets the OS pick, so two ephemeral listeners are fine.
    let text = route_with("")
        .replace("127.0.0.1:9080", "127.0.0.1:0")
        .replace("127.0.0.1:8080", "127.0.0.1:0");
    config(&text);
}

#[test]
fn admin_hosts_are_names_and_health_listen_has_its_own_port() {
    let text = route_with("").replace(
            "admin: 127.0.0.1:9080\n",
            "admin: 127.0.0.1:9080\nhealth_listen: 0.0.0.0:9081\nserver:\n  admin_hosts: [Corral.Example., ops-1]\n",
        );
    let c = config(&text);
    assert_eq!(c.server.admin_hosts, ["corral.example", "ops-1"]);
    assert_eq!(c.health_listen, Some("0.0.0.0:9081".parse().expect("addr")));
    assert_eq!(config(&route_with("")).health_listen, None);

    let text = route_with("").replace(
        "admin: 127.0.0.1:9080\n",
        "admin: 127.0.0.1:9080\nserver:\n  admin_hosts: [ok.example, \"evil.example:9080\"]\n",
    );
    let message = assert_at(&refused(&text), 4, 29, "server.admin_hosts[1]");
    assert!(message.contains("without a port"), "{message}");

    let text = route_with("").replace(
        "admin: 127.0.0.1:9080\n",
        "admin: 127.0.0.1:9080\nhealth_listen: 0.0.0.0:9080\n",
    );
    let message = assert_at(&refused(&text), 3, 16, "health_listen");
    assert!(message.contains("its own port"), "{message}");
}

#[test]
fn https_upstream_gets_tls_and_tls_on_http_is_refused() {
    let https = route_with("    tls: { insecure_skip_verify: true, server_name: api.internal }\n")
        .replace("http://127.0.0.1:3000", "https://10.0.0.7:8443");
    let c = config(&https);
    let tls = c.routes[0].tls.as_ref().expect("an https route has TLS");
    assert!(tls.insecure_skip_verify);
    assert_eq!(
        tls.server_name.as_ref().map(|n| n.to_str().into_owned()),
        Some("api.internal".to_owned())
    );
    let error = refused(&route_with("    tls: { insecure_skip_verify: true }\n"));
    let message = assert_at(&error, 8, 10, "routes[0].tls");
    assert_eq!(message, "applies to https:// upstreams only");
}

#[test]
fn garbage_upstreams_are_refused() {
    for (upstream, hint) in [
        ("not a uri", "not a valid URI"),
        ("127.0.0.1:3000", "no scheme"),
        ("http://127.0.0.1:3000/api", "path or query"),
        ("ftp://files", "unsupported scheme"),
    ] {
        let error = refused(&route_with("").replace("http://127.0.0.1:3000", upstream));
        let message = assert_at(&error, 7, 15, "routes[0].upstream");
        assert!(message.contains(hint), "{upstream}: {message}");
    }
}

#[test]
fn missing_upstream_points_at_the_route() {
    let text = route_with("").replace("    upstream: http://127.0.0.1:3000\n", "");
    let error = refused(&text);
    let message = assert_at(&error, 6, 5, "routes[0].upstream");
    assert_eq!(message, "required field is missing");
}

#[test]
fn required_field_without_value_points_at_its_key() {
    let text = route_with("").replace("upstream: http://127.0.0.1:3000", "upstream:");
    let message = assert_at(&refused(&text), 7, 5, "routes[0].upstream");
    assert_eq!(message, "required field has no value");

    // A `cache:` with nothing in it is the defaults.
    let text = route_with("").replace("  memory: 256MiB\n", "");
    assert_eq!(config(&text).cache.memory, 256 << 20);
}

#[test]
fn stale_default_above_max_is_refused() {
    let error = refused(&route_with(
        "    cache:\n      stale_while_revalidate:\n        default: 2h\n        max: 1h\n",
    ));
    let message = assert_at(
        &error,
        10,
        18,
        "routes[0].cache.stale_while_revalidate.default",
    );
    assert_eq!(message, "default (2h) must not exceed max (1h)");

    // Against the default max, the written default is still the one blamed.
    let error = refused(&route_with(
        "    cache:\n      stale_if_error: { default: 2d }\n",
    ));
    let message = assert_at(&error, 9, 34, "routes[0].cache.stale_if_error.default");
    assert_eq!(
        message,
        "default (2d) must not exceed max (1d, the default)"
    );
}

#[test]
fn a_stale_max_ratio_that_is_not_a_fraction_is_refused() {
    assert_eq!(
        RouteCacheConfig::default().stale_max_ratio,
        None,
        "off unless set"
    );
    let error = refused(&route_with("    cache:\n      stale_max_ratio: 50%\n"));
    let message = assert_at(&error, 9, 24, "routes[0].cache.stale_max_ratio");
    assert_eq!(
        message,
        "`50%` is not a finite number >= 0: a fraction of the freshness lifetime, e.g. 0.5 for half"
    );
}

#[test]
fn ttl_jitter_above_50_is_refused() {
    let error = refused(&route_with("    cache:\n      ttl_jitter: 60\n"));
    let message = assert_at(&error, 9, 19, "routes[0].cache.ttl_jitter");
    assert_eq!(
        message,
        "60% is out of range: ttl_jitter is a percentage from 0 to 50"
    );
}

#[test]
fn max_object_size_above_memory_is_refused() {
    let text = route_with("").replace("memory: 256MiB", "memory: 1MiB\n  max_object_size: 2MiB");
    let error = refused(&text);
    let message = assert_at(&error, 5, 20, "cache.max_object_size");
    assert_eq!(
        message,
        "max_object_size (2MiB) must not exceed memory (1MiB)"
    );

    // With the 8MiB default, the written memory is blamed.
    let error = refused(&route_with("").replace("256MiB", "1MiB"));
    let message = assert_at(&error, 4, 11, "cache.memory");
    assert_eq!(
        message,
        "max_object_size (8MiB, the default) must not exceed memory (1MiB)"
    );
}

#[test]
fn timeout_longer_than_total_is_refused() {
    let error = refused(&route_with("    timeouts: { connect: 90s }\n"));
    let message = assert_at(&error, 8, 26, "routes[0].timeouts.connect");
    assert_eq!(
        message,
        "connect (90s) must not exceed total (1m, the default)"
    );

    let error = refused(&route_with("    timeouts: { total: 10s }\n"));
    let message = assert_at(&error, 8, 24, "routes[0].timeouts.total");
    assert_eq!(
        message,
        "response_headers (15s, the default) must not exceed total (10s)"
    );

    let error = refused(&route_with("    timeouts: { connect: 0s }\n"));
    assert_at(&error, 8, 26, "routes[0].timeouts.connect");
}

#[test]
fn list_entries_are_named_by_index() {
    let error = refused(&route_with(
        "    cache:\n      identity:\n        headers: [authorization, \"x api\"]\n",
    ));
    let message = assert_at(&error, 10, 34, "routes[0].cache.identity.headers[1]");
    assert_eq!(message, "`x api` is not a valid header name");
}

#[test]
fn wrong_shapes_name_the_field() {
    let error = refused(&route_with("    coalesce:\n      lock_timeout: [5s]\n"));
    let message = assert_at(&error, 9, 21, "routes[0].coalesce.lock_timeout");
    assert_eq!(message, "expected a single value, not a list or mapping");

    let error = refused(&route_with("    cache:\n      enabled: yes\n"));
    assert_at(&error, 9, 16, "routes[0].cache.enabled");

    let error = refused(&route_with("").replace("routes:\n", "routes: 5\n"));
    assert_at(&error, 5, 9, "routes");
}

#[test]
fn empty_routes_and_missing_sections_are_refused() {
    let error = refused(
        "listen: 127.0.0.1:8080\nadmin: 127.0.0.1:9080\ncache: { memory: 1GiB }\nroutes: []\n",
    );
    let message = assert_at(&error, 4, 9, "routes");
    assert_eq!(message, "at least one route is required");

    let error = refused("listen: 127.0.0.1:8080\nadmin: 127.0.0.1:9080\nroutes: []\n");
    assert_at(&error, 3, 9, "routes");
    let error = refused("listen: 127.0.0.1:8080\n");
    let message = assert_at(&error, 1, 1, "routes");
    assert_eq!(message, "required field is missing");
}

#[test]
fn a_minimal_config_is_listen_and_a_route_with_an_upstream() {
    let c = config("listen: 127.0.0.1:8080\nroutes:\n  - upstream: http://127.0.0.1:3000\n");
    assert_eq!(c.admin, "127.0.0.1:9080".parse().expect("addr"));
    assert_eq!(c.cache.memory, 256 << 20);
    assert_eq!(c.routes[0].name, "route-0");
    assert_eq!(c.routes[0].path_prefix, "/");
    assert_eq!(c.routes[0].cache.identity_cookies, ["*"]);
    // The default admin address is not silently shared with listen.
    let error = refused("listen: 127.0.0.1:9080\nroutes:\n  - upstream: http://127.0.0.1:3000\n");
    let message = assert_at(&error, 1, 9, "listen");
    assert!(message.contains("give `admin:` another"), "{message}");
}

#[test]
fn every_missing_or_unreadable_required_field_is_reported_in_one_run() {
    let text = "admin: nowhere\ncache: { memory: lots }\nroutes:\n  - name: a\n  - name: \"b c\"\n    upstream: ftp://x\n  - upstreams: [\"127.0.0.1:2\"]\n";
    let error = refused(text);
    let all: Vec<(Option<u32>, &str)> = std::iter::once(&error)
        .chain(&error.also)
        .map(|e| (e.line, e.field.as_str()))
        .collect();
    assert_eq!(
        all,
        [
            (Some(1), "listen"),
            (Some(1), "admin"),
            (Some(2), "cache.memory"),
            (Some(4), "routes[0].upstream"),
            (Some(5), "routes[1].name"),
            (Some(6), "routes[1].upstream"),
            (Some(7), "routes[2].upstreams[0]"),
        ],
        "{error}"
    );
    assert_eq!(error.to_string().lines().count(), 7, "{error}");
}

#[test]
fn targeted_fields_are_header_names_other_than_cache_control() {
    let error = refused(&route_with(
        "    cache: { targeted_fields: [CDN-Cache-Control, Cache-Control] }\n",
    ));
    let message = assert_at(&error, 8, 51, "routes[0].cache.targeted_fields[1]");
    assert!(
        message.contains("Cache-Control is what a targeted field overrides"),
        "{message}"
    );
    let error = refused(&route_with(
        "    cache: { targeted_fields: [\"bad name\"] }\n",
    ));
    assert_at(&error, 8, 32, "routes[0].cache.targeted_fields[0]");
}

#[test]
fn wait_list_bounds_are_checked() {
    let error = refused(&route_with("    coalesce: { max_waiters: 0 }\n"));
    assert_at(&error, 8, 30, "routes[0].coalesce.max_waiters");
    let error = refused(&route_with(
        "    coalesce: { lock_timeout: 2s, lock_age: 2s }\n",
    ));
    let message = assert_at(&error, 8, 45, "routes[0].coalesce.lock_age");
    assert!(message.contains("shorter than lock_timeout"), "{message}");
    let config = config(&route_with(
        "    coalesce: { lock_age: 1500ms, max_waiters: 7 }\n",
    ));
    let c = &config.routes[0].coalesce;
    assert_eq!(
        (c.lock_age, c.max_waiters),
        (Some(Duration::from_millis(1500)), 7)
    );
}

#[test]
fn post_coalescing_is_opt_in_and_bounded() {
    let config = config(&route_with(""));
    assert_eq!(config.routes[0].coalesce.post_max_body, None);
    assert!(!config.routes[0].cache.post);
    let config = super::parse(
        FILE,
        &route_with("    coalesce: { post: {} }\n    cache: { post: true }\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.routes[0].coalesce.post_max_body, Some(64 * 1024));
    assert!(config.routes[0].cache.post);
    assert_eq!(
        config.routes[0].coalesce.post_read_timeout,
        std::time::Duration::from_secs(5),
        "well below timeouts.total"
    );
    assert_eq!(config.cache.post_memory, config.cache.fill_memory / 16);
    let set = super::parse(
        FILE,
        &route_with("    coalesce: { post: { read_timeout: 2s } }\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        set.routes[0].coalesce.post_read_timeout,
        std::time::Duration::from_secs(2)
    );
    let error = refused(&route_with(
        "    coalesce: { post: { read_timeout: 0s } }\n",
    ));
    assert_at(&error, 8, 39, "routes[0].coalesce.post.read_timeout");
    let error = refused(&route_with("    coalesce: { post: { max_body: 2MiB } }\n"));
    let message = assert_at(&error, 8, 35, "routes[0].coalesce.post.max_body");
    assert!(message.contains("between 1 byte and 1MiB"), "{message}");
}

#[test]
fn unknown_on_timeout_is_refused() {
    let error = refused(&route_with("    coalesce: { on_timeout: wait }\n"));
    let message = assert_at(&error, 8, 29, "routes[0].coalesce.on_timeout");
    assert_eq!(
        message,
        "unknown value `wait` (expected one of: fetch, fetch_each, stale, error)"
    );
}

#[test]
fn tab_indentation_is_a_syntax_error_with_a_line() {
    let text = route_with("    cache:\n\tenabled: true\n");
    let error = refused(&text);
    assert_eq!(error.line, Some(9), "{error}");
    assert!(error.message.contains("tab"), "{error}");
}

#[test]
fn yaml_syntax_error_has_a_line() {
    let error = refused(&route_with("    cache: { enabled: true\n"));
    assert!(error.line.is_some(), "{error}");
    let error = refused("listen: 127.0.0.1:8080\nadmin: [\n");
    assert!(error.line.is_some(), "{error}");
}

#[test]
fn empty_file_is_refused() {
    let error = refused("");
    assert!(error.message.contains("empty"), "{error}");
    let error = refused("# only a comment\n");
    assert!(error.message.contains("empty"), "{error}");
}

#[test]
fn duplicate_keys_are_refused() {
    let error = refused(&route_with("    upstream: http://127.0.0.1:3001\n"));
    assert_at(&error, 8, 5, "routes[0].upstream");
}

/// A valid config whose `redis:` section starts at line 8; `fields` start at line 9.
fn redis_with(fields: &str) -> String {
    format!("{}redis:\n{fields}", route_with(""))
}

#[test]
fn redis_auth_needs_a_key_or_an_explicit_none() {
    let base = "  url: redis://127.0.0.1\n";
    let error = refused(&redis_with(base));
    assert_eq!(error.field, "redis", "{error}");
    assert!(error.message.contains("auth: none"), "{error}");
    let off = parse(FILE, &redis_with(&format!("{base}  auth: none\n")))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        off.redis.map(|r| r.auth),
        Some(corral_core::callers::peer_auth::PeerAuth::Off)
    ));
    let bad = refused(&redis_with(&format!("{base}  auth: maybe\n")));
    assert_eq!(bad.field, "redis.auth", "{bad}");
}

#[test]
fn redis_auth_key_file_is_read_and_must_be_long_enough() {
    let dir = std::env::temp_dir().join(format!("corral-auth-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let (long, short) = (dir.join("long"), dir.join("short"));
    std::fs::write(&long, format!("{}\n", "k".repeat(32))).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&short, format!("{}\n", "k".repeat(31))).unwrap_or_else(|e| panic!("{e}"));
    let with = |p: &std::path::Path| {
        redis_with(&format!(
            "  url: redis://127.0.0.1\n  auth_key_file: {}\n",
            p.display()
        ))
    };
    let keyed = parse(FILE, &with(&long)).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        keyed.redis.map(|r| r.auth),
        Some(corral_core::callers::peer_auth::PeerAuth::Key(_))
    ));
    // The trailing newline is not part of the key: 31 bytes are refused.
    let error = refused(&with(&short));
    assert_eq!(error.field, "redis.auth_key_file", "{error}");
    let both = refused(&format!("{}  auth: none\n", with(&long)));
    assert_eq!(both.field, "redis.auth_key_file", "{both}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn redis_section_absent_is_none() {
    assert!(config(&route_with("")).redis.is_none());
}

#[test]
fn every_redis_field_is_read() {
    let config = config(&redis_with(
        "  url: redis://corral:s3cret@redis.internal:6380/2
  op_timeout: 20ms
  connect_timeout: 500ms
  lease_ttl: 100ms
  lease_window: 100ms
  key_prefix: \"edge:v2:\"
  l2_max_object_size: 256KiB
  breaker: { failures: 3, open_for: 10s }
",
    ));
    let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
    assert_eq!(
        redis.servers,
        RedisServers::Node("redis://corral:s3cret@redis.internal:6380/2".into())
    );
    assert_eq!(redis.op_timeout, Duration::from_millis(20));
    assert_eq!(redis.connect_timeout, Duration::from_millis(500));
    assert_eq!(redis.lease_ttl, Duration::from_millis(100));
    assert_eq!(redis.lease_window, Duration::from_millis(100));
    assert_eq!(redis.key_prefix, "edge:v2:");
    assert_eq!(redis.l2_max_object_size, 256 * 1024);
    assert_eq!(redis.breaker_failures, 3);
    assert_eq!(redis.breaker_open_for, Duration::from_secs(10));
}

/// Every `redis:` field but `url` at its documented default.
fn assert_redis_defaults(redis: &RedisConfig) {
    assert_eq!(redis.op_timeout, Duration::from_millis(50));
    assert_eq!(redis.connect_timeout, Duration::from_secs(1));
    assert_eq!(redis.lease_ttl, Duration::from_secs(3));
    assert_eq!(redis.lease_window, Duration::from_secs(1));
    assert_eq!(redis.key_prefix, "corral:");
    assert_eq!(redis.l2_max_object_size, 1024 * 1024);
    assert_eq!(redis.breaker_failures, 5);
    assert_eq!(redis.breaker_open_for, Duration::from_secs(2));
}

#[test]
fn redis_defaults_fill_every_field_but_url() {
    let config = config(&redis_with("  url: redis://127.0.0.1\n"));
    let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
    assert_eq!(
        redis.servers,
        RedisServers::Node("redis://127.0.0.1".into())
    );
    assert_redis_defaults(&redis);

    // A breaker mapping with one field keeps the other's default.
    let config = self::config(&redis_with(
        "  url: redis://127.0.0.1\n  breaker: { failures: 1 }\n",
    ));
    let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
    assert_eq!(redis.breaker_failures, 1);
    assert_eq!(redis.breaker_open_for, Duration::from_secs(2));
}

#[test]
fn documented_redis_section_parses_when_uncommented() {
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/corral.yaml"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let mut in_block = false;
    let mut uncommented = 0;
    let text: String = example
        .lines()
        .map(|line| {
            if line == "# redis:" {
                in_block = true;
            } else if in_block && !line.starts_with("#   ") {
                in_block = false;
            }
            if in_block {
                uncommented += 1;
                format!("{}\n", &line[2..])
            } else {
                format!("{line}\n")
            }
        })
        .collect();
    assert!(uncommented > 10, "no `# redis:` block in the example");
    let redis = config(&text)
        .redis
        .unwrap_or_else(|| panic!("uncommented block has no redis section"));
    assert_eq!(
        redis.servers,
        RedisServers::Node("redis://127.0.0.1:6379/0".into())
    );
    assert_redis_defaults(&redis);

    // The documented alternatives, each in place of `url`.
    let without_url = text.replace("  url: redis://127.0.0.1:6379/0\n", "");
    assert_ne!(without_url, text, "the example's url line moved");
    let cluster = config(&without_url.replace("  # cluster: [", "  cluster: ["))
        .redis
        .unwrap_or_else(|| panic!("no redis section"));
    assert!(
        matches!(&cluster.servers, RedisServers::Cluster(n) if n.len() == 3),
        "{:?}",
        cluster.servers
    );
    let mut sentinel = without_url.replace("  # sentinel:\n", "  sentinel:\n");
    for key in ["master", "nodes", "username", "password", "db"] {
        sentinel = sentinel.replace(&format!("  #   {key}:"), &format!("    {key}:"));
    }
    let sentinel = config(&sentinel)
        .redis
        .unwrap_or_else(|| panic!("no redis section"));
    match &sentinel.servers {
        RedisServers::Sentinel(s) => {
            assert_eq!((s.master.as_str(), s.nodes.len(), s.db), ("mymaster", 3, 0));
            assert_eq!(s.username.as_deref(), Some("corral"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn rediss_is_accepted_and_tls_on_plain_redis_is_refused() {
    let c = config(&redis_with("  url: rediss://redis.internal:6380\n"));
    assert!(c.redis.as_ref().is_some_and(|r| r.servers.tls()));
    let error = refused(&redis_with(
        "  url: redis://redis.internal:6379\n  tls: { ca_file: /nonexistent }\n",
    ));
    assert_eq!(error.field, "redis.tls");
}

#[test]
fn the_runtime_is_shared_unless_per_core_is_asked_with_bounded_workers() {
    let c = config(&route_with(""));
    assert_eq!(
        (c.server.runtime, c.server.workers),
        (RuntimeMode::Shared, None)
    );
    let c = config(&format!(
        "server:\n  runtime: per_core\n  workers: 8\n{}",
        route_with("")
    ));
    assert_eq!(
        (c.server.runtime, c.server.workers),
        (RuntimeMode::PerCore, Some(8))
    );
    let c = config(&format!("server:\n  cpu_threads: 0\n{}", route_with("")));
    assert_eq!(c.server.cpu_threads, Some(0), "0: inline");
    assert_eq!(config(&route_with("")).server.cpu_threads, None);
    for (fields, column, field, hint) in [
        (
            "  runtime: threads\n",
            12,
            "server.runtime",
            "write shared or per_core",
        ),
        ("  workers: 0\n", 12, "server.workers", "at least 1"),
        (
            "  workers: 4096\n",
            12,
            "server.workers",
            "more than the 1024 allowed",
        ),
        (
            "  cpu_threads: 4096\n",
            16,
            "server.cpu_threads",
            "more than the 1024 allowed",
        ),
        (
            "  cpu_threads: some\n",
            16,
            "server.cpu_threads",
            "whole number",
        ),
    ] {
        let error = refused(&format!("server:\n{fields}{}", route_with("")));
        let message = assert_at(&error, 2, column, field);
        assert!(message.contains(hint), "{fields}: {message}");
    }
}

#[test]
fn overload_sheds_at_90_percent_unless_set_or_turned_off() {
    assert_eq!(config(&route_with("")).server.overload, Some(90));
    for (value, expected) in [("50%", Some(50)), ("100", Some(100)), ("off", None)] {
        let c = config(&format!("server:\n  overload: {value}\n{}", route_with("")));
        assert_eq!(c.server.overload, expected, "{value}");
    }
    for value in ["0%", "101%", "high", "95.5%"] {
        let error = refused(&format!("server:\n  overload: {value}\n{}", route_with("")));
        let message = assert_at(&error, 2, 13, "server.overload");
        assert!(
            message.contains("whole percentage from 1 to 100"),
            "{value}: {message}"
        );
    }
}

#[test]
fn the_proxy_name_is_corral_unless_set_to_a_token() {
    assert_eq!(config(&route_with("")).server.proxy_name, "corral");
    for value in ["edge-7.example", "corral/web-3", "cdn:1"] {
        let c = config(&format!(
            "server:\n  proxy_name: {value}\n{}",
            route_with("")
        ));
        assert_eq!(c.server.proxy_name, value);
    }
    for value in ["\"two words\"", "a,b", "x;y=1", "7up", "\"\""] {
        let error = refused(&format!(
            "server:\n  proxy_name: {value}\n{}",
            route_with("")
        ));
        let message = assert_at(&error, 2, 15, "server.proxy_name");
        assert!(message.contains("RFC 8941 token"), "{value}: {message}");
    }
}

#[test]
fn a_cluster_is_its_seed_nodes_and_sentinel_its_master_name_and_sentinels() {
    let c = config(&redis_with(
        "  cluster: [redis://10.0.0.1:7000, redis://:s3cret@10.0.0.2:7000/0]\n",
    ));
    let redis = c.redis.unwrap_or_else(|| panic!("no redis"));
    assert_eq!(
        redis.servers,
        RedisServers::Cluster(vec![
            "redis://10.0.0.1:7000".into(),
            "redis://:s3cret@10.0.0.2:7000/0".into()
        ])
    );
    assert!(!redis.servers.tls());
    assert_redis_defaults(&redis);

    let c = config(&redis_with(
        "  sentinel:\n    master: cache-primary\n    nodes: [rediss://s1:26379, rediss://s2:26379]\n    username: corral\n    password: s3cret\n    db: 2\n",
    ));
    let redis = c.redis.unwrap_or_else(|| panic!("no redis"));
    assert_eq!(
        redis.servers,
        RedisServers::Sentinel(SentinelConfig {
            master: "cache-primary".into(),
            nodes: vec!["rediss://s1:26379".into(), "rediss://s2:26379".into()],
            username: Some("corral".into()),
            password: Some("s3cret".into()),
            db: 2,
        })
    );
    assert!(redis.servers.tls(), "the sentinels' scheme is the master's");
    assert!(!format!("{:?}", redis.servers).contains("s3cret"));
}

#[test]
fn cluster_and_sentinel_mistakes_name_their_line_and_field() {
    for (fields, line, column, field, hint) in [
        (
            "  url: redis://a\n  cluster: [redis://b]\n",
            10,
            12,
            "redis.cluster",
            "redis.url is set too",
        ),
        ("  cluster: []\n", 9, 12, "redis.cluster", "no seed nodes"),
        (
            "  cluster: [redis://a:7000, rediss://b:7000]\n",
            9,
            29,
            "redis.cluster[1]",
            "mixes redis:// and rediss://",
        ),
        (
            "  cluster: [redis://a:7000/3]\n",
            9,
            13,
            "redis.cluster[0]",
            "only database 0",
        ),
        (
            "  sentinel: { nodes: [redis://s1] }\n",
            9,
            13,
            "redis.sentinel.master",
            "required field is missing",
        ),
        (
            "  sentinel: { master: m, nodes: [] }\n",
            9,
            33,
            "redis.sentinel.nodes",
            "no sentinels",
        ),
        (
            "  sentinel: { master: m, nodes: [redis://s1:26379/1] }\n",
            9,
            34,
            "redis.sentinel.nodes[0]",
            "a sentinel has no database",
        ),
        (
            "  sentinel: { master: m, nodes: [redis://s1], db: x }\n",
            9,
            51,
            "redis.sentinel.db",
            "not a database number",
        ),
        (
            "  sentinel: { master: 'two words', nodes: [redis://s1] }\n",
            9,
            23,
            "redis.sentinel.master",
            "one word",
        ),
        (
            "  cluster: [redis://a]\n  tls: { ca_file: /nonexistent }\n",
            10,
            8,
            "redis.tls",
            "rediss:// URLs only",
        ),
    ] {
        let error = refused(&redis_with(fields));
        let message = assert_at(&error, line, column, field);
        assert!(message.contains(hint), "{fields}: {message}");
    }
}

#[test]
fn garbage_redis_urls_are_refused_without_echoing_passwords() {
    for (url, hint) in [
        ("http://127.0.0.1:6379", "unsupported scheme `http`"),
        ("127.0.0.1:6379", "no scheme"),
        ("redis://", "not a valid URL"),
        ("redis://:hunter2@127.0.0.1:0", "port 0"),
        ("redis://:hunter2@127.0.0.1/cache", "database number"),
        ("redis://127.0.0.1/0?protocol=resp3", "query parameters"),
        ("redis://:hunter2@0.0.0.0:6379", "wildcard"),
    ] {
        let error = refused(&redis_with(&format!("  url: {url}\n")));
        let message = assert_at(&error, 9, 8, "redis.url");
        assert!(message.contains(hint), "{url}: {message}");
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }
}

#[test]
fn missing_redis_url_is_refused() {
    let error = refused(&redis_with("  op_timeout: 10ms\n"));
    let message = assert_at(&error, 9, 3, "redis.url");
    assert!(
        message.starts_with("required field is missing"),
        "{message}"
    );
    assert!(
        message.contains("redis.cluster or redis.sentinel"),
        "{message}"
    );

    let error = refused(&redis_with("  url:\n"));
    let message = assert_at(&error, 9, 3, "redis.url");
    assert_eq!(message, "required field has no value");

    // Every line of the section commented out: not silently "no Redis".
    let error = refused(&redis_with("#  url: redis://127.0.0.1\n"));
    let message = assert_at(&error, 8, 1, "redis");
    assert!(message.contains("remove `redis:`"), "{message}");
}

#[test]
fn unknown_field_in_redis_names_line_and_path() {
    let error = refused(&redis_with("  url: redis://127.0.0.1\n  bogus: 1\n"));
    assert_at(&error, 10, 3, "redis.bogus");
    assert!(
        error.message.starts_with(
            "unknown field `bogus` (expected one of: url, cluster, sentinel, op_timeout"
        ),
        "{error}"
    );

    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  breaker: { failures: 2, cooldown: 1s }\n",
    ));
    assert_at(&error, 10, 27, "redis.breaker.cooldown");
}

#[test]
fn bad_key_prefix_is_refused() {
    let too_long = format!("\"{}\"", "k".repeat(65));
    for (prefix, hint) in [
        ("\"a b\"", "whitespace"),
        ("\"corral:{x}:\"", "hash tag"),
        ("\"\"", "1 to 64"),
        (too_long.as_str(), "65 characters"),
    ] {
        let error = refused(&redis_with(&format!(
            "  url: redis://127.0.0.1\n  key_prefix: {prefix}\n"
        )));
        let message = assert_at(&error, 10, 15, "redis.key_prefix");
        assert!(message.contains(hint), "{prefix}: {message}");
    }
    // 64 characters is the limit, not past it.
    let text = redis_with(&format!(
        "  url: redis://127.0.0.1\n  key_prefix: {}\n",
        "k".repeat(64)
    ));
    assert!(config(&text).redis.is_some());
}

#[test]
fn zero_op_timeout_is_refused() {
    let error = refused(&redis_with("  url: redis://127.0.0.1\n  op_timeout: 0s\n"));
    let message = assert_at(&error, 10, 15, "redis.op_timeout");
    assert_eq!(message, "must be greater than 0");

    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  connect_timeout: 0ms\n",
    ));
    assert_at(&error, 10, 20, "redis.connect_timeout");
    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  l2_max_object_size: 0\n",
    ));
    assert_at(&error, 10, 23, "redis.l2_max_object_size");
}

#[test]
fn lease_ttl_below_100ms_is_refused() {
    let error = refused(&redis_with("  url: redis://127.0.0.1\n  lease_ttl: 99ms\n"));
    let message = assert_at(&error, 10, 14, "redis.lease_ttl");
    assert_eq!(message, "99ms is below the 100ms minimum");
}

#[test]
fn a_lease_window_past_lease_ttl_is_refused_and_a_short_lease_ttl_bounds_its_default() {
    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  lease_window: 4s\n",
    ));
    let message = assert_at(&error, 10, 17, "redis.lease_window");
    assert_eq!(message, "4s is outside 100ms to redis.lease_ttl (3s)");
    let config = config(&redis_with(
        "  url: redis://127.0.0.1\n  lease_ttl: 300ms\n",
    ));
    let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
    assert_eq!(redis.lease_window, Duration::from_millis(300));
}

#[test]
fn breaker_needs_a_failure_and_an_open_period() {
    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  breaker:\n    failures: 0\n",
    ));
    let message = assert_at(&error, 11, 15, "redis.breaker.failures");
    assert_eq!(
        message,
        "`0` is not a whole number of failures of at least 1"
    );

    let error = refused(&redis_with(
        "  url: redis://127.0.0.1\n  breaker: { open_for: 0s }\n",
    ));
    let message = assert_at(&error, 10, 24, "redis.breaker.open_for");
    assert_eq!(message, "must be greater than 0");
}
