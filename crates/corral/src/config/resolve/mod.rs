//! Turns the file as written (`raw`) into `Config`: fills defaults, parses addresses,
//! durations, sizes and URIs, and checks the rules that span fields.
//! Every refusal points at the value to change. Reads the parsed file, its text, and
//! the key files `callers.account.jwt` names (read anew on every load and reload).
//!
//! This file holds the top level and what every section shares: [`Resolver`], the
//! [`Field`] a value is read from and the [`Setting`] it becomes. Each section is
//! resolved in the file named after it, as `raw.rs` declares them. The messages,
//! positions and field paths of the errors are pinned by tests: a refactor here must
//! never change one.

mod cache;
mod callers;
mod coalesce;
mod compression;
mod limits;
mod origin_failure;
mod redis;
mod required;
mod route;
mod route_cache;
mod server;
mod tls;
mod upstream;

use std::fmt::Display;
use std::net::SocketAddr;
use std::time::Duration;

use serde_saphyr::{Location, Spanned};

use super::duration::parse_duration;
use super::paths::NodePaths;
use super::raw::{RawConfig, Text};
use super::size::parse_size;
use super::{CallersConfig, Config, ConfigError, ServerConfig};

/// Validates `raw`, parsed from `text`, and fills in defaults; `file` is only used in errors.
pub fn resolve(file: &str, text: &str, raw: Spanned<RawConfig>) -> Result<Config, ConfigError> {
    Resolver { file, text }.config(&raw.value, &raw.referenced)
}

/// A value in effect and where it came from: the path of its field, and where the file
/// wrote it (`None` when it is the default). Checks on it refuse it at that place.
#[derive(Debug)]
struct Setting<'a, T> {
    value: T,
    at: Option<Location>,
    field: String,
    file: &'a str,
}

impl<T> Setting<'_, T> {
    /// An error about this value, at where it was written (no position for a default).
    fn blame(&self, message: impl Into<String>) -> ConfigError {
        let at = self.at.unwrap_or(Location::UNKNOWN);
        ConfigError::at(self.file, &at, self.field.as_str(), message)
    }
}

impl<T: Default + PartialEq> Setting<'_, T> {
    /// Refuses zero (`T::default()`: `Duration::ZERO`, `0` bytes): a zero timeout or
    /// size would refuse everything rather than mean "none".
    fn positive(self) -> Result<Self, ConfigError> {
        if self.value == T::default() {
            return Err(self.blame("must be greater than 0"));
        }
        Ok(self)
    }
}

impl<T: PartialOrd + Copy> Setting<'_, T> {
    /// Checks `self <= large`, blaming `self` where it was written, else `large`:
    /// the value the file wrote is the one to change.
    fn at_most(&self, large: &Self, describe: fn(T) -> String) -> Result<(), ConfigError> {
        if self.value <= large.value {
            return Ok(());
        }
        let shown = |setting: &Self| match setting.at {
            Some(_) => describe(setting.value),
            None => format!("{}, the default", describe(setting.value)),
        };
        let message = format!(
            "{} ({}) must not exceed {} ({})",
            leaf(&self.field),
            shown(self),
            leaf(&large.field),
            shown(large),
        );
        if self.at.is_some() {
            Err(self.blame(message))
        } else {
            Err(large.blame(message))
        }
    }
}

/// One scalar field of the file: its path as errors name it (`server.idle_timeout`,
/// `routes[0].cache.default_ttl`) and its text, when the file gives it. Reading it
/// yields a [`Setting`] that carries the path on, so no check repeats it.
struct Field<'r> {
    resolver: &'r Resolver<'r>,
    path: String,
    raw: Option<&'r Text>,
}

impl<'r> Field<'r> {
    /// The value `parse` reads from `text`, refused at `text` with `parse`'s message.
    fn read<T, E: Display>(
        self,
        text: &Text,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Setting<'r, T>, ConfigError> {
        match parse(&text.value) {
            Ok(value) => Ok(Setting {
                value,
                at: Some(text.referenced),
                field: self.path,
                file: self.resolver.file,
            }),
            Err(e) => Err(self
                .resolver
                .error(&text.referenced, &self.path, e.to_string())),
        }
    }

    /// The value as `parse` reads it; missing (see [`Resolver::missing`]) when absent.
    /// `section` is where the section that lacks it starts.
    fn required<T, E: Display>(
        self,
        section: &Location,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Setting<'r, T>, ConfigError> {
        match self.raw {
            Some(text) => self.read(text, parse),
            None => Err(self.resolver.missing(section, &self.path)),
        }
    }

    /// The value as `parse` reads it; `None` when the field is absent.
    fn setting<T, E: Display>(
        self,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<Setting<'r, T>>, ConfigError> {
        let raw = self.raw;
        raw.map(|text| self.read(text, parse)).transpose()
    }

