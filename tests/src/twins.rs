//! The hostile-twin harness: an attacker's variant of a request runs next
//! to a victim's, and the victim must get what it would have got alone.
//!
//! A scenario is a list of requests in order. [`Twin::run`] plays it twice
//! against a fresh origin and a fresh corral each time: once without the
//! attacker's requests (what the victim gets alone), once with them, and
//! compares every victim's answer (status and body) between the two runs.
//! The origins are deterministic [`Personality`]s, each one a way real
//! servers read a request that corral must account for, so the comparison
//! is exact.

use std::net::Ipv4Addr;

use bytes::Bytes;
use http::Method;

use crate::client::{Answer, Client};
use crate::config::Config;
use crate::proxy::Proxy;
use crate::raw_origin::{RawOrigin, RawRequest, response};

/// How an origin reads requests. Each answers deterministically from the
/// request alone, so two runs of a scenario answer alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Personality {
    /// Routes case-insensitively (Express, Koa, ASP.NET Core, IIS):
    /// `/PROFILE` is `/profile`. `/profile` is personal: it shows the
    /// caller's `sess` cookie, and says `max-age=60` (an application that
    /// relies on the proxy's route policy to keep it private).
    CaseInsensitive,
    /// Reads fields as CGI does (WSGI, Rack, PHP): `X_Forwarded_Host` is
    /// `X-Forwarded-Host`, the last one read wins. Its page names the
    /// host, client address and account it believes, cacheable.
    Cgi,
    /// Normalizes paths as nginx and most frameworks do (merges slashes,
    /// decodes unreserved escapes, removes dot segments, folds case), and
    /// answers like [`Personality::CaseInsensitive`].
    Normalizing,
    /// Fails with a 500 on a field it does not expect (`X-Unexpected`)
    /// and on paths under `/throws`, and with a 502 (its own gateway) on
    /// paths under `/gateway`; anything else is a page cacheable for a
    /// second.
    ChokesOnFields,
    /// Answers GET with the target, cacheable; answers QUERY with the
    /// query's content and a `Content-Location` of the request's own URI.
    QueryEcho,
}

impl Personality {
    /// The answer to `r`.
    pub fn answer(self, r: &RawRequest) -> Vec<u8> {
        match self {
            Personality::CaseInsensitive => profile_page(r, r.target()),
            Personality::Normalizing => profile_page(r, &normalized(r.target())),
            Personality::Cgi => cgi_page(r),
            Personality::ChokesOnFields => {
                if r.header("x-unexpected").is_some() || r.target().starts_with("/throws") {
                    response(500, &[], "internal error")
                } else if r.target().starts_with("/gateway") {
                    response(502, &[], "bad gateway")
                } else {
                    let body = format!("page {}", r.target());
                    response(200, &[("cache-control", "max-age=1")], &body)
                }
            }
            Personality::QueryEcho => {
                if r.method() == "QUERY" {
                    let body = format!("query {}", String::from_utf8_lossy(&r.body));
                    let own = r.target().to_owned();
                    response(
                        200,
                        &[("cache-control", "max-age=60"), ("content-location", &own)],
                        &body,
                    )
                } else {
                    let body = format!("{} {}", r.method(), r.target());
                    response(200, &[("cache-control", "max-age=60")], &body)
                }
            }
        }
    }
}

/// The page of a router that folds case: `/profile` (with any query) is
/// the caller's own, everything else public.
fn profile_page(r: &RawRequest, path_and_query: &str) -> Vec<u8> {
    let path = path_and_query.split('?').next().unwrap_or_default();
    if path.eq_ignore_ascii_case("/profile") {
        let user = cookie(r, "sess").unwrap_or("anonymous");
        return response(
            200,
            &[("cache-control", "max-age=60")],
            &format!("profile of {user}"),
        );
    }
    response(
        200,
        &[("cache-control", "max-age=60")],
        &format!("public {path_and_query}"),
    )
}

/// The value of cookie `name` in the request's Cookie field.
fn cookie<'r>(r: &'r RawRequest, name: &str) -> Option<&'r str> {
    r.header_all("cookie")
        .into_iter()
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The page a CGI application builds from the fields it reads: every name
/// uppercased with `-` as `_` (`HTTP_X_FORWARDED_HOST`), the last wins.
fn cgi_page(r: &RawRequest) -> Vec<u8> {
    let cgi = |field: &str| -> Option<String> {
        let wanted = field.to_ascii_uppercase().replace('-', "_");
        r.head
            .lines()
            .skip(1)
            .filter_map(|line| line.split_once(':'))
            .filter(|(n, _)| n.trim().to_ascii_uppercase().replace('-', "_") == wanted)
            .map(|(_, v)| v.trim().to_owned())
            .last()
    };
    let body = format!(
        "<script src=\"//{}/app.js\"></script> client={} account={}",
        cgi("x-forwarded-host").unwrap_or_default(),
        cgi("x-real-ip")
            .or_else(|| cgi("true-client-ip"))
            .or_else(|| cgi("x-client-ip"))
            .unwrap_or_else(|| "-".to_owned()),
        cgi("x-account-id").unwrap_or_else(|| "-".to_owned()),
    );
    response(200, &[("cache-control", "max-age=60")], &body)
}

