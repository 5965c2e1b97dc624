//! deploy/kubernetes/: the manifests agree with the config they mount (probes, replicas, secrets, the Prometheus scrape job, the TLS variant); `kubernetes-validate` checks their schemas when installed.

use super::monitoring::{promtool, run_promtool};
use super::*;

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
