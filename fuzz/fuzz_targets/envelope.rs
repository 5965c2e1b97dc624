//! Arbitrary bytes as a value read from the shared L2 (Redis) into
//! `envelope::decode`, which must refuse what it cannot read and never
//! panic. Whatever decodes must survive encode and decode again with the
//! same status, headers, body, Vary, Vary values, flags and times, and
//! encode to the same bytes the second time (the encoding is stable).
#![no_main]

use corral_core::StoredResponse;
use corral_core::wire::envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(first) = envelope::decode(data, 1) else {
        return;
    };
    let bytes = envelope::encode(&first);
    assert!(!bytes.is_empty(), "a decoded entry is representable");
    let second = envelope::decode(&bytes, 2).expect("a re-encoded entry decodes");
    same(&first, &second);
    assert_eq!(second.generation(), 2);
    assert_eq!(envelope::encode(&second), bytes, "the encoding is stable");
});

fn same(a: &StoredResponse, b: &StoredResponse) {
    assert_eq!(a.status(), b.status());
    assert_eq!(a.headers(), b.headers());
    assert_eq!(a.body(), b.body());
    assert_eq!(a.vary(), b.vary());
    assert_eq!(a.vary_values(), b.vary_values());
    assert_eq!(a.private(), b.private());
    assert_eq!(a.sharing(), b.sharing());
    assert_eq!(a.initial_age(), b.initial_age());
    assert_eq!(a.response_time(), b.response_time());
    assert_eq!(a.fresh_until(), b.fresh_until());
    assert_eq!(a.swr(), b.swr());
    assert_eq!(a.sie(), b.sie());
    assert_eq!(a.fetch_duration(), b.fetch_duration());
}