    /// The value as `parse` reads it; `default`, written nowhere, when absent.
    fn setting_or<T, E: Display>(
        self,
        default: T,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Setting<'r, T>, ConfigError> {
        match self.raw {
            Some(text) => self.read(text, parse),
            None => Ok(Setting {
                value: default,
                at: None,
                field: self.path,
                file: self.resolver.file,
            }),
        }
    }

    /// Just the value of [`Field::setting`], for fields no later check points at.
    fn parse<T, E: Display>(
        self,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<T>, ConfigError> {
        Ok(self.setting(parse)?.map(|setting| setting.value))
    }

    /// Just the value of [`Field::setting_or`], for fields no later check points at.
    fn parse_or<T, E: Display>(
        self,
        default: T,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<T, ConfigError> {
        Ok(self.setting_or(default, parse)?.value)
    }

    /// A duration (`250ms`, `1.5s`); `None` when absent.
    fn duration(self) -> Result<Option<Setting<'r, Duration>>, ConfigError> {
        self.setting(parse_duration)
    }

    /// A duration (`250ms`, `1.5s`), or `default` when absent.
    fn duration_or(self, default: Duration) -> Result<Setting<'r, Duration>, ConfigError> {
        self.setting_or(default, parse_duration)
    }

    /// A size in bytes (`64KiB`, `1MB`), or `default` when absent.
    fn size_or(self, default: u64) -> Result<Setting<'r, u64>, ConfigError> {
        self.setting_or(default, parse_size)
    }
}

/// Resolves one file: what it needs to point errors at their place.
struct Resolver<'a> {
    file: &'a str,
    text: &'a str,
}

impl Resolver<'_> {
    /// An error about the value at `at`, in this file.
    fn error(&self, at: &Location, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::at(self.file, at, field, message)
    }

    /// The field at `path`, as the file gives it (`&Option<Text>`, `&Text`) or not.
    fn at<'r>(&'r self, path: impl Into<String>, raw: impl Into<Option<&'r Text>>) -> Field<'r> {
        Field {
            resolver: self,
            path: path.into(),
            raw: raw.into(),
        }
    }

    /// The field `name` of the section at `prefix`: `routes[0].cache` and `default_ttl`
    /// make `routes[0].cache.default_ttl`.
    fn under<'r>(
        &'r self,
        prefix: &str,
        name: &str,
        raw: impl Into<Option<&'r Text>>,
    ) -> Field<'r> {
        self.at(format!("{prefix}.{name}"), raw)
    }

    /// The section or value `field`, which the section starting at `section` must have.
    fn required<'r, T>(
        &self,
        value: &'r Option<T>,
        section: &Location,
        field: &str,
    ) -> Result<&'r T, ConfigError> {
        value.as_ref().ok_or_else(|| self.missing(section, field))
    }

    /// The error for a required `field` the section starting at `section` lacks.
    fn missing(&self, section: &Location, field: &str) -> ConfigError {
        // `field:` with nothing after it parses as absent; point at the key then.
        match NodePaths::index(self.text).key_position(field) {
            Some((line, column)) => ConfigError::at_position(
                self.file,
                line,
                column,
                field,
                "required field has no value",
            ),
            None => self.error(section, field, "required field is missing"),
        }
    }

    /// The whole file: the listeners here, then each section in the order errors are
    /// reported in, then the rules that span sections.
    fn config(&self, raw: &RawConfig, root: &Location) -> Result<Config, ConfigError> {
        if is_empty(raw) {
            return Err(self.error(
                root,
                "",
                "the file is empty: listen and routes (each with an upstream) are required",
            ));
        }
        // Every required field missing or unreadable is reported in one
        // run, with the first other refusal the full pass below makes.
        let required = self.required_fields(raw, root);
        if !required.is_empty() {
            let mut errors = required;
            if let Err(other) = self.resolved(raw, root) {
                errors.push(other);
            }
            return Err(ConfigError::all(errors).expect("at least one error"));
        }
        self.resolved(raw, root)
    }

    /// The whole file once its required fields are known to be there.
    fn resolved(&self, raw: &RawConfig, root: &Location) -> Result<Config, ConfigError> {
        let listen = self.at("listen", &raw.listen).required(root, socket_addr)?;
        let admin = self
            .at("admin", &raw.admin)
            .setting_or(default_admin(), socket_addr)?;
        if collide(listen.value, admin.value) && admin.at.is_none() {
            return Err(listen.blame(format!(
                "{} is the admin listener's default address; give `admin:` another",
                listen.value
            )));
        }
        if collide(listen.value, admin.value) {
            return Err(admin.blame(format!(
                "{} overlaps listen address {}; give the admin listener its own port",
                admin.value, listen.value
            )));
        }
        let (listen, admin) = (listen.value, admin.value);
        let server = match &raw.server {
            Some(server) => self.server(server)?,
            None => ServerConfig::default(),
        };
        let listen_tls = match &raw.listen_tls {
            Some(t) => Some(self.listen_tls(t, listen, admin)?),
            None => None,
        };
        let taken: Vec<SocketAddr> = [listen, admin]
            .into_iter()
            .chain(listen_tls.as_ref().map(|t| t.addr))
            .collect();
        let health_listen = match self
            .at("health_listen", &raw.health_listen)
            .setting(socket_addr)?
        {
            Some(addr) if taken.iter().any(|t| collide(addr.value, *t)) => {
                return Err(addr.blame(format!(
                    "{} overlaps listen, listen_tls or admin; give the health listener its own port",
                    addr.value
                )));
            }
            other => other.map(|a| a.value),
        };
        let cache = self.cache(raw.cache.as_ref())?;
        let redis = self.redis(raw.redis.as_ref())?;
        let callers = match &raw.callers {
            Some(c) => self.callers(c)?,
            None => CallersConfig::default(),
        };
        let limits = match &raw.limits {
            Some(l) => self.limits(l, "limits")?,
            None => Vec::new(),
        };
        let routes = self.routes(self.required(&raw.routes, root, "routes")?)?;
        self.limits_have_account_source(raw, &callers)?;
        self.limit_names_differ_from_global(raw, &routes, &limits)?;
        Ok(Config {
            listen,
            listen_tls,
            admin,
            health_listen,
            server,
            cache,
            redis,
            callers,
            limits,
            routes,
        })
    }

    /// The bytes of the file `text` names (key and certificate files).
    fn read_file(&self, text: &Text, field: &str) -> Result<Vec<u8>, ConfigError> {
        std::fs::read(text.value.trim()).map_err(|e| {
            self.error(
                &text.referenced,
                field,
                format!("cannot read `{}`: {e}", text.value.trim()),
            )
        })
    }

    /// [`Resolver::read_file`] for a file the config may leave out.
    fn read_optional(
        &self,
        text: Option<&Text>,
        field: &str,
    ) -> Result<Option<Vec<u8>>, ConfigError> {
        text.map(|t| self.read_file(t, field)).transpose()
    }

    /// Validates each entry of a list, naming the entry (`field[2]`) when one is refused.
    fn list(
        &self,
        entries: &[Text],
        field: &str,
        check: fn(&str) -> Result<String, String>,
    ) -> Result<Vec<String>, ConfigError> {
        entries
            .iter()
            .enumerate()
            .map(|(index, entry)| {
                check(&entry.value)
                    .map_err(|m| self.error(&entry.referenced, &format!("{field}[{index}]"), m))
            })
            .collect()
    }
}

