//! The L1 bound is in real bytes: what entries weigh is at least what they
//! take from the process. Measured as resident memory (RSS) growth while
//! L1 fills, in a process of its own (this file holds one test), so no
//! other test's allocations blur it.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use corral_core::{
    Freshness, L1, L1Config, PrimaryKey, QueryFilter, Sharing, StoredResponse, UriKey,
};
use http::{HeaderMap, HeaderValue, StatusCode};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// An entry as a fill builds one: headers copied out of a big read buffer.
fn entry(i: usize, buffer: &Bytes) -> StoredResponse {
    let mut h = HeaderMap::new();
    h.insert("cache-control", HeaderValue::from_static("max-age=600"));
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert(
        "date",
        HeaderValue::from_static("Mon, 30 Nov 2026 12:00:00 GMT"),
    );
    h.insert(
        "etag",
        HeaderValue::from_str(&format!("\"v{i}\"")).expect("etag"),
    );
    // As hyper parses them: a slice of the connection's read buffer.
    h.insert(
        "x-request-id",
        HeaderValue::from_maybe_shared(buffer.slice(0..36)).expect("slice"),
    );
    let fresh = Freshness {
        ttl: Duration::from_secs(600),
        swr: Duration::ZERO,
        sie: Duration::ZERO,
        sharing: Sharing::Everyone,
    };
    StoredResponse::builder(
        StatusCode::OK,
        h,
        Bytes::from(format!("{{\"id\":{i}}}")),
        &fresh,
        SystemTime::now(),
    )
    .fetch_duration(Duration::from_millis(3))
    .generation(1)
    .build()
    .with_uri(&format!("api.example.com/v1/items/{i}"))
}

#[test]
fn entry_weight_matches_rss() {
    const N: usize = 200_000;
    let l1 = L1::new(&L1Config { memory: 1 << 40 });
    let filter = QueryFilter::default();
    let keys: Vec<_> = (0..N)
        .map(|i| {
            let uri = UriKey::new("api.example.com", &format!("/v1/items/{i}"), None, &filter);
            let v = PrimaryKey::new("api", uri.clone()).variant(None, &[]);
            (uri, v)
        })
        .collect();
    // One 64 KiB "read buffer" per 16 entries, dropped after: an entry that
    // kept a slice of it would keep it all.
    let before = rss_bytes();
    let mut weight = 0u64;
    for (i, (uri, key)) in keys.iter().enumerate() {
        let buffer = Bytes::from(vec![b'r'; 64 * 1024]);
        let e = entry(i, &buffer);
        weight += u64::from(e.weight());
        assert!(l1.insert(key, uri, Arc::new(e)));
    }
    l1.sync();
    let grown = rss_bytes().saturating_sub(before);
    eprintln!(
        "{N} entries: RSS grew {} B/entry, weight {} B/entry",
        grown / N as u64,
        weight / N as u64
    );
    assert_eq!(l1.entry_count(), N as u64);
    assert!(
        weight >= grown,
        "entries weigh {weight} B but took {grown} B of RSS"
    );
    assert!(
        weight <= grown * 2,
        "entries weigh {weight} B for {grown} B of RSS: the bound wastes half the cache"
    );
}