/// A path as a normalizing origin reads it: slashes merged, unreserved
/// escapes decoded, dot segments removed, case folded (the query kept).
fn normalized(target: &str) -> String {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let mut decoded = String::new();
    let mut bytes = path.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex: String = bytes.by_ref().take(2).map(char::from).collect();
            match u8::from_str_radix(&hex, 16) {
                Ok(c) if c.is_ascii_alphanumeric() || b"-._~".contains(&c) => {
                    decoded.push(char::from(c));
                }
                _ => {
                    decoded.push('%');
                    decoded.push_str(&hex);
                }
            }
        } else {
            decoded.push(char::from(b));
        }
    }
    let mut segments: Vec<&str> = Vec::new();
    for s in decoded.split('/').filter(|s| !s.is_empty() && *s != ".") {
        if s == ".." {
            segments.pop();
        } else {
            segments.push(s);
        }
    }
    let mut out = format!("/{}", segments.join("/")).to_ascii_lowercase();
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Who sends a request: a caller with an address of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The victim: its answers are compared between the runs.
    Victim,
    /// The attacker: its requests are left out of the run alone.
    Attacker,
    /// Anyone else, in both runs (a warm-up, another innocent caller).
    Bystander,
}

impl Role {
    fn source(self) -> Ipv4Addr {
        match self {
            Role::Victim => Ipv4Addr::new(127, 0, 0, 1),
            Role::Attacker => Ipv4Addr::new(127, 0, 0, 66),
            Role::Bystander => Ipv4Addr::new(127, 0, 0, 7),
        }
    }
}

/// One request of a scenario.
#[derive(Clone, Debug)]
pub struct Step {
    role: Role,
    method: Method,
    target: String,
    fields: Vec<(String, String)>,
    body: Option<Bytes>,
}

impl Step {
    /// A GET of `target` (path and query) by `role`.
    pub fn get(role: Role, target: &str) -> Self {
        Step {
            role,
            method: Method::GET,
            target: target.to_owned(),
            fields: Vec::new(),
            body: None,
        }
    }

    /// A request of any method, with a body.
    pub fn with_body(role: Role, method: &str, target: &str, body: &str) -> Self {
        Step {
            method: Method::from_bytes(method.as_bytes()).expect("a method token"),
            body: Some(Bytes::from(body.to_owned())),
            ..Step::get(role, target)
        }
    }

    /// Adds a request field.
    pub fn field(mut self, name: &str, value: &str) -> Self {
        self.fields.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// A scenario: an origin's personality, corral's config for it, and the
/// requests in order.
pub struct Twin {
    personality: Personality,
    config: Box<dyn Fn(&str) -> Config>,
    steps: Vec<Step>,
}

/// What the victim got: its answers in order, as (status, body).
pub type VictimAnswers = Vec<(u16, String)>;

impl Twin {
    /// A scenario against an origin of `personality`; `config` makes the
    /// config from the origin's URL.
    pub fn new(personality: Personality, config: impl Fn(&str) -> Config + 'static) -> Self {
        Twin {
            personality,
            config: Box::new(config),
            steps: Vec::new(),
        }
    }

    /// Appends a step.
    pub fn step(mut self, step: Step) -> Self {
        self.steps.push(step);
        self
    }

    /// Plays the scenario alone and attacked, asserts that every victim's
    /// answer is the same in both, and returns them (what the victim got
    /// alone), with the origin's requests of the attacked run.
    pub async fn run(&self) -> (VictimAnswers, Vec<RawRequest>) {
        let (alone, _) = self.play(false).await;
        let (attacked, seen) = self.play(true).await;
        assert!(
            alone.iter().any(|(status, _)| *status != 0),
            "the scenario has a victim"
        );
        assert_eq!(
            attacked, alone,
            "the victim got something else with the attacker beside it"
        );
        (alone, seen)
    }

    /// One run; with `attacked`, the attacker's steps too.
    async fn play(&self, attacked: bool) -> (VictimAnswers, Vec<RawRequest>) {
        let personality = self.personality;
        let origin = RawOrigin::start(move |r| personality.answer(r)).await;
        let proxy = Proxy::new((self.config)(&origin.url())).start().await;
        let mut victim = Vec::new();
        for step in &self.steps {
            if step.role == Role::Attacker && !attacked {
                continue;
            }
            let answer = send(&proxy.url(&step.target), step).await;
            if step.role == Role::Victim {
                victim.push((answer.status.as_u16(), answer.text()));
            }
        }
        (victim, origin.requests())
    }
}

/// Sends `step` to `url` from its role's address.
async fn send(url: &str, step: &Step) -> Answer {
    let fields: Vec<(&str, &str)> = step
        .fields
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    Client::from_address(step.role.source())
        .send(step.method.clone(), url, &fields, step.body.clone())
        .await
}
