vcl 4.1;
# Varnish in front of the demo origin, for bench/run.sh.
#
# TTL: Varnish's own reading of Cache-Control (s-maxage, max-age) and Expires;
# default_ttl (varnishd -t) only when the origin gives none.
# Grace: from the origin's stale-while-revalidate, so a stale copy is served at
# once while one background fetch refreshes it. Varnish has no stale-if-error,
# so the usual idiom stands in for it: grace also covers stale-if-error, and a
# background fetch that gets a 5xx or no answer is abandoned, which keeps the
# stale copy in place instead of replacing it with the error.
# bench/run.sh replaces the backend port when ORIGIN_PORT is not 3950.

import std;

backend origin {
    .host = "127.0.0.1";
    .port = "3950";
    .connect_timeout = 2s;
    .first_byte_timeout = 15s;
    .between_bytes_timeout = 15s;
}

sub vcl_backend_response {
    if (beresp.http.Cache-Control ~ "stale-while-revalidate=[0-9]+") {
        set beresp.grace = std.duration(regsub(beresp.http.Cache-Control,
            "^.*stale-while-revalidate=([0-9]+).*$", "\1s"), 0s);
    }
    if (beresp.http.Cache-Control ~ "stale-if-error=[0-9]+" &&
        std.duration(regsub(beresp.http.Cache-Control,
            "^.*stale-if-error=([0-9]+).*$", "\1s"), 0s) > beresp.grace) {
        set beresp.grace = std.duration(regsub(beresp.http.Cache-Control,
            "^.*stale-if-error=([0-9]+).*$", "\1s"), 0s);
    }
    if (beresp.status >= 500 && bereq.is_bgfetch) {
        return (abandon);
    }
}

sub vcl_backend_error {
    if (bereq.is_bgfetch) {
        return (abandon);
    }
}
