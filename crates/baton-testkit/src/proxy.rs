//! [`TcpProxy`]: a local TCP proxy that can cut every live connection.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// ------------------------------------------------------------------------------------------------
// TcpProxy
// ------------------------------------------------------------------------------------------------

/// One proxied connection: duplicates of both sockets (to shut them down from any thread, at once)
/// and the task copying between them.
struct ProxiedConn {
    client: OwnedFd,
    upstream: OwnedFd,
    task: tokio::task::AbortHandle,
}

impl ProxiedConn {
    fn cut(&self) {
        // SAFETY: shutdown(2) on descriptors we own (dups, so never reused while held).
        unsafe {
            libc::shutdown(self.client.as_raw_fd(), libc::SHUT_RDWR);
            libc::shutdown(self.upstream.as_raw_fd(), libc::SHUT_RDWR);
        }
        self.task.abort();
    }
}

#[derive(Default)]
struct ProxyState {
    refuse: AtomicBool,
    conns: Mutex<HashMap<u64, ProxiedConn>>,
    next_id: AtomicU64,
    /// Number of `drop_connections` calls so far (changed under the `conns` lock).
    cuts: AtomicU64,
}

/// A TCP proxy on 127.0.0.1 forwarding to a target, that can cut every live connection. Stops
/// (listener and connections) on drop. Must be started inside a Tokio runtime.
pub struct TcpProxy {
    addr: SocketAddr,
    target: SocketAddr,
    state: Arc<ProxyState>,
    accept_task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards each connection to `target`.
    pub async fn start(target: SocketAddr) -> TcpProxy {
        let listener = tokio::net::TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("TcpProxy: cannot bind 127.0.0.1");
        let addr = listener.local_addr().expect("TcpProxy: no local address");
        let state = Arc::new(ProxyState::default());
        let accept_state = state.clone();
        let accept_task = tokio::spawn(async move {
            loop {
                let (client, _) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("TcpProxy accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if accept_state.refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let cuts = accept_state.cuts.load(Ordering::SeqCst);
                tokio::spawn(proxy_connection(accept_state.clone(), client, target, cuts));
            }
        });
        TcpProxy { addr, target, state, accept_task }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address connections are forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Closes every live connection (client and upstream sides) now. New connections are still
    /// accepted.
    pub fn drop_connections(&self) {
        let conns: Vec<ProxiedConn> = {
            let mut map = self.state.conns.lock().unwrap_or_else(|p| p.into_inner());
            self.state.cuts.fetch_add(1, Ordering::SeqCst);
            map.drain().map(|(_, c)| c).collect()
        };
        for conn in &conns {
            conn.cut();
        }
    }

    /// While `true`, new connections are accepted and closed at once (live ones are untouched).
    pub fn set_refuse(&self, refuse: bool) {
        self.state.refuse.store(refuse, Ordering::SeqCst);
    }
}

/// Removes a connection from the registry when its task ends (or is aborted).
struct Registered {
    state: Arc<ProxyState>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.state.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

async fn proxy_connection(
    state: Arc<ProxyState>,
    mut client: tokio::net::TcpStream,
    target: SocketAddr,
    cuts_at_accept: u64,
) {
    let mut upstream = match tokio::net::TcpStream::connect(target).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!("TcpProxy: cannot connect to {target}: {e}");
            return; // dropping `client` closes it
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (Ok(client_fd), Ok(upstream_fd)) = (client.as_fd().try_clone_to_owned(), upstream.as_fd().try_clone_to_owned())
    else {
        return;
    };
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let task = tokio::task::spawn(async move {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    });
    let conn = ProxiedConn { client: client_fd, upstream: upstream_fd, task: task.abort_handle() };
    {
        let mut conns = state.conns.lock().unwrap_or_else(|p| p.into_inner());
        if state.cuts.load(Ordering::SeqCst) != cuts_at_accept {
            // `drop_connections` ran while this connection was being set up: it was live then.
            conn.cut();
        } else {
            conns.insert(id, conn);
        }
    }
    let _registered = Registered { state, id };
    let _ = task.await;
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.drop_connections();
    }
}

impl fmt::Debug for TcpProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpProxy").field("addr", &self.addr).field("target", &self.target).finish()
    }
}
