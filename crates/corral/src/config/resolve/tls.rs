//! Resolves the three TLS sections: `listen_tls` (the client listener's certificate),
//! `redis.tls` and a route's `tls` (the CA and client certificate corral presents).
//! Reads the PEM files they name and has `config::tls` check them, as a reload would.

use std::net::SocketAddr;

use serde_saphyr::{Location, Spanned};

use super::{Resolver, collide, socket_addr};
use crate::config::raw::{RawListenTls, RawRedisTls, RawTls, Text};
use crate::config::tls::{TlsFiles, UpstreamTls};
use crate::config::{ConfigError, ListenTls, RedisTls};

impl Resolver<'_> {
    /// `listen_tls`: an address of its own and a certificate with its key.
    pub(super) fn listen_tls(
        &self,
        raw: &Spanned<RawListenTls>,
        listen: SocketAddr,
        admin: SocketAddr,
    ) -> Result<ListenTls, ConfigError> {
        let (at, t) = (&raw.referenced, &raw.value);
        let addr = self
            .at("listen_tls.addr", &t.addr)
            .required(at, socket_addr)?;
        if collide(addr.value, listen) || collide(addr.value, admin) {
            return Err(addr.blame(format!(
                "{} overlaps listen or admin; give it its own port",
                addr.value
            )));
        }
        let cert = self.required(&t.cert_file, at, "listen_tls.cert_file")?;
        let key = self.required(&t.key_file, at, "listen_tls.key_file")?;
        let (cert_pem, key_pem) = (
            self.read_file(cert, "listen_tls.cert_file")?,
            self.read_file(key, "listen_tls.key_file")?,
        );
        if let Err(e) = crate::config::tls::server_config(&cert_pem, &key_pem) {
            let at = if e.field == "key_file" { key } else { cert };
            return Err(self.error(
                &at.referenced,
                &format!("listen_tls.{}", e.field),
                e.message,
            ));
        }
        Ok(ListenTls {
            addr: addr.value,
            cert_file: cert.value.trim().into(),
            key_file: key.value.trim().into(),
        })
    }

    /// `redis.tls`, which only a `rediss://` deployment (`servers_tls`) may have.
    pub(super) fn redis_tls(
        &self,
        raw: Option<&Spanned<RawRedisTls>>,
        servers_tls: bool,
    ) -> Result<Option<RedisTls>, ConfigError> {
        let t = match (raw, servers_tls) {
            (None, _) => return Ok(None),
            (Some(t), false) => {
                return Err(self.error(
                    &t.referenced,
                    "redis.tls",
                    "applies to rediss:// URLs only",
                ));
            }
            (Some(t), true) => t,
        };
        let read = |x: &Option<Text>, field: &str| {
            self.read_optional(x.as_ref(), &format!("redis.tls.{field}"))
        };
        let ca = read(&t.value.ca_file, "ca_file")?;
        let cert = read(&t.value.client_cert, "client_cert")?;
        let key = read(&t.value.client_key, "client_key")?;
        // The same checks as an upstream's: PEM that rustls takes.
        let files = TlsFiles {
            ca: ca.clone(),
            client_cert: cert.clone(),
            client_key: key.clone(),
            server_name: None,
            insecure_skip_verify: false,
        };
        if let Err(e) = crate::config::tls::build(&files) {
            let at = match e.field {
                "ca_file" => t.value.ca_file.as_ref(),
                "client_cert" => t.value.client_cert.as_ref(),
                "client_key" => t.value.client_key.as_ref(),
                _ => None,
            }
            .map_or(t.referenced, |x| x.referenced);
            return Err(self.error(&at, &format!("redis.tls.{}", e.field), e.message));
        }
        Ok(Some(RedisTls {
            ca,
            client_cert_and_key: cert.zip(key),
        }))
    }

    /// A route's `tls`: resolved for an `https://` upstream (with or without the
    /// section), refused for any other.
    pub(super) fn route_tls(
        &self,
        upstream: &http::Uri,
        upstream_at: &Location,
        raw: Option<&Spanned<RawTls>>,
        prefix: &str,
    ) -> Result<Option<UpstreamTls>, ConfigError> {
        match (upstream.scheme_str(), raw) {
            (Some("https"), tls) => Ok(Some(self.upstream_tls(tls, upstream_at, prefix)?)),
            (_, None) => Ok(None),
            (_, Some(t)) => Err(self.error(
                &t.referenced,
                &format!("{prefix}.tls"),
                "applies to https:// upstreams only",
            )),
        }
    }

    /// An https upstream's TLS: the files of `tls:` read and checked, or
    /// the defaults (platform roots, SNI from the upstream host).
    fn upstream_tls(
        &self,
        raw: Option<&Spanned<RawTls>>,
        upstream_at: &Location,
        prefix: &str,
    ) -> Result<UpstreamTls, ConfigError> {
        let p = format!("{prefix}.tls");
        let read =
            |t: &Option<Text>, field: &str| self.read_optional(t.as_ref(), &format!("{p}.{field}"));
        let files = match raw {
            None => TlsFiles {
                ca: None,
                client_cert: None,
                client_key: None,
                server_name: None,
                insecure_skip_verify: false,
            },
            Some(t) => TlsFiles {
                ca: read(&t.value.ca_file, "ca_file")?,
                client_cert: read(&t.value.client_cert, "client_cert")?,
                client_key: read(&t.value.client_key, "client_key")?,
                server_name: t.value.server_name.as_ref().map(|n| n.value.clone()),
                insecure_skip_verify: t.value.insecure_skip_verify.unwrap_or(false),
            },
        };
        crate::config::tls::build(&files).map_err(|e| {
            let at = raw.map_or(*upstream_at, |t| {
                let v = &t.value;
                match e.field {
                    "ca_file" => v.ca_file.as_ref(),
                    "client_cert" => v.client_cert.as_ref(),
                    "client_key" => v.client_key.as_ref(),
                    "server_name" => v.server_name.as_ref(),
                    _ => None,
                }
                .map_or(t.referenced, |x| x.referenced)
            });
            let field = if e.field.is_empty() {
                p.clone()
            } else {
                format!("{p}.{}", e.field)
            };
            self.error(&at, &field, e.message)
        })
    }
}
