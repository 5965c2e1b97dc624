//! The fields a file must give, checked all at once before anything else, so
//! `corral check` names every one that is missing or unreadable in one run
//! rather than one per run. Only presence and the field's own syntax are
//! checked here; the rules between fields are the full pass's.

use serde_saphyr::{Location, Spanned};

use super::route::route_name;
use super::upstream::upstream_uri;
use super::{Resolver, socket_addr};
use crate::config::ConfigError;
use crate::config::raw::{RawConfig, RawLimit, RawRoute};
use crate::config::size::parse_size;

impl Resolver<'_> {
    /// Every required field the file lacks or cannot be read, in no order.
    pub(super) fn required_fields(&self, raw: &RawConfig, root: &Location) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        let mut check = |result: Result<(), ConfigError>| {
            if let Err(e) = result {
                errors.push(e);
            }
        };
        check(
            self.at("listen", &raw.listen)
                .required(root, socket_addr)
                .map(drop),
        );
        check(self.at("admin", &raw.admin).parse(socket_addr).map(drop));
        if let Some(cache) = &raw.cache {
            check(
                match self
                    .at("cache.memory", &cache.value.memory)
                    .setting(parse_size)
                {
                    Ok(Some(memory)) => memory.positive().map(drop),
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                },
            );
        }
        if let Some(tls) = &raw.listen_tls {
            let (at, t) = (&tls.referenced, &tls.value);
            check(
                self.at("listen_tls.addr", &t.addr)
                    .required(at, socket_addr)
                    .map(drop),
            );
            check(
                self.required(&t.cert_file, at, "listen_tls.cert_file")
                    .map(drop),
            );
            check(
                self.required(&t.key_file, at, "listen_tls.key_file")
                    .map(drop),
            );
        }
        if let Some(limits) = &raw.limits {
            errors.extend(self.required_of_limits(limits, "limits"));
        }
        match &raw.routes {
            None => errors.push(self.missing(root, "routes")),
            Some(routes) if routes.value.is_empty() => errors.push(self.error(
                &routes.referenced,
                "routes",
                "at least one route is required",
            )),
            Some(routes) => {
                for (index, route) in routes.value.iter().enumerate() {
                    errors.extend(self.required_of_route(route, &format!("routes[{index}]")));
                }
            }
        }
        errors
    }

    /// A route's: its name when given, and an upstream (or upstreams) that
    /// reads as one.
    fn required_of_route(&self, raw: &Spanned<RawRoute>, prefix: &str) -> Vec<ConfigError> {
        let (at, route) = (&raw.referenced, &raw.value);
        let mut errors = Vec::new();
        if let Err(e) = self.under(prefix, "name", &route.name).parse(route_name) {
            errors.push(e);
        }
        match (&route.upstream, &route.upstreams) {
            (None, None) => errors.push(self.missing(at, &format!("{prefix}.upstream"))),
            (Some(u), None) => {
                if let Err(e) = self.under(prefix, "upstream", u).parse(upstream_uri) {
                    errors.push(e);
                }
            }
            (None, Some(list)) => {
                for (i, t) in list.value.iter().enumerate() {
                    let field = format!("{prefix}.upstreams[{i}]");
                    if let Err(e) = self.at(field, t).parse(upstream_uri) {
                        errors.push(e);
                    }
                }
            }
            // Both: the full pass says which to keep.
            (Some(_), Some(_)) => {}
        }
        if let Some(limits) = &route.limits {
            errors.extend(self.required_of_limits(limits, &format!("{prefix}.limits")));
        }
        errors
    }

    /// Each limit's `name`, `key` and `rate`, which have no default.
    fn required_of_limits(
        &self,
        limits: &Spanned<Vec<Spanned<RawLimit>>>,
        field: &str,
    ) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        for (index, limit) in limits.value.iter().enumerate() {
            let (at, l) = (&limit.referenced, &limit.value);
            let prefix = format!("{field}[{index}]");
            for (name, value) in [("name", &l.name), ("key", &l.key), ("rate", &l.rate)] {
                if value.is_none() {
                    errors.push(self.missing(at, &format!("{prefix}.{name}")));
                }
            }
        }
        errors
    }
}
