//! `server.runtime: per_core`: one thread per worker, each accepting on
//! its own socket of the same address (SO_REUSEPORT) and serving its
//! connections start to end. The workers share one cache, one set of
//! flights and one connection limit: a cold key still reaches the origin
//! once whichever workers its callers landed on, and SIGTERM drains every
//! worker.

use std::time::Duration;

use http::Method;

use corral_tests::lifecycle::{scrape, send_signal, wait_for_exit, wait_for_log};
use corral_tests::{
    Client, Config, DEADLINE, Exit, Origin, Proxy, Reply, Signal, assert_every_answer, tally,
};

const WORKERS: &str = "corral_worker_connections_total";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn per_core(origin_url: String) -> Config {
    Config::single(origin_url)
        .server("runtime", "per_core")
        .server("workers", "2")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_share_one_cache_and_one_flight() {
    const CALLERS: usize = 100;
    let origin = Origin::new()
        .route(
            "/cold",
            Reply::ok("the one answer")
                .header("cache-control", "max-age=60")
                .delay(ms(300)),
        )
        .start()
        .await;
    let proxy = Proxy::new(per_core(origin.url())).start().await;
    let before = scrape(&proxy).await;
    for worker in ["0", "1"] {
        assert_eq!(
            before.value(WORKERS, &[("worker", worker)]),
            Some(0.0),
            "worker {worker} is registered at 0"
        );
    }

    // Every caller on a connection of its own: the kernel spreads them over
    // the two workers' sockets.
    let answers = futures_util::future::join_all((0..CALLERS).map(|_| {
        let url = proxy.url("/cold");
        async move { Client::new().try_send(Method::GET, &url, &[], None).await }
    }))
    .await;
    let answers: Vec<_> = answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|e| panic!("GET /cold: {e:#}")))
        .collect();
    assert_eq!(origin.hits("/cold"), 1, "{:#?}", tally(&answers));
    assert_every_answer(&answers, 200, "the one answer");

    let after = scrape(&proxy).await;
    let per_worker: Vec<f64> = ["0", "1"]
        .iter()
        .map(|w| after.value(WORKERS, &[("worker", w)]).unwrap_or(0.0))
        .collect();
    // 100 connections plus the scrapes' own (on the admin listener, not
    // counted): each worker took some, together all of them.
    assert_eq!(
        per_worker.iter().sum::<f64>(),
        CALLERS as f64,
        "{per_worker:?}"
    );
    assert!(
        per_worker.iter().all(|n| *n > 0.0),
        "both workers accepted: {per_worker:?}"
    );
    // Later callers, on either worker, are answered from the one cache.
    let again = futures_util::future::join_all((0..20).map(|_| {
        let url = proxy.url("/cold");
        async move { Client::new().get(&url).await }
    }))
    .await;
    assert!(
        again.iter().all(|a| a.cache_status().is_hit()),
        "{:#?}",
        tally(&again)
    );
    assert_eq!(origin.hits("/cold"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_every_worker() {
    const IN_FLIGHT: usize = 6;
    let origin = Origin::new()
        .route("/slow", Reply::ok("slow body").delay(ms(1000)))
        .start()
        .await;
    let config = per_core(origin.url())
        .server("drain_period", "200ms")
        .server("shutdown_grace", "5s");
    let mut proxy = Proxy::new(config).start().await;
    // Distinct keys on connections of their own, so both workers hold some.
    let in_flight: Vec<_> = (0..IN_FLIGHT)
        .map(|i| {
            let url = proxy.url(&format!("/slow?n={i}"));
            tokio::spawn(async move { Client::new().try_send(Method::GET, &url, &[], None).await })
        })
        .collect();
    origin.wait_hits("/slow", IN_FLIGHT, DEADLINE).await;
    send_signal(&proxy, Signal::Term);
    wait_for_log(&proxy, "no longer accepting connections", DEADLINE).await;
    for (i, task) in in_flight.into_iter().enumerate() {
        let answer = task
            .await
            .expect("request task")
            .unwrap_or_else(|e| panic!("in-flight GET /slow?n={i} failed during the drain: {e:#}"));
        assert_eq!(
            (answer.status.as_u16(), answer.text().as_str()),
            (200, "slow body")
        );
    }
    let exit = wait_for_exit(&mut proxy, DEADLINE).await;
    assert_eq!(exit, Exit::Code(0), "{}", proxy.report());
    assert_eq!(origin.answered("/slow"), [200; IN_FLIGHT]);
    assert!(
        !proxy.log().contains("shutdown grace elapsed"),
        "{}",
        proxy.report()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_serves_the_tls_listener_too() {
    use corral_tests::temp::TempDir;
    use corral_tests::tls::{Pki, tls_get};
    let dir = TempDir::new("corral-per-core-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let cert = pki.issue("listener", &["corral.test"], false);
    let origin = Origin::new()
        .route("/hello", Reply::ok("hello"))
        .start()
        .await;
    let addr = corral_tests::ports::free_addr_for_config().expect("free port");
    let proxy = Proxy::new(per_core(origin.url()).top("listen_tls", &cert.listen_tls(addr)))
        .start()
        .await;
    let ca = pki.ca_file("ca");
    for _ in 0..20 {
        let answer = tls_get(addr, &ca, "corral.test", &[b"h2", b"http/1.1"], "/hello")
            .await
            .expect("a TLS request");
        assert_eq!((answer.status, answer.body.as_str()), (200, "hello"));
    }
    let metrics = scrape(&proxy).await;
    let per_worker: Vec<f64> = ["0", "1"]
        .iter()
        .map(|w| metrics.value(WORKERS, &[("worker", w)]).unwrap_or(0.0))
        .collect();
    assert_eq!(per_worker.iter().sum::<f64>(), 20.0, "{per_worker:?}");
    assert!(per_worker.iter().all(|n| *n > 0.0), "{per_worker:?}");
}
