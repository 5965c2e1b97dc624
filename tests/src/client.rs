//! HTTP/1.1 clients aimed at the proxy: single requests and concurrent bursts.
//!
//! Answers are read whole so tests can compare bodies; transport errors fail
//! the test with the URL in the message.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};

use crate::cache_status::CacheStatus;
use crate::fd_limit::ensure_open_files;

/// How long one request may take end to end.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// One answer, read whole.
#[derive(Clone, Debug)]
pub struct Answer {
    /// Status code.
    pub status: StatusCode,
    /// Response headers.
    pub headers: HeaderMap,
    /// Response body.
    pub body: Bytes,
}

impl Answer {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The first value of header `name` as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The parsed `Cache-Status` (empty when absent): every line of it, as
    /// one list (the caches before corral may have written their own).
    pub fn cache_status(&self) -> CacheStatus {
        CacheStatus::parse(&self.members("cache-status").join(", "))
    }

    /// The members of the list field `name`, over all its lines, in order
    /// (split at every comma: for fields whose members quote none).
    pub fn members(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|m| m.trim().to_owned())
            .filter(|m| !m.is_empty())
            .collect()
    }
}

/// A pooled HTTP/1.1 client that can hold a thousand connections at once.
#[derive(Clone, Debug)]
pub struct Client {
    inner: reqwest::Client,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl Client {
    /// HTTP/1.1 only, no system proxy, an unbounded idle pool.
    pub fn new() -> Self {
        ensure_open_files(8192);
        let inner = reqwest::Client::builder()
            .http1_only()
            .no_proxy()
            .pool_max_idle_per_host(usize::MAX)
            .pool_idle_timeout(Duration::from_secs(60))
            .timeout(REQUEST_TIMEOUT)
            .build()
            .expect("build the reqwest client");
        Self { inner }
    }

    /// [`Client::new`] whose connections come from `source`, a loopback
    /// address of its own (`127.0.0.2`, …): a caller corral tells apart from
    /// the others (Linux answers every 127/8 address on `lo`).
    pub fn from_address(source: std::net::Ipv4Addr) -> Self {
        assert!(source.is_loopback(), "only loopback sources: {source}");
        ensure_open_files(8192);
        let inner = reqwest::Client::builder()
            .http1_only()
            .no_proxy()
            .local_address(std::net::IpAddr::V4(source))
            .timeout(REQUEST_TIMEOUT)
            .build()
            .expect("build the reqwest client");
        Self { inner }
    }

    /// The underlying reqwest client, for requests the helpers don't cover.
    pub fn inner(&self) -> &reqwest::Client {
        &self.inner
    }

    /// GET `url`.
    pub async fn get(&self, url: &str) -> Answer {
        self.send(Method::GET, url, &[], None).await
    }

    /// GET `url` with extra request headers.
    pub async fn get_with(&self, url: &str, headers: &[(&str, &str)]) -> Answer {
        self.send(Method::GET, url, headers, None).await
    }

    /// HEAD `url`.
    pub async fn head(&self, url: &str) -> Answer {
        self.send(Method::HEAD, url, &[], None).await
    }

    /// Any request; fails the test on a transport error.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<Bytes>,
    ) -> Answer {
        self.try_send(method.clone(), url, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e:#}"))
    }

    /// Any request; transport errors are returned.
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<Bytes>,
    ) -> anyhow::Result<Answer> {
        let mut request = self.inner.request(method, url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request.send().await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Answer {
            status,
            headers,
            body,
        })
    }

    /// `n` concurrent GETs of `url` (each in its own task, so they run in
    /// parallel on the runtime), answers in issue order. Any transport error
    /// fails the test once, with how many requests failed and the first error.
    pub async fn burst(&self, n: usize, url: &str, headers: &[(&str, &str)]) -> Vec<Answer> {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let client = self.clone();
                let url = url.to_owned();
                let headers = headers.clone();
                tokio::spawn(async move {
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    client.try_send(Method::GET, &url, &headers, None).await
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(n);
        let mut failures = Vec::new();
        for task in tasks {
            match task.await {
                Ok(Ok(answer)) => answers.push(answer),
                Ok(Err(e)) => failures.push(format!("{e:#}")),
                Err(e) => failures.push(format!("request task failed: {e}")),
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {n} GETs of {url} failed; first: {}",
            failures.len(),
            failures[0]
        );
        answers
    }

    /// Opens `n` pooled connections to the host of `url` by holding `n`
    /// requests open at once; `url` must be slow enough (a delayed origin
    /// route) that none completes before the last one is sent. A following
    /// burst then goes out on ready connections, so its requests reach the
    /// proxy together instead of trickling in behind a thousand handshakes.
    pub async fn warm(&self, n: usize, url: &str) {
        for answer in self.burst(n, url, &[]).await {
            assert!(
                answer.status.is_success(),
                "warm-up GET {url} answered {}",
                answer.status
            );
        }
    }
}

/// Distinct status + Cache-Status values and how often each came back: the
/// shape of a burst, for assertion messages.
pub fn tally<'a>(
    answers: impl IntoIterator<Item = &'a Answer>,
) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for answer in answers {
        *counts
            .entry(format!(
                "{} {}",
                answer.status,
                answer.header("cache-status").unwrap_or("<no cache-status>")
            ))
            .or_insert(0) += 1;
    }
    counts
}

/// Asserts that every answer has `status` and `body`; a failure shows the
/// tally of the whole burst.
pub fn assert_every_answer<'a>(
    answers: impl IntoIterator<Item = &'a Answer> + Clone,
    status: u16,
    body: &str,
) {
    for answer in answers.clone() {
        assert_eq!(
            answer.status,
            status,
            "answers: {:#?}",
            tally(answers.clone())
        );
        assert_eq!(
            answer.text(),
            body,
            "answers: {:#?}",
            tally(answers.clone())
        );
    }
}
