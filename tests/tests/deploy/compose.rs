//! deploy/compose.yaml: Valkey, three instances, the demo origin and a bounded load.

use super::*;

#[test]
fn the_compose_file_runs_valkey_three_instances_the_origin_and_a_bounded_load() {
    let compose = compose();
    let services = &compose.services;
    let redis = services.get("redis").expect("a `redis` service");
    let image = redis.image.as_deref().unwrap_or_default();
    assert!(
        image.starts_with("valkey/valkey:") || image.starts_with("redis:"),
        "redis uses an official Valkey or Redis image, not {image}"
    );
    assert!(redis.healthcheck.is_some(), "redis has a healthcheck");

    let corrals = corral_services(&compose);
    assert_eq!(
        corrals.len(),
        3,
        "three corral instances: {:?}",
        corrals.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    let compose_config = deploy_dir().join("config").join("corral-compose.yaml");
    let config: CorralConfig = parse("corral-compose.yaml", &read(&compose_config));
    for (name, service) in &corrals {
        // The config is mounted as a directory and --config names a file in it.
        let config_path = match service.command.as_slice() {
            [_, flag, path] if flag == "--config" => path.as_str(),
            other => panic!("{name}: command is not `serve --config FILE`: {other:?}"),
        };
        let (mount_dir, file) = config_path
            .rsplit_once('/')
            .unwrap_or_else(|| panic!("{name}: --config {config_path} is not absolute"));
        let mounted = service
            .volumes
            .iter()
            .find_map(|v| {
                let mut parts = v.split(':');
                let host = parts.next()?;
                let container = parts.next()?;
                (container == mount_dir).then_some(host)
            })
            .unwrap_or_else(|| panic!("{name}: nothing mounted at {mount_dir}"));
        assert_eq!(
            deploy_dir().join(mounted).join(file),
            compose_config,
            "{name} runs the shared compose config"
        );
        let image = service.image.as_deref().unwrap_or_default();
        assert!(!image.is_empty(), "{name} names its image");
        let test = &service
            .healthcheck
            .as_ref()
            .unwrap_or_else(|| panic!("{name} has no healthcheck"))
            .test;
        let admin_port = port_of(&config.admin);
        assert!(
            test.iter().any(|t| t.ends_with(&format!(":{admin_port}")))
                && test.iter().any(|t| t == "/readyz"),
            "{name}: healthcheck probes /readyz on the admin port {admin_port}: {test:?}"
        );
        assert_eq!(service.read_only, Some(true), "{name}: read-only rootfs");
        for dependency in ["redis", "origin"] {
            let condition = service
                .depends_on
                .iter()
                .find(|(d, _)| d.starts_with(dependency))
                .map(|(_, c)| c.condition.as_str());
            assert_eq!(
                condition,
                Some("service_healthy"),
                "{name} waits for a healthy {dependency}"
            );
        }
        let grace = service.stop_grace_period.as_deref().unwrap_or_else(|| {
            panic!("{name}: no stop_grace_period (docker's 10s default is shorter than the drain)")
        });
        assert!(
            seconds(grace) > config.server.stop_seconds(),
            "{name}: stop_grace_period {grace} must exceed drain + shutdown_grace ({}s)",
            config.server.stop_seconds()
        );
    }

    // Redis and every upstream are reached by compose service name.
    let redis_host = config.redis.as_ref().map(|r| url_host(&r.url));
    assert_eq!(
        redis_host,
        Some("redis"),
        "the compose config uses redis://redis"
    );
    for route in &config.routes {
        let host = url_host(&route.upstream);
        assert!(
            services.contains_key(host),
            "upstream {} names no compose service",
            route.upstream
        );
    }
    assert!(services.contains_key("origin"), "a demo origin service");

    let load = services.get("load").expect("a `load` service");
    let z = load.command.iter().position(|a| a == "-z");
    let duration = z.and_then(|i| load.command.get(i + 1));
    assert!(
        duration.is_some_and(|d| seconds(d) <= 300.0),
        "the load is bounded with -z: {:?}",
        load.command
    );
    let target = load.command.last().map(String::as_str).unwrap_or_default();
    assert!(
        corrals.iter().any(|(n, _)| url_host(target) == n.as_str()),
        "the load targets one corral instance: {target}"
    );
    assert_eq!(
        load.depends_on
            .values()
            .next()
            .map(|c| c.condition.as_str()),
        Some("service_healthy"),
        "the load waits for a healthy corral"
    );

    // Every image built here comes from deploy/Dockerfile and a stage it has.
    let dockerfile = read(&deploy_dir().join("Dockerfile"));
    for (name, service) in services {
        if let Some(build) = &service.build {
            assert_eq!(
                deploy_dir().join(&build.context).join(&build.dockerfile),
                deploy_dir().join("..").join("deploy/Dockerfile"),
                "{name} builds deploy/Dockerfile with the repository root as context"
            );
            let target = build.target.as_deref().unwrap_or("runtime");
            assert!(
                dockerfile
                    .lines()
                    .any(|l| l.starts_with("FROM ") && l.ends_with(&format!(" AS {target}"))),
                "{name}: deploy/Dockerfile has no stage {target}"
            );
        }
    }
}

/// Every compose instance gets both tokens from a required variable (compose
/// refuses to start without it, as for the Valkey password), so the admin
/// listener on 0.0.0.0 serves the live view, `corral top` and purges; the
/// admin ports are published on the host's loopback alone; the demo origin
/// runs from an image of its own.
#[test]
fn compose_gives_every_instance_its_tokens_and_the_origin_its_own_image() {
    let compose = compose();
    let main_rs = read(&workspace_root().join("crates/corral/src/main.rs"));
    for var in TOKEN_VARS {
        assert!(
            main_rs.contains(&format!("\"{var}\"")),
            "corral no longer reads {var}: rename it here and in deploy/"
        );
    }
    let corrals = corral_services(&compose);
    assert!(!corrals.is_empty());
    for (name, service) in &corrals {
        for var in TOKEN_VARS
            .iter()
            .chain(&["CORRAL_REDIS_PASSWORD", "CORRAL_REDIS_AUTH_KEY"])
        {
            let value = service
                .environment
                .get(*var)
                .unwrap_or_else(|| panic!("{name} does not get {var}: {:?}", service.environment));
            assert!(
                value.starts_with(&format!("${{{var}:?")),
                "{name}: {var} comes from the required variable {var}, not `{value}`"
            );
        }
        assert!(!service.ports.is_empty(), "{name} publishes its ports");
        for port in &service.ports {
            assert!(
                port.starts_with("127.0.0.1:"),
                "{name} publishes {port} beyond the host's loopback"
            );
        }
    }
    let dotenv = read(&workspace_root().join(".gitignore"));
    assert!(
        dotenv.lines().any(|l| l.trim() == "deploy/.env"),
        "git ignores deploy/.env, where compose.yaml says to keep the secrets"
    );

    let origin = compose.services.get("origin").expect("an origin service");
    let build = origin.build.as_ref().expect("the origin is built here");
    assert_eq!(
        build.target.as_deref(),
        Some("demo-origin"),
        "the origin runs the Dockerfile's demo-origin stage"
    );
    for (name, service) in &compose.services {
        let from_runtime = service
            .build
            .as_ref()
            .is_some_and(|b| b.target.as_deref().unwrap_or("runtime") == "runtime");
        if from_runtime {
            assert!(
                !service.entrypoint.iter().any(|e| e.contains("demo-origin")),
                "{name} runs a demo origin from the corral image"
            );
        }
    }
}
