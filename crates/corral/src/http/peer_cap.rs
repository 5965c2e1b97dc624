//! How many connections one peer address may hold open on a listener that
//! caps them (the admin and health listeners): a caller that opens many
//! silent sockets takes its own share and no one else's. Never consulted
//! on the client listener, whose callers may share an address (a NAT, a
//! load balancer).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The open connections of each peer address, each at most `cap`.
#[derive(Debug)]
pub struct PeerCap {
    cap: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection counted against its peer; uncounted on drop.
#[derive(Debug)]
pub struct PeerSlot {
    of: Arc<PeerCap>,
    peer: IpAddr,
}

impl PeerCap {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(PeerCap {
            cap,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `peer`, or `None` when it holds
    /// `cap` already. An IPv4 peer seen as an IPv6-mapped address counts
    /// as itself.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<PeerSlot> {
        let peer = peer.to_canonical();
        // A plain mutex: held for one map update, never across an await.
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(peer).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            of: Arc::clone(self),
            peer,
        })
    }

    #[cfg(test)]
    fn held(&self, peer: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(&peer).copied().unwrap_or(0)
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.of.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.peer) {
            *n -= 1;
            // A peer with nothing open is forgotten: the map holds only
            // addresses with a connection, so it is bounded by the
            // listener's connection limit.
            if *n == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_gets_its_cap_and_a_closed_connection_frees_its_place() {
        let cap = PeerCap::new(2);
        let a: IpAddr = "127.0.0.2".parse().expect("ip");
        let b: IpAddr = "127.0.0.3".parse().expect("ip");
        let first = cap.admit(a).expect("first");
        let _second = cap.admit(a).expect("second");
        assert!(cap.admit(a).is_none(), "a third from the same address");
        // Another address is not touched by the first one's use.
        let _other = cap.admit(b).expect("another peer");
        // The IPv6-mapped form of an address is the address.
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().expect("ip");
        assert!(cap.admit(mapped).is_none(), "mapped counts as itself");
        drop(first);
        assert_eq!(cap.held(a), 1);
        assert!(cap.admit(a).is_some(), "a place came back");
        assert_eq!(cap.held(a), 1, "and went again with the slot's drop");
    }

    #[test]
    fn a_peer_with_nothing_open_is_forgotten() {
        let cap = PeerCap::new(1);
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        drop(cap.admit(a));
        let open = cap.open.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(open.is_empty(), "{open:?}");
    }
}
