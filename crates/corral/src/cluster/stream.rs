//! A fill's body relayed to the instances waiting on its lease, through one
//! Redis stream per fill ([`Keys::stream`]: the entry's variant and the
//! lease's value). The holder appends its answer's head, its body in
//! chunks of [`CHUNK`] or more, and an end (the whole body's length and
//! BLAKE3) or an abort; a waiting instance reads it with `XREAD BLOCK` on a
//! connection of its own (a blocked read would hold up every command behind
//! it on the shared multiplexed one), [`COUNT`] parts a round trip.
//!
//! Every part is sealed with the fleet's key over the stream's name and
//! its sequence number: a part that does not verify, comes out of order or
//! leaves a gap ends the read with [`Broken`], and nothing of it reaches a
//! caller. The holder relays only when some instance has said it reads
//! ([`Keys::stream_readers`]), so a fill nobody waits on elsewhere costs
//! Redis nothing here. Never used on a Cluster (there is no node client to
//! read with): its waiters read the whole entry from L2 as before.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use corral_core::StoredResponse;
use corral_core::callers::peer_auth::Record;
use corral_core::wire::envelope;
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};

use crate::cluster::protocol::{Keys, millis};
use crate::cluster::redis_link::{L2Error, RedisLink, arg};
use crate::cluster::trust::Trust;

/// The least body the holder appends at once (unless the body ends, or
/// [`FLUSH_EVERY`] passed since its last append): Redis commands per fill
/// grow with the body's size over this, not with its chunks on the wire.
pub const CHUNK: usize = 64 * 1024;

/// How long the holder keeps less than [`CHUNK`] before appending it
/// anyway (the first bytes go at once).
pub const FLUSH_EVERY: Duration = Duration::from_millis(250);

/// Parts a waiting instance reads in one round trip.
pub const COUNT: usize = 64;

/// How long a stream lives after its last part: long enough for a waiter
/// to read it, short enough that it is no second copy of L2.
pub const STREAM_TTL: Duration = Duration::from_secs(10);

/// How many streams this instance reads at once (each on a connection of
/// its own); a fill beyond them waits for the entry, as without streams.
pub const MAX_READS: usize = 32;

/// A waiter says it reads the stream of the lease now held; returns the
/// lease's value (nil when it is free). KEYS: lease, readers. ARGV: PX.
static JOIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local v = redis.call('GET', KEYS[1])
if not v then return false end
redis.call('SET', KEYS[2], v, 'PX', ARGV[1])
return v",
    )
});

/// The holder opens its stream with the head, only if some waiter reads
/// its lease's stream. KEYS: readers, stream. ARGV: lease value, sealed
/// head, PX. Returns 1 when opened.
static OPEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('XADD', KEYS[2], '*', 'p', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1",
    )
});

/// Appends one sealed part. KEYS: stream. ARGV: sealed part, PX.
static APPEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"redis.call('XADD', KEYS[1], '*', 'p', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1",
    )
});

/// One part of a relayed body, in order: `Head`, `Data`…, then `End` or
/// `Abort`.
#[derive(Debug, Clone)]
pub enum Part {
    /// The answer's head (an entry without its body) and its declared
    /// length, if it has one.
    Head {
        head: Box<StoredResponse>,
        len: Option<u64>,
    },
    Data(Bytes),
    /// The body arrived whole: its length and BLAKE3.
    End {
        len: u64,
        digest: [u8; 32],
    },
    /// The body will not arrive whole: every reader's answer is cut.
    Abort,
}

const HEAD: u8 = 0;
const DATA: u8 = 1;
const END: u8 = 2;
const ABORT: u8 = 3;

/// Why a relayed body cannot be read on.
#[derive(Debug, thiserror::Error)]
pub enum Broken {
    #[error("a stream part does not verify")]
    Forged,
    #[error("a stream part is out of order or missing (expected {expected}, got {got})")]
    OutOfOrder { expected: u64, got: u64 },
    #[error("a stream part is malformed")]
    Malformed,
    #[error("the stream read failed: {0}")]
    Read(String),
}

/// This instance's streams: the link the holder appends through, the
/// connections waiters block on.
pub struct Streams {
    link: Arc<RedisLink>,
    trust: Arc<Trust>,
    idle: Mutex<Vec<MultiplexedConnection>>,
    reading: AtomicUsize,
}

impl Streams {
    pub fn new(link: Arc<RedisLink>, trust: Arc<Trust>) -> Arc<Self> {
        Arc::new(Streams {
            link,
            trust,
            idle: Mutex::new(Vec::new()),
            reading: AtomicUsize::new(0),
        })
    }

    /// The holder's end of the stream of `lease` (its value).
    pub fn writer(self: &Arc<Self>, keys: &Keys, lease: &str) -> StreamWriter {
        StreamWriter {
            streams: Arc::clone(self),
            readers: keys.stream_readers(),
            key: keys.stream(lease),
            lease: lease.to_owned(),
            seq: 0,
        }
    }

