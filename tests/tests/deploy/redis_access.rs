//! Redis is closed: a password and ACL, a network policy, and the key the instances authenticate each other's records with.

use super::*;

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
