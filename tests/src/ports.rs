//! Free loopback ports for processes that must be told their port up front.

use std::net::{SocketAddr, TcpListener};

/// Returns a loopback address whose port was free a moment ago.
///
/// The port is found by binding port 0 and releasing it; another process could
/// take it in between. `Proxy` starts corral on port 0 instead and reads the
/// bound ports back; this is for processes that cannot report theirs (and
/// for a `CORRAL_BIN` build that may not).
pub fn free_addr() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.local_addr()
}

/// Returns a loopback address that was free a moment ago, below the
/// kernel's ephemeral range (`ip_local_port_range`), for a server that is
/// killed and restarted on the same port: while it is down, a client that
/// keeps connecting to it may be given that very port as its own source
/// port and connect to itself (a TCP simultaneous open), holding the port
/// so the restart cannot bind it. No source port is picked below the
/// range. Falls back to [`free_addr`] when no such port is found.
pub fn free_addr_for_restarts() -> std::io::Result<SocketAddr> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let floor = 10_000u16;
    if low > floor + 1000 {
        let span = u32::from(low - floor);
        let seed = std::process::id()
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
        for i in 0..200u32 {
            // A spread of candidates that differs per process and call.
            let offset = seed.wrapping_add(i.wrapping_mul(7919)) % span;
            let port = floor + u16::try_from(offset).unwrap_or(0);
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                return l.local_addr();
            }
        }
    }
    free_addr()
}

/// Returns a loopback address for a listener a test names in corral's
/// config (`listen_tls`) before `Proxy` picks its listen and admin ports.
/// Those come from port 0, in the ephemeral range, where a port just
/// released can be handed out again: a `listen_tls` picked there once took
/// the admin port of the same instance, which then could not start. This
/// one is below the range (see [`free_addr_for_restarts`]), so the two
/// never meet.
pub fn free_addr_for_config() -> std::io::Result<SocketAddr> {
    free_addr_for_restarts()
}

/// Returns `n` distinct loopback addresses that were free a moment ago.
///
/// All `n` are held at once while picking, so none repeats; like
/// [`free_addr`], any may be taken by someone else before it is used.
pub fn free_addrs(n: usize) -> std::io::Result<Vec<SocketAddr>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners.iter().map(TcpListener::local_addr).collect()
}

/// A loopback port that refuses connections for as long as the returned
/// socket lives: it is bound but not listening, so nothing else can take it
/// (a port that was merely free may be reused by another test's server, or
/// picked as the source port of a connection to itself).
pub fn closed_port() -> std::io::Result<(socket2::Socket, SocketAddr)> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
    let addr = socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| std::io::Error::other("not an inet address"))?;
    Ok((socket, addr))
}
