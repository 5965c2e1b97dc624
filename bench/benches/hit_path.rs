//! Micro-benchmarks of the hit path's pieces: building a key, normalizing
//! a Vary-selected header, and an L1 lookup of a stored entry.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use corral_core::{
    Freshness, L1, L1Config, PrimaryKey, QueryFilter, Sharing, StoredResponse, UriKey, Vary,
};
use criterion::{Criterion, criterion_group, criterion_main};
use http::header::ACCEPT_ENCODING;
use http::{HeaderMap, HeaderValue, StatusCode};

/// The primary key of a request with a query to sort and filter.
fn primary(filter: &QueryFilter) -> PrimaryKey {
    let uri = UriKey::new(
        black_box("api.example.com"),
        black_box("/v1/items/42"),
        black_box(Some("page=2&utm_source=x&sort=asc")),
        filter,
    );
    PrimaryKey::new("api", uri)
}

fn key_building(c: &mut Criterion) {
    let filter = QueryFilter::new(&["utm_*", "fbclid"]);
    c.bench_function("key/uri+primary+variant", |b| {
        b.iter(|| black_box(primary(&filter).variant(None, &[])))
    });
    // What a hit computes: L1 is looked up by the local key alone.
    c.bench_function("key/uri+primary+local", |b| {
        b.iter(|| black_box(primary(&filter).local(None, &[])))
    });
}

fn vary_normalization(c: &mut Criterion) {
    let mut h = HeaderMap::new();
    h.insert(
        ACCEPT_ENCODING,
        HeaderValue::from_static("gzip, deflate, br;q=0.9, zstd"),
    );
    let vary = Vary::Headers(vec![ACCEPT_ENCODING]);
    c.bench_function("vary/accept-encoding", |b| {
        b.iter(|| black_box(vary.values(black_box(&h))))
    });
}

fn l1_hit(c: &mut Criterion) {
    let l1 = L1::new(&L1Config { memory: 64 << 20 });
    let filter = QueryFilter::default();
    let uri = UriKey::new("h", "/hot", None, &filter);
    let key = PrimaryKey::new("r", uri.clone()).variant(None, &[]);
    let fresh = Freshness {
        ttl: Duration::from_secs(600),
        swr: Duration::ZERO,
        sie: Duration::ZERO,
        sharing: Sharing::Everyone,
    };
    let entry = StoredResponse::builder(
        StatusCode::OK,
        HeaderMap::new(),
        Bytes::from(vec![b'x'; 1024]),
        &fresh,
        SystemTime::now(),
    )
    .fetch_duration(Duration::from_millis(5))
    .generation(l1.generation_stamp())
    .build();
    l1.insert(&key, &uri, Arc::new(entry));
    c.bench_function("l1/hit-1KiB", |b| {
        b.iter(|| {
            let e = l1
                .get(black_box(key.local.as_bytes()), &uri)
                .expect("stored");
            black_box(e.state(SystemTime::now()))
        })
    });
}

criterion_group!(benches, key_building, vary_normalization, l1_hit);
criterion_main!(benches);
