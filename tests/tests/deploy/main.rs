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
//!
//! One module per artefact; this file holds what they share: the files,
//! quantities, and the parts of the corral config, Kubernetes and compose
//! schemas the checks read (lenient: fields they do not read are ignored,
//! and the schemas themselves are left to `kubernetes-validate` and
//! `hadolint`).

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

mod compose;
mod docker;
mod kubernetes;
mod monitoring;
mod parsing;
mod redis_access;
mod systemd;
mod valkey_cluster;

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

// ---------------------------------------------------------------------------
// Shared by several artefacts

/// The variables corral reads its admin listener's tokens from (main.rs):
/// the live view's and /metrics', and the purge API's.
const TOKEN_VARS: [&str; 2] = ["CORRAL_ADMIN_TOKEN", "CORRAL_PURGE_TOKEN"];

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
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
