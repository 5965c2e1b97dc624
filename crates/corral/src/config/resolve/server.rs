//! Resolves `server:`: the front end's deadlines and limits, whom to believe about
//! client addresses, and the threads that serve clients. Reads no file.

use corral_core::callers::client_addr::{Cidr, TrustedHeader, TrustedProxies};

use super::{Resolver, percentage, whole_number, whole_u32};
use crate::config::raw::RawServer;
use crate::config::size::describe_size;
use crate::config::{ConfigError, RuntimeMode, ServerConfig};

/// hyper panics when asked to buffer less than this for a request head.
const MIN_HEADER_SIZE: u64 = 8 * 1024;
/// `server.workers` at most: more threads than any machine has cores.
const MAX_WORKERS: u32 = 1024;

impl Resolver<'_> {
    /// `server:`; every field has a default.
    pub(super) fn server(&self, raw: &RawServer) -> Result<ServerConfig, ConfigError> {
        let defaults = ServerConfig::default();
        let header_read_timeout = self
            .at("server.header_read_timeout", &raw.header_read_timeout)
            .duration_or(defaults.header_read_timeout)?
            .positive()?;
        let idle_timeout = self
            .at("server.idle_timeout", &raw.idle_timeout)
            .duration_or(defaults.idle_timeout)?
            .positive()?;
        let send_timeout = self
            .at("server.send_timeout", &raw.send_timeout)
            .duration_or(defaults.send_timeout)?
            .positive()?;
        let min_send_rate = self
            .at("server.min_send_rate", &raw.min_send_rate)
            .size_or(defaults.min_send_rate)?;
        let max_connections = self
            .at("server.max_connections", &raw.max_connections)
            .parse(|t| whole_number(t, 1, "connections"))?;
        let max_header_size = self
            .at("server.max_header_size", &raw.max_header_size)
            .size_or(defaults.max_header_size)?;
        if max_header_size.value < MIN_HEADER_SIZE {
            return Err(max_header_size.blame(format!(
                "{} is below the 8KiB minimum the HTTP/1 server accepts",
                describe_size(max_header_size.value)
            )));
        }
        let shutdown_grace = self
            .at("server.shutdown_grace", &raw.shutdown_grace)
            .duration_or(defaults.shutdown_grace)?;
        let drain_period = self
            .at("server.drain_period", &raw.drain_period)
            .duration_or(defaults.drain_period)?;
        let purge_token = self.secret("server.purge_token", &raw.purge_token, "cache purges")?;
        let admin_token = self.secret("server.admin_token", &raw.admin_token, "the live view")?;
        let admin_hosts = match &raw.admin_hosts {
            None => Vec::new(),
            Some(entries) => self.list(entries, "server.admin_hosts", admin_host)?,
        };
        let trusted_proxies = self.trusted_proxies(raw)?;
        let (runtime, workers) = self.threads(raw)?;
        let cpu_threads = self.cpu_threads(raw)?;
        let overload =
            self.at("server.overload", &raw.overload)
                .parse_or(defaults.overload, |t| match t.trim() {
                    "off" => Ok(None),
                    t => percentage(t, 1, 100).map(Some),
                })?;
        let proxy_name = self.proxy_name(raw, defaults.proxy_name)?;
        Ok(ServerConfig {
            proxy_name,
            overload,
            runtime,
            workers,
            cpu_threads,
            trusted_proxies,
            listen_proxy_protocol: raw.listen_proxy_protocol.unwrap_or(false),
            purge_token,
            admin_token,
            admin_hosts,
            header_read_timeout: header_read_timeout.value,
            idle_timeout: idle_timeout.value,
            send_timeout: send_timeout.value,
            min_send_rate: min_send_rate.value,
            max_connections,
            max_header_size: max_header_size.value,
            shutdown_grace: shutdown_grace.value,
            drain_period: drain_period.value,
        })
    }

    /// A token of `server:` (`purge_token`, `admin_token`): at least 16
    /// characters, for it guards `what`.
    fn secret(
        &self,
        field: &str,
        value: &Option<crate::config::raw::Text>,
        what: &str,
    ) -> Result<Option<String>, ConfigError> {
        self.at(field, value).parse(|t| {
            let token = t.trim();
            if token.len() < 16 {
                return Err(format!("must be at least 16 characters: it guards {what}"));
            }
            Ok(token.to_owned())
        })
    }

    /// `server.cpu_threads`: 0 (inline) to 1024; unset, the default.
    fn cpu_threads(&self, raw: &RawServer) -> Result<Option<usize>, ConfigError> {
        self.at("server.cpu_threads", &raw.cpu_threads).parse(|t| {
            match whole_u32(t, 0, "threads") {
                Ok(n) if n <= MAX_WORKERS => Ok(usize::try_from(n).unwrap_or(1)),
                Ok(n) => Err(format!(
                    "{n} threads is more than the {MAX_WORKERS} allowed"
                )),
                Err(m) => Err(m),
            }
        })
    }

    /// `server.proxy_name`: an RFC 8941 token.
    fn proxy_name(&self, raw: &RawServer, default: String) -> Result<String, ConfigError> {
        self.at("server.proxy_name", &raw.proxy_name)
            .parse_or(default, |t| {
                let name = t.trim();
                if corral_core::semantics::cache_status::is_valid_name(name) {
                    Ok(name.to_owned())
                } else {
                    Err("must be an RFC 8941 token of at most 64 characters (a letter first; no spaces, commas, semicolons, quotes or `=`): it names corral's Cache-Status and Proxy-Status members")
                }
            })
    }

    /// `server.trusted_proxies` and the one header they write, `server.trusted_header`.
    fn trusted_proxies(&self, raw: &RawServer) -> Result<TrustedProxies, ConfigError> {
        let proxies = match &raw.trusted_proxies {
            None => TrustedProxies::default(),
            Some(entries) => TrustedProxies::new(
                entries
                    .iter()
                    .enumerate()
                    .map(|(index, entry)| {
                        Cidr::parse(&entry.value).map_err(|m| {
                            self.error(
                                &entry.referenced,
                                &format!("server.trusted_proxies[{index}]"),
                                m,
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let header = self
            .at("server.trusted_header", &raw.trusted_header)
            .parse(|t| match t.trim() {
                "x-forwarded-for" => Ok(TrustedHeader::XForwardedFor),
                "forwarded" => Ok(TrustedHeader::Forwarded),
                other => Err(format!(
                    "`{other}` is not one of x-forwarded-for, forwarded: name the header your proxies write"
                )),
            })?;
        Ok(match header {
            None => proxies,
            Some(header) => proxies.believing(header),
        })
    }

    /// `server.runtime` and `server.workers`: how client connections are spread over
    /// threads, and how many.
    fn threads(&self, raw: &RawServer) -> Result<(RuntimeMode, Option<usize>), ConfigError> {
        let runtime =
            self.at("server.runtime", &raw.runtime)
                .parse_or(RuntimeMode::Shared, |t| match t.trim() {
                    "shared" => Ok(RuntimeMode::Shared),
                    "per_core" => Ok(RuntimeMode::PerCore),
                    other => Err(format!(
                        "`{other}` is not a runtime: write shared or per_core"
                    )),
                })?;
        let workers = self.at("server.workers", &raw.workers).parse(|t| {
            match whole_u32(t, 1, "threads") {
                Ok(n) if n <= MAX_WORKERS => Ok(usize::try_from(n).unwrap_or(1)),
                Ok(n) => Err(format!(
                    "{n} threads is more than the {MAX_WORKERS} allowed"
                )),
                Err(m) => Err(m),
            }
        })?;
        Ok((runtime, workers))
    }
}

/// One entry of `server.admin_hosts`: a host name as a Host field names
/// it, without port or scheme, kept in lower case without a trailing dot.
/// IP addresses and `localhost` are always answered for, so they are not
/// listed.
fn admin_host(text: &str) -> Result<String, String> {
    let name = text.trim();
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !valid {
        return Err(format!(
            "`{text}` is not a host name such as corral-admin.example: write the name alone, without a port, scheme or wildcard"
        ));
    }
    Ok(name)
}
