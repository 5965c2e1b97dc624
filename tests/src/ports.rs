//! Free loopback ports for processes that must be told their port up front.

use std::net::{SocketAddr, TcpListener};

/// Returns a loopback address whose port was free a moment ago.
///
/// The port is found by binding port 0 and releasing it; another process could
/// take it in between, which is why `Proxy::start` retries a failed start.
pub fn free_addr() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.local_addr()
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
