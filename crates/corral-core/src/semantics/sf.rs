//! The parts of RFC 8941 Structured Field Values that corral reads from
//! origins: Dictionaries whose members are bare items or inner lists, with
//! parameters parsed and ignored. `digest` reads Byte Sequences with it,
//! `no_vary_search` Booleans and inner lists of Strings. Every function
//! returns `None` on input that is not valid, and never panics on any
//! input.

use base64::Engine;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};

/// RFC 8941 §4.2.7: a parser should not fail on missing `=` padding.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// One bare item, as far as corral tells them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Item {
    Boolean(bool),
    String(Vec<u8>),
    ByteSequence(Vec<u8>),
    /// An Integer, Decimal or Token: valid, and of no use to corral.
    Other,
}

/// A Dictionary member's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Member {
    Item(Item),
    InnerList(Vec<Item>),
}

/// A field's lines joined as RFC 9110 §5.3 combines them.
pub(crate) fn joined<'a>(lines: impl Iterator<Item = &'a http::HeaderValue>) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut any = false;
    for (i, v) in lines.enumerate() {
        any = true;
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
    any.then_some(out)
}

/// `raw` as a Dictionary, in order, the last of a repeated key standing in
/// the first one's place (RFC 8941 §4.2.2). `None`: not a Dictionary.
pub(crate) fn dictionary(raw: &[u8]) -> Option<Vec<(String, Member)>> {
    let mut p = Parser { s: raw, at: 0 };
    let mut members: Vec<(String, Member)> = Vec::new();
    p.spaces();
    if p.at == raw.len() {
        return Some(members);
    }
    loop {
        let key = p.key()?;
        let value = if p.peek() == Some(b'=') {
            p.at += 1;
            if p.peek() == Some(b'(') {
                Member::InnerList(p.inner_list()?)
            } else {
                Member::Item(p.bare_item()?)
            }
        } else {
            Member::Item(Item::Boolean(true))
        };
        p.parameters()?;
        match members.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => members.push((key, value)),
        }
        p.ows();
        if p.at == raw.len() {
            return Some(members);
        }
        p.expect(b',')?;
        p.ows();
        if p.at == raw.len() {
            // A trailing comma.
            return None;
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn spaces(&mut self) {
        while self.peek() == Some(b' ') {
            self.at += 1;
        }
    }

    fn ows(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.at += 1;
        }
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        (self.peek() == Some(b)).then(|| self.at += 1)
    }

    /// `key = ( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )`
    fn key(&mut self) -> Option<String> {
        let start = self.at;
        match self.peek() {
            Some(b'a'..=b'z' | b'*') => self.at += 1,
            _ => return None,
        }
        while matches!(
            self.peek(),
            Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*')
        ) {
            self.at += 1;
        }
        std::str::from_utf8(&self.s[start..self.at])
            .ok()
            .map(str::to_owned)
    }

    /// `"(" *SP [ item *( 1*SP item ) *SP ] ")"`, each item with its
    /// parameters (skipped).
    fn inner_list(&mut self) -> Option<Vec<Item>> {
        self.expect(b'(')?;
        let mut items = Vec::new();
        loop {
            self.spaces();
            if self.peek() == Some(b')') {
                self.at += 1;
                return Some(items);
            }
            items.push(self.bare_item()?);
            self.parameters()?;
            // Items are separated by at least one space.
            if !matches!(self.peek(), Some(b' ' | b')')) {
                return None;
            }
        }
    }

    /// `*( ";" *SP key [ "=" bare-item ] )`, skipped.
    fn parameters(&mut self) -> Option<()> {
        while self.peek() == Some(b';') {
            self.at += 1;
            self.spaces();
            self.key()?;
            if self.peek() == Some(b'=') {
                self.at += 1;
                self.bare_item()?;
            }
        }
        Some(())
    }

    fn bare_item(&mut self) -> Option<Item> {
        match self.peek()? {
            b'"' => self.string().map(Item::String),
            b':' => self.byte_sequence().map(Item::ByteSequence),
            b'?' => {
                self.at += 1;
                let b = match self.peek()? {
                    b'0' => false,
                    b'1' => true,
                    _ => return None,
                };
                self.at += 1;
                Some(Item::Boolean(b))
            }
            b'-' | b'0'..=b'9' => {
                self.at += 1;
                while matches!(self.peek(), Some(b'0'..=b'9' | b'.')) {
                    self.at += 1;
                }
                Some(Item::Other)
            }
            b'A'..=b'Z' | b'a'..=b'z' | b'*' => {
                self.at += 1;
                while self
                    .peek()
                    .is_some_and(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b))
                {
                    self.at += 1;
                }
                Some(Item::Other)
            }
            _ => None,
        }
    }

    /// `DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE`, unescaped.
    fn string(&mut self) -> Option<Vec<u8>> {
        self.expect(b'"')?;
        let mut out = Vec::new();
        loop {
            match self.peek()? {
                b'\\' => {
                    self.at += 1;
                    let c = self.peek()?;
                    if !matches!(c, b'"' | b'\\') {
                        return None;
                    }
                    out.push(c);
                    self.at += 1;
                }
                b'"' => {
                    self.at += 1;
                    return Some(out);
                }
                c @ 0x20..=0x7e => {
                    out.push(c);
                    self.at += 1;
                }
                _ => return None,
            }
        }
    }

    /// `":" *( ALPHA / DIGIT / "+" / "/" / "=" ) ":"`, decoded.
    fn byte_sequence(&mut self) -> Option<Vec<u8>> {
        self.expect(b':')?;
        let start = self.at;
        while matches!(
            self.peek(),
            Some(b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' | b'=')
        ) {
            self.at += 1;
        }
        let encoded = &self.s[start..self.at];
        self.expect(b':')?;
        BASE64.decode(encoded).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionaries_parse_as_rfc_8941_says() {
        let d = dictionary(br#"a, b=?0, c=("x" "y\"z";p=1);q, d=:AQI=:, e=12.5, f=tok"#)
            .expect("a dictionary");
        assert_eq!(
            d,
            vec![
                ("a".into(), Member::Item(Item::Boolean(true))),
                ("b".into(), Member::Item(Item::Boolean(false))),
                (
                    "c".into(),
                    Member::InnerList(vec![
                        Item::String(b"x".to_vec()),
                        Item::String(b"y\"z".to_vec())
                    ])
                ),
                ("d".into(), Member::Item(Item::ByteSequence(vec![1, 2]))),
                ("e".into(), Member::Item(Item::Other)),
                ("f".into(), Member::Item(Item::Other)),
            ]
        );
        assert_eq!(dictionary(b""), Some(Vec::new()));
        // The last of a repeated key stands.
        assert_eq!(
            dictionary(b"a=?0, a").expect("dict"),
            vec![("a".into(), Member::Item(Item::Boolean(true)))]
        );
        for bad in [
            &b"A=1"[..],
            b"a=,",
            b"a,",
            b"a=(\"x\"\"y\")",
            b"a=\"unterminated",
            b"a=\"\\n\"",
            b"a=?2",
            b"a=(\"x\"",
        ] {
            assert_eq!(dictionary(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
