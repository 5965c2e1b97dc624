//! Reads corral's JSON log lines and picks out the access lines (target
//! `corral::access`), one per answered request.
//!
//! A small JSON reader of its own keeps serde_json out of the suite; it is
//! only ever fed single log lines and never guesses at a malformed one.

use std::collections::BTreeMap;

/// The access target corral logs one line per request under.
pub const ACCESS_TARGET: &str = "corral::access";

/// One access line, every field corral promises.
#[derive(Clone, Debug, PartialEq)]
pub struct AccessLine {
    /// Route name (`-` when no route matched).
    pub route: String,
    /// Request method.
    pub method: String,
    /// The host asked for, without port.
    pub host: String,
    /// Request path, without the query.
    pub path: String,
    /// Status answered to the client.
    pub status: u16,
    /// Cache result: hit, stale, miss, collapsed, pass or error.
    pub cache: String,
    /// The `Cache-Status` header answered.
    pub cache_status: String,
    /// Milliseconds from request to answer head.
    pub ms: f64,
    /// The connection's peer address.
    pub peer: String,
    /// The real client address (the peer unless trusted proxies say).
    pub client: String,
    /// The answer's body length, where known when its head went.
    pub bytes: Option<u64>,
    /// The origin asked for this request (host:port), if one was.
    pub upstream: Option<String>,
    /// How long it took, in milliseconds.
    pub upstream_ms: Option<f64>,
    /// The request's id, as the origin got it and the answer echoed it.
    pub request_id: String,
    /// The line as logged.
    pub raw: String,
}

impl AccessLine {
    /// `Ok(None)` for a line that is not an access line (another target, or
    /// not JSON at all); an access line lacking a promised field is an error.
    pub fn parse(line: &str) -> Result<Option<Self>, String> {
        let Some(Json::Object(fields)) = Json::parse(line) else {
            return Ok(None);
        };
        let fields: BTreeMap<String, Json> = fields.into_iter().collect();
        if fields.get("target").and_then(Json::as_str) != Some(ACCESS_TARGET) {
            return Ok(None);
        }
        let text = |name: &str| {
            fields
                .get(name)
                .and_then(Json::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("access line without a text `{name}`: {line}"))
        };
        let number = |name: &str| {
            fields
                .get(name)
                .and_then(Json::as_f64)
                .ok_or_else(|| format!("access line without a number `{name}`: {line}"))
        };
        let status = number("status")?;
        Ok(Some(Self {
            route: text("route")?,
            method: text("method")?,
            host: text("host")?,
            path: text("path")?,
            status: u16::try_from(status as i64)
                .map_err(|_| format!("access line with status {status}: {line}"))?,
            cache: text("cache")?,
            cache_status: text("cache_status")?,
            ms: number("ms")?,
            peer: text("peer")?,
            client: text("client")?,
            bytes: fields.get("bytes").and_then(Json::as_f64).map(|b| b as u64),
            upstream: fields
                .get("upstream")
                .and_then(Json::as_str)
                .map(str::to_owned),
            upstream_ms: fields.get("upstream_ms").and_then(Json::as_f64),
            request_id: text("request_id")?,
            raw: line.to_owned(),
        }))
    }
}