    /// A waiter's read of the stream of the lease held now; `None` when
    /// the lease is free, on a Cluster, when [`MAX_READS`] are under way,
    /// or when Redis does not answer (the waiter then reads L2 as before).
    pub async fn reader(self: &Arc<Self>, keys: &Keys, stamp: u64) -> Option<StreamReader> {
        if self.link.is_cluster() || self.link.unavailable_for(&keys.lease()) {
            return None;
        }
        let slot = ReadSlot::take(self)?;
        let lease: Option<String> = self
            .link
            .script(
                &JOIN,
                &[&keys.lease(), &keys.stream_readers()],
                &[arg(millis(STREAM_TTL))],
            )
            .await
            .ok()?;
        let lease = lease?;
        let conn = self.connection().await?;
        Some(StreamReader {
            key: keys.stream(&lease),
            lease,
            conn: Some(conn),
            last_id: "0-0".to_owned(),
            next_seq: 0,
            stamp,
            _slot: slot,
        })
    }

    /// An idle reading connection, or a new one.
    async fn connection(&self) -> Option<MultiplexedConnection> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        if idle.is_some() {
            return idle;
        }
        let client = self.link.node_client()?;
        // The read blocks on the server for as long as it asks; the
        // client's own deadline is the caller's (see `StreamReader::next`).
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(self.link.connect_timeout()));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .ok()
    }

    fn seal(&self, key: &str, seq: u64, part: &Part) -> Option<Vec<u8>> {
        let mut record = Vec::with_capacity(16);
        record.extend_from_slice(&seq.to_be_bytes());
        match part {
            Part::Head { head, len } => {
                let env = envelope::encode_shifted(head, self.link.clock_shift());
                if env.is_empty() {
                    return None;
                }
                record.push(HEAD);
                record.push(u8::from(len.is_some()));
                record.extend_from_slice(&len.unwrap_or(0).to_be_bytes());
                record.extend_from_slice(&env);
            }
            Part::Data(bytes) => {
                record.push(DATA);
                record.extend_from_slice(bytes);
            }
            Part::End { len, digest } => {
                record.push(END);
                record.extend_from_slice(&len.to_be_bytes());
                record.extend_from_slice(digest);
            }
            Part::Abort => record.push(ABORT),
        }
        Some(self.trust.seal(Record::StreamPart, key, &record))
    }

    /// The part sealed under `key` as `seq`, once its tag verifies.
    fn open(&self, key: &str, seq: u64, sealed: &[u8], stamp: u64) -> Result<Part, Broken> {
        let record = self
            .trust
            .open(Record::StreamPart, key, sealed)
            .ok_or(Broken::Forged)?;
        let (got, rest) = record.split_at_checked(8).ok_or(Broken::Malformed)?;
        let got = u64::from_be_bytes(got.try_into().map_err(|_| Broken::Malformed)?);
        if got != seq {
            return Err(Broken::OutOfOrder { expected: seq, got });
        }
        let (&kind, payload) = rest.split_first().ok_or(Broken::Malformed)?;
        let u64_at = |b: &[u8]| -> Result<u64, Broken> {
            Ok(u64::from_be_bytes(
                b.get(..8)
                    .ok_or(Broken::Malformed)?
                    .try_into()
                    .map_err(|_| Broken::Malformed)?,
            ))
        };
        match kind {
            HEAD if payload.len() > 9 => {
                let len = (payload[0] == 1)
                    .then(|| u64_at(&payload[1..]))
                    .transpose()?;
                let head = envelope::decode_shifted(&payload[9..], stamp, self.link.clock_shift())
                    .map_err(|_| Broken::Malformed)?;
                Ok(Part::Head {
                    head: Box::new(head),
                    len,
                })
            }
            DATA => Ok(Part::Data(Bytes::copy_from_slice(payload))),
            END if payload.len() == 40 => Ok(Part::End {
                len: u64_at(payload)?,
                digest: payload[8..].try_into().map_err(|_| Broken::Malformed)?,
            }),
            ABORT => Ok(Part::Abort),
            _ => Err(Broken::Malformed),
        }
    }
}

/// One of the [`MAX_READS`] reads under way.
struct ReadSlot(Arc<Streams>);

impl ReadSlot {
    fn take(streams: &Arc<Streams>) -> Option<Self> {
        let taken = streams
            .reading
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_READS).then_some(n + 1)
            });
        taken.ok().map(|_| ReadSlot(Arc::clone(streams)))
    }
}

