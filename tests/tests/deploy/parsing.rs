//! Every YAML file under deploy/ parses, and every corral config deploy/ ships or mounts passes `corral check`.

use super::*;

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