/// Whether the file sets nothing at all (empty, or only comments).
fn is_empty(raw: &RawConfig) -> bool {
    raw.listen.is_none()
        && raw.listen_tls.is_none()
        && raw.admin.is_none()
        && raw.health_listen.is_none()
        && raw.server.is_none()
        && raw.cache.is_none()
        && raw.redis.is_none()
        && raw.callers.is_none()
        && raw.limits.is_none()
        && raw.routes.is_none()
}

/// `admin` when the file leaves it out: loopback, as `corral proxy`'s.
fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9080))
}

/// A listener's address: an IP and a port, never a name to look up.
fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "`{text}` is not an IP address and port such as 127.0.0.1:8080 (host names are not resolved)"
        )
    })
}

/// Two listeners collide when they would bind the same port on overlapping addresses.
/// Port 0 asks the OS for a free port, so it never collides.
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// The last part of a field's path (`total` of `routes[0].timeouts.total`).
fn leaf(field: &str) -> &str {
    field.rsplit('.').next().unwrap_or(field)
}

/// A whole percentage from `min` to `max` (`50` or `50%`).
fn percentage(text: &str, min: u8, max: u8) -> Result<u8, String> {
    let number = text.trim().trim_end_matches('%').trim();
    match number.parse::<u8>() {
        Ok(p) if (min..=max).contains(&p) => Ok(p),
        _ => Err(format!(
            "`{text}` is not a whole percentage from {min} to {max}"
        )),
    }
}

/// A count of at least `min` (`what` names the unit in the message).
/// [`whole_number`] for a `u32` field.
fn whole_u32(text: &str, min: usize, what: &str) -> Result<u32, String> {
    whole_number(text, min, what)
        .and_then(|n| u32::try_from(n).map_err(|_| format!("`{text}` is too large")))
}

/// A count of at least `min` (`what` names the unit in the message).
fn whole_number(text: &str, min: usize, what: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!(
            "`{text}` is not a whole number of {what} of at least {min}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_collide_on_shared_port_unless_ephemeral() {
        let addr = |s: &str| {
            s.parse::<SocketAddr>()
                .unwrap_or_else(|e| panic!("{s}: {e}"))
        };
        assert!(collide(addr("127.0.0.1:8080"), addr("127.0.0.1:8080")));
        assert!(collide(addr("0.0.0.0:8080"), addr("127.0.0.1:8080")));
        assert!(!collide(addr("127.0.0.1:8080"), addr("127.0.0.1:9080")));
        assert!(!collide(addr("127.0.0.1:8080"), addr("127.0.0.2:8080")));
        assert!(!collide(addr("127.0.0.1:0"), addr("127.0.0.1:0")));
    }
}
