//! Whose answer is whose: credentials key entries per user unless the origin
//! marks the answer shareable, and Vary keeps variants apart.

use corral_tests::{Client, Config, Origin, Proxy, Reply};

const ALICE: (&str, &str) = ("authorization", "Bearer alice");
const BOB: (&str, &str) = ("authorization", "Bearer bob");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentialed_answers_are_stored_per_authorization() {
    let origin = Origin::new()
        .route(
            "/account",
            Reply::echo_header("user:", "authorization").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/account");

    let alice = client.get_with(&url, &[ALICE]).await;
    assert_eq!(alice.text(), "user:Bearer alice");
    let bob = client.get_with(&url, &[BOB]).await;
    assert_eq!(
        bob.text(),
        "user:Bearer bob",
        "Bob must never see Alice's answer"
    );
    assert_eq!(origin.hits("/account"), 2);

    let alice_again = client.get_with(&url, &[ALICE]).await;
    assert_eq!(alice_again.text(), "user:Bearer alice");
    assert!(
        alice_again.cache_status().is_hit(),
        "Alice's own entry serves her: {}",
        alice_again.cache_status()
    );
    assert_eq!(origin.hits("/account"), 2);

    let anonymous = client.get(&url).await;
    assert_eq!(
        anonymous.text(),
        "user:",
        "no credential, no one's private answer"
    );
    assert_eq!(origin.hits("/account"), 3);

    let seen: Vec<_> = origin
        .requests("/account")
        .iter()
        .map(|r| r.header("authorization").map(str::to_owned))
        .collect();
    assert_eq!(
        seen,
        [
            Some("Bearer alice".to_owned()),
            Some("Bearer bob".to_owned()),
            None
        ],
        "Authorization is forwarded to the origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicitly_shareable_answers_to_credentialed_requests_are_shared() {
    let origin = Origin::new()
        .route(
            "/public",
            Reply::echo_header("user:", "authorization")
                .header("cache-control", "public, max-age=60"),
        )
        .route(
            "/s-maxage",
            Reply::echo_header("user:", "authorization").header("cache-control", "s-maxage=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    for path in ["/public", "/s-maxage"] {
        let url = proxy.url(path);
        let alice = client.get_with(&url, &[ALICE]).await;
        assert_eq!(alice.text(), "user:Bearer alice", "{path}");
        let bob = client.get_with(&url, &[BOB]).await;
        assert_eq!(
            bob.text(),
            "user:Bearer alice",
            "{path}: the stored answer is shared"
        );
        assert!(
            bob.cache_status().is_hit(),
            "{path}: {}",
            bob.cache_status()
        );
        assert_eq!(origin.hits(path), 1, "{path}");
    }
}

/// A route without `compression:` reads Accept-Encoding as gzip or
/// nothing: a caller that accepts gzip and one that does not are two
/// variants, and the origin is asked with `gzip` or with no field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_accept_encoding_stores_each_encoding_apart() {
    let origin = Origin::new()
        .route(
            "/enc",
            Reply::echo_header("enc:", "accept-encoding")
                .header("cache-control", "max-age=60")
                .header("vary", "Accept-Encoding"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/enc");

    let gzip = client.get_with(&url, &[("accept-encoding", "gzip")]).await;
    assert_eq!(gzip.text(), "enc:gzip");
    let br = client.get_with(&url, &[("accept-encoding", "br")]).await;
    assert_eq!(br.text(), "enc:");
    assert_eq!(origin.hits("/enc"), 2);

    let gzip_again = client.get_with(&url, &[("accept-encoding", "gzip")]).await;
    assert_eq!(gzip_again.text(), "enc:gzip");
    assert!(
        gzip_again.cache_status().is_hit(),
        "{}",
        gzip_again.cache_status()
    );
    let br_again = client.get_with(&url, &[("accept-encoding", "br")]).await;
    assert_eq!(br_again.text(), "enc:");
    assert!(
        br_again.cache_status().is_hit(),
        "{}",
        br_again.cache_status()
    );
    assert_eq!(origin.hits("/enc"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_accept_encoding_lists_share_one_variant() {
    let origin = Origin::new()
        .route(
            "/enc",
            Reply::echo_header("enc:", "accept-encoding")
                .header("cache-control", "max-age=60")
                .header("vary", "Accept-Encoding"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/enc");

    let first = client
        .get_with(&url, &[("accept-encoding", "gzip, br")])
        .await;
    assert_eq!(first.text(), "enc:gzip");
    let second = client
        .get_with(&url, &[("accept-encoding", "br,gzip")])
        .await;
    assert_eq!(second.text(), "enc:gzip");
    assert!(second.cache_status().is_hit(), "{}", second.cache_status());
    assert_eq!(origin.hits("/enc"), 1);
}