/// The access lines of a whole log, in order. Fails the test on an access
/// line that lacks a field.
pub fn access_lines(log: &str) -> Vec<AccessLine> {
    log.lines()
        .filter_map(|line| AccessLine::parse(line).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// The JSON log lines whose `message` is `message`, as their fields.
pub fn lines_with_message(log: &str, message: &str) -> Vec<BTreeMap<String, Json>> {
    log.lines()
        .filter_map(|line| match Json::parse(line) {
            Some(Json::Object(fields)) => Some(fields.into_iter().collect::<BTreeMap<_, _>>()),
            _ => None,
        })
        .filter(|f| f.get("message").and_then(Json::as_str) == Some(message))
        .collect()
}

/// How many occurrences `lines` (of one message) stand for: one for a
/// line of its own, `repeated` for a summary line.
pub fn occurrences(lines: &[BTreeMap<String, Json>]) -> u64 {
    lines
        .iter()
        .map(|f| {
            f.get("repeated")
                .and_then(Json::as_f64)
                .map_or(1, |n| n as u64)
        })
        .sum()
}

/// A JSON value, as much of it as log lines need.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// Any number.
    Number(f64),
    /// A string, unescaped.
    String(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, members in order.
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses one complete JSON text; `None` when it is not one.
    pub fn parse(text: &str) -> Option<Self> {
        let mut reader = Reader {
            bytes: text.as_bytes(),
            at: 0,
        };
        let value = reader.value()?;
        reader.skip_space();
        (reader.at == reader.bytes.len()).then_some(value)
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// The number, if this is one.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Number(n) => Some(*n),
            _ => None,
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.skip_space();
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &str, value: Json) -> Option<Json> {
        let end = self.at + word.len();
        (self.bytes.get(self.at..end)? == word.as_bytes()).then(|| {
            self.at = end;
            value
        })
    }

    fn value(&mut self) -> Option<Json> {
        self.skip_space();
        match self.peek()? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => self.string().map(Json::String),
            b't' => self.literal("true", Json::Bool(true)),
            b'f' => self.literal("false", Json::Bool(false)),
            b'n' => self.literal("null", Json::Null),
            _ => self.number(),
        }
    }

    fn object(&mut self) -> Option<Json> {
        self.eat(b'{')?;
        let mut members = Vec::new();
        if self.eat(b'}').is_some() {
            return Some(Json::Object(members));
        }
        loop {
            self.skip_space();
            let key = self.string()?;
            self.eat(b':')?;
            members.push((key, self.value()?));
            if self.eat(b',').is_none() {
                self.eat(b'}')?;
                return Some(Json::Object(members));
            }
        }
    }

    fn array(&mut self) -> Option<Json> {
        self.eat(b'[')?;
        let mut items = Vec::new();
        if self.eat(b']').is_some() {
            return Some(Json::Array(items));
        }
        loop {
            items.push(self.value()?);
            if self.eat(b',').is_none() {
                self.eat(b']')?;
                return Some(Json::Array(items));
            }
        }
    }

    fn number(&mut self) -> Option<Json> {
        let start = self.at;
        while matches!(
            self.peek(),
            Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
        ) {
            self.at += 1;
        }
        let text = std::str::from_utf8(&self.bytes[start..self.at]).ok()?;
        text.parse().ok().map(Json::Number)
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = std::str::from_utf8(self.bytes.get(self.at..self.at + 4)?).ok()?;
        self.at += 4;
        u32::from_str_radix(digits, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        if self.peek()? != b'"' {
            return None;
        }
        self.at += 1;
        let mut out = Vec::new();
        loop {
            let byte = self.peek()?;
            self.at += 1;
            match byte {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let escaped = self.peek()?;
                    self.at += 1;
                    let c = match escaped {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return None,
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                other => out.push(other),
            }
        }
    }

    /// After `\u`: one code point, joining a UTF-16 surrogate pair.
    fn unicode_escape(&mut self) -> Option<char> {
        let high = self.hex4()?;
        if !(0xD800..0xDC00).contains(&high) {
            return char::from_u32(high);
        }
        if self.bytes.get(self.at..self.at + 2)? != b"\\u" {
            return None;
        }
        self.at += 2;
        let low = self.hex4()?;
        if !(0xDC00..0xE000).contains(&low) {
            return None;
        }
        char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACCESS: &str = r#"{"timestamp":"2026-01-01T00:00:00Z","level":"INFO","route":"api","method":"GET","path":"/a","status":200,"cache":"hit","cache_status":"corral; hit; ttl=59","ms":0.25,"peer":"127.0.0.1","client":"198.51.100.7","host":"example.test","bytes":2,"request_id":"0123456789abcdef0000","target":"corral::access"}"#;

    #[test]
    fn an_access_line_is_read_field_by_field() {
        let line = AccessLine::parse(ACCESS)
            .expect("complete")
            .expect("an access line");
        assert_eq!(
            (
                line.route.as_str(),
                line.method.as_str(),
                line.path.as_str()
            ),
            ("api", "GET", "/a")
        );
        assert_eq!((line.status, line.cache.as_str()), (200, "hit"));
        assert_eq!(line.cache_status, "corral; hit; ttl=59");
        assert_eq!((line.ms, line.peer.as_str()), (0.25, "127.0.0.1"));
        assert_eq!(line.client, "198.51.100.7");
    }

    #[test]
    fn other_lines_are_skipped_and_incomplete_access_lines_refused() {
        let other = r#"{"level":"INFO","message":"corral serving","target":"corral","spans":[{"a":1}],"x":null,"y":true}"#;
        assert_eq!(AccessLine::parse(other), Ok(None));
        assert_eq!(AccessLine::parse("not json at all"), Ok(None));
        let partial = r#"{"route":"api","target":"corral::access"}"#;
        assert!(AccessLine::parse(partial).is_err());
        let log = format!("{other}\n{ACCESS}\nplain text\n{ACCESS}\n");
        assert_eq!(access_lines(&log).len(), 2);
    }

    #[test]
    fn strings_are_unescaped() {
        let value = Json::parse(r#"{"e":"a \"q\" \\ \u00e9 \ud83d\ude00 \n","n":-1.5e3}"#);
        assert_eq!(
            value,
            Some(Json::Object(vec![
                (
                    "e".to_owned(),
                    Json::String("a \"q\" \\ é 😀 \n".to_owned())
                ),
                ("n".to_owned(), Json::Number(-1500.0)),
            ]))
        );
        assert_eq!(Json::parse(r#"{"a":1} trailing"#), None);
        assert_eq!(Json::parse(r#"{"a":"unterminated}"#), None);
    }
}