impl Drop for ReadSlot {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The holder's end: parts sealed with their sequence numbers, in order.
pub struct StreamWriter {
    streams: Arc<Streams>,
    readers: String,
    key: String,
    lease: String,
    seq: u64,
}

impl StreamWriter {
    /// Opens the stream with the head if some instance reads it; `false`
    /// when none does (yet).
    pub async fn offer(
        &mut self,
        head: &StoredResponse,
        len: Option<u64>,
    ) -> Result<bool, L2Error> {
        let part = Part::Head {
            head: Box::new(head.clone()),
            len,
        };
        let Some(sealed) = self.streams.seal(&self.key, 0, &part) else {
            return Ok(false);
        };
        let opened: i64 = self
            .streams
            .link
            .script(
                &OPEN,
                &[&self.readers, &self.key],
                &[arg(&self.lease), sealed, arg(millis(STREAM_TTL))],
            )
            .await?;
        if opened == 1 {
            self.seq = 1;
        }
        Ok(opened == 1)
    }

    /// Appends `part` after those before it.
    pub async fn append(&mut self, part: &Part) -> Result<(), L2Error> {
        let Some(sealed) = self.streams.seal(&self.key, self.seq, part) else {
            return Ok(());
        };
        self.streams
            .link
            .script::<i64>(&APPEND, &[&self.key], &[sealed, arg(millis(STREAM_TTL))])
            .await?;
        self.seq += 1;
        Ok(())
    }
}

/// A waiter's read of one stream, on a connection of its own.
pub struct StreamReader {
    key: String,
    lease: String,
    conn: Option<MultiplexedConnection>,
    last_id: String,
    next_seq: u64,
    stamp: u64,
    _slot: ReadSlot,
}

impl StreamReader {
    /// The lease value whose stream this is.
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// The next parts, verified and in order: empty when `block` passed
    /// with nothing new.
    pub async fn next(&mut self, block: Duration) -> Result<Vec<Part>, Broken> {
        let mut conn = self
            .conn
            .take()
            .ok_or(Broken::Read("no connection".into()))?;
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(COUNT)
            .arg("BLOCK")
            .arg(millis(block).max(1))
            .arg("STREAMS")
            .arg(&self.key)
            .arg(&self.last_id);
        // A read the server never answers leaves the connection in doubt:
        // it is dropped, not reused.
        let deadline = block + self.slot_streams().link.connect_timeout();
        let answer = tokio::time::timeout(deadline, cmd.query_async::<Value>(&mut conn))
            .await
            .map_err(|_| Broken::Read("no answer".into()))?
            .map_err(|e| Broken::Read(e.to_string()))?;
        self.conn = Some(conn);
        let mut parts = Vec::new();
        for (id, sealed) in entries(&answer) {
            let part = self
                .slot_streams()
                .open(&self.key, self.next_seq, &sealed, self.stamp)?;
            self.next_seq += 1;
            self.last_id = id;
            parts.push(part);
        }
        Ok(parts)
    }

    fn slot_streams(&self) -> &Arc<Streams> {
        &self._slot.0
    }
}

impl Drop for StreamReader {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            let mut idle = self
                .slot_streams()
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if idle.len() < MAX_READS {
                idle.push(conn);
            }
        }
    }
}

/// The (id, field value) of each entry of an `XREAD` answer for one
/// stream, RESP2 or RESP3; a malformed one is skipped (and then the next
/// part's sequence number does not match: the read breaks).
fn entries(answer: &Value) -> Vec<(String, Vec<u8>)> {
    let streams: Vec<&Value> = match answer {
        Value::Array(s) => s.iter().collect(),
        Value::Map(m) => m.iter().map(|(_, v)| v).collect(),
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    for stream in streams {
        let list = match stream {
            Value::Array(kv) if kv.len() == 2 => &kv[1],
            other => other,
        };
        let Value::Array(items) = list else { continue };
        for item in items {
            let Value::Array(pair) = item else { continue };
            let (Some(id), Some(Value::Array(fields))) = (pair.first(), pair.get(1)) else {
                continue;
            };
            let id = match id {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => continue,
            };
            if let Some(Value::BulkString(v)) = fields.get(1) {
                out.push((id, v.clone()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(b: &[u8]) -> Value {
        Value::BulkString(b.to_vec())
    }

    #[test]
    fn entries_are_read_from_either_protocol() {
        let entry = Value::Array(vec![
            bulk(b"1-0"),
            Value::Array(vec![bulk(b"p"), bulk(b"sealed")]),
        ]);
        let resp2 = Value::Array(vec![Value::Array(vec![
            bulk(b"k"),
            Value::Array(vec![entry.clone()]),
        ])]);
        let resp3 = Value::Map(vec![(bulk(b"k"), Value::Array(vec![entry]))]);
        for answer in [resp2, resp3] {
            assert_eq!(
                entries(&answer),
                vec![("1-0".to_owned(), b"sealed".to_vec())]
            );
        }
        assert!(entries(&Value::Nil).is_empty());
    }
}
