//! deploy/kubernetes/valkey-cluster/: the Valkey Cluster variant forms the cluster the config names.

use super::*;

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

/// The nodes the Valkey Cluster example's StatefulSet names: each pod
/// under its headless Service.
fn valkey_nodes(set: &StatefulSet) -> Vec<String> {
    (0..set.spec.replicas)
        .map(|i| format!("{}-{i}.{}", set.metadata.name, set.spec.service_name))
        .collect()
}

/// The Valkey Cluster variant's StatefulSet: six nodes that start
/// together, keep their identity (nodes.conf) on a volume, and announce the
/// names the headless Service gives them.
#[tokio::test]
async fn the_valkey_statefulset_runs_six_nodes_that_keep_and_announce_their_names() {
    // The StatefulSet and its headless Service.
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
}

/// The Job introduces exactly the StatefulSet's six nodes as three
/// primaries with a replica each (its script run against stubs).
#[tokio::test]
async fn the_job_introduces_exactly_the_statefulsets_nodes() {
    let set: StatefulSet = the_one("StatefulSet", "corral-valkey");
    let hosts = valkey_nodes(&set);
    let spec = &set.spec;
    let service: Service = the_one("Service", &spec.service_name);
    let [valkey] = spec.template.spec.containers.as_slice() else {
        panic!(
            "one container in the StatefulSet: {:?}",
            spec.template.spec.containers
        );
    };
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
}

/// The ConfigMap's commented `redis.cluster`, put in place of
/// `redis.url`, names exactly the StatefulSet's nodes on the client port and
/// passes `corral check` (while keeping url beside it is refused).
#[tokio::test]
async fn the_configmaps_cluster_names_exactly_the_statefulsets_nodes() {
    let set: StatefulSet = the_one("StatefulSet", "corral-valkey");
    let hosts = valkey_nodes(&set);
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
