//! The HTTP server's connections, for `baton serve` and `baton worker --listen` alike: binding
//! the address ([`bind`], with a message saying what to do when it is taken), the connection
//! limit derived from the descriptor limit ([`Limits::new`]), and the accept loop ([`serve`])
//! that runs each connection with hyper's HTTP/1 server under these rules:
//!
//! - A connection has `header_timeout` to send its first request's head (request line and
//!   headers), counted from when it connects; later requests on a kept-alive connection get
//!   `header_timeout` from their first byte. One that sends nothing, or half a head, is closed.
//! - A request body has `header_timeout` for each wait of its handler for more bytes
//!   (`Receiving`): a body that stops arriving ends with [`BodyTimeout`], which the HTTP layer
//!   answers `408 body_timeout` with `Connection: close`. Without it, a complete head followed by
//!   a stalled body would hold its connection forever (the request is in flight, so no other
//!   timeout applies).
//! - A kept-alive connection with no request in flight is closed after `idle_timeout` without a
//!   new request. A request is in flight from its complete head until its response body has been
//!   handed to the connection whole, so a long-poll or SSE response is never cut, however long;
//!   after that, bytes of the response still being written (a slow reader) count as activity, so
//!   the idle time runs from the last of them.
//! - At most `max_connections` are open; a connection over the limit is closed as soon as it is
//!   accepted and counted in `baton_http_connections_rejected_total`.
//! - hyper's own head limits are set around the documented `max_header_bytes` (enforced by the
//!   HTTP layer, which answers a JSON `431`), so hyper's bare `431` comes only for heads past
//!   them: more than [`max_header_fields`] fields, or a head larger than the read buffer.
//!
//! hyper's `header_read_timeout` is not used: it runs whenever the connection waits for a head,
//! idle or not, so it would also close every kept-alive connection after `header_timeout` and an
//! idle timeout longer than it could not exist. A watch per connection (`Watch`) keeps the
//! phase instead; everything of one connection runs on its own task.
//!
//! Metrics: `baton_http_connections` (gauge, open now), `baton_http_connections_max` (gauge, the
//! limit), `baton_http_connections_rejected_total` (over the limit) and
//! `baton_http_connections_timed_out_total{reason="header"|"idle"|"body"}`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::http::BodyTimeout;
use crate::settings::Connections;

/// Connections the kernel may hold complete before they are accepted (the standard library's
/// 128 overflows under bursts: the client's SYN is dropped and retried a second later).
const BACKLOG: u32 = 1024;

/// Binds `addr` (with `SO_REUSEADDR`, as the standard library does, and a backlog of
/// 1,024). A taken address, a privileged port or an address of another machine is refused
/// with a message naming `flag`, the flag that picks another address, and `also` (its other
/// spellings, e.g. `BATON_LISTEN`).
pub async fn bind(addr: SocketAddr, flag: &str, also: &str) -> Result<TcpListener, String> {
    let listen = || {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(BACKLOG)
    };
    listen().map_err(|e| bind_error(addr, flag, also, &e))
}

fn bind_error(addr: SocketAddr, flag: &str, also: &str, e: &io::Error) -> String {
    let mut next = addr;
    next.set_port(addr.port().checked_add(1).unwrap_or(0));
    let pick = |example: String| format!("pick another address with {flag} ({also}), e.g. {flag} {example}");
    match e.kind() {
        io::ErrorKind::AddrInUse => format!(
            "cannot listen on {addr}: the address is already in use (another baton or another program listens there); stop that process, or {}",
            pick(next.to_string())
        ),
        io::ErrorKind::PermissionDenied => format!(
            "cannot listen on {addr}: permission denied (ports below 1024 need privileges); {}",
            pick(next.to_string())
        ),
        io::ErrorKind::AddrNotAvailable => format!(
            "cannot listen on {addr}: no network interface of this machine has that address; {}",
            pick(format!("0.0.0.0:{}", addr.port()))
        ),
        _ => format!("cannot listen on {addr}: {e}; {}", pick(next.to_string())),
    }
}

/// What [`serve`] enforces: the resolved [`Connections`] and the head limits given to hyper.
#[derive(Clone, Debug)]
pub struct Limits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// hyper's limit of header fields in one head.
    hyper_max_headers: usize,
    /// hyper's read buffer, which holds the whole head.
    hyper_max_buf: usize,
}

/// The most header fields of one request that reach the HTTP layer (hyper answers more with a
/// bare `431`): room for fields of 40 bytes on average within `max_header_bytes` (409 for the
/// default 16 KiB), at least hyper's default of 100 and at most 1,000. hyper sets aside 64 bytes
/// per allowed field for every request head it parses, so this is not the byte limit divided by
/// the smallest field.
pub fn max_header_fields(max_header_bytes: usize) -> usize {
    (max_header_bytes / 40).clamp(100, 1000)
}

/// hyper's default read buffer (its `DEFAULT_MAX_BUFFER_SIZE`).
const HYPER_DEFAULT_BUF: usize = 8192 + 4096 * 100;

/// The most connections a derived limit allows.
const DERIVED_CAP: u64 = 1_000_000;

impl Limits {
    /// Raises this process's soft descriptor limit to its hard limit, and resolves the connection
    /// limit: `conns.max_connections`, or the descriptor limit less one eighth of it (at least
    /// 64 kept for Redis connections, files and the listener). `max_header_bytes` is the
    /// documented head limit of the HTTP layer; hyper's limits are set above it.
    pub fn new(conns: &Connections, max_header_bytes: usize) -> Limits {
        let descriptors = rlimit::increase_nofile_limit(u64::MAX).ok();
        let derived = match descriptors {
            Some(n) => n.saturating_sub((n / 8).max(64)).clamp(1, DERIVED_CAP) as usize,
            None => 4096,
        };
        let max_connections = match conns.max_connections {
            Some(n) => {
                // Warned when it keeps fewer descriptors free than the derived default does.
                if let Some(d) = descriptors.filter(|_| n > derived) {
                    tracing::warn!(
                        max_connections = n,
                        descriptor_limit = d,
                        "max_connections leaves fewer than one eighth of the descriptor limit (at least 64) for Redis connections, files and the listener: accepting may fail with `Too many open files`; raise the limit (ulimit -n) or lower --max-connections"
                    );
                }
                n
            }
            None => derived,
        };
        tracing::info!(
            max_connections,
            descriptor_limit = descriptors.map(|d| d.to_string()).unwrap_or_else(|| "unknown".into()),
            "connections: at most {max_connections} open"
        );
        Limits {
            header_timeout: conns.header_timeout,
            idle_timeout: conns.idle_timeout,
            // Semaphore permits are taken back all at once at shutdown (`acquire_many(u32)`).
            max_connections: max_connections.min(u32::MAX as usize),
            hyper_max_headers: max_header_fields(max_header_bytes),
            hyper_max_buf: HYPER_DEFAULT_BUF.max(max_header_bytes.saturating_mul(2).saturating_add(64 << 10)),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` is cancelled; then stops accepting, lets each
/// connection finish its response in flight (hyper's graceful shutdown) and returns when every
/// connection is closed.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, shutdown: CancellationToken) -> io::Result<()> {
    let limits = Arc::new(limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    metrics::gauge!("baton_http_connections_max").set(limits.max_connections as f64);
    let mut errors = AcceptErrors::default();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.cancelled() => break,
        };
        match accepted {
            Ok((stream, _)) => match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    tokio::spawn(connection(stream, slot, app.clone(), limits.clone(), shutdown.clone()));
                }
                Err(_) => {
                    metrics::counter!("baton_http_connections_rejected_total").increment(1);
                    drop(stream);
                }
            },
            Err(e) => errors.failed(e).await,
        }
    }
    drop(listener);
    // Every open connection holds a slot: all of them back means all are closed.
    let _all = slots.acquire_many(limits.max_connections as u32).await;
    Ok(())
}

/// Accept errors: those of one connection (reset before it was accepted) are skipped; those of
/// the process (out of descriptors or memory) pause accepting briefly and are logged at most
/// once a minute, with how many there were since the last line.
#[derive(Default)]
struct AcceptErrors {
    logged: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrors {
    async fn failed(&mut self, e: io::Error) {
        use io::ErrorKind::*;
        if matches!(e.kind(), ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted) {
            return;
        }
        self.unlogged += 1;
        let now = Instant::now();
        if self.logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
            tracing::warn!(
                error = %e,
                count = self.unlogged,
                "cannot accept connections; retrying (logged at most once a minute). With `Too many open files`, raise the descriptor limit or lower --max-connections"
            );
            self.logged = Some(now);
            self.unlogged = 0;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn connection(
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    app: Router,
    limits: Arc<Limits>,
    shutdown: CancellationToken,
) {
    metrics::gauge!("baton_http_connections").increment(1.0);
    let watch = Arc::new(Watch::new(Unsent::of(&stream)));
    let io = TokioIo::new(Watched { io: stream, watch: watch.clone() });
    let svc = {
        let watch = watch.clone();
        let body_timeout = limits.header_timeout;
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let busy = Busy::begin(&watch);
            let app = app.clone();
            let ended = Arc::new(AtomicBool::new(req.body().is_end_stream()));
            let req = req.map(|body| Body::new(Receiving::new(body, body_timeout, ended.clone())));
            async move {
                let Ok(mut res) = app.oneshot(req).await;
                // Answered before its body was read to the end (an error found in the head, say):
                // the rest of the body is still on the connection, so it cannot carry another
                // request. Say so, or a client that sends its next request on it loses that one.
                if !ended.load(Relaxed) {
                    res.headers_mut()
                        .insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(res.map(|body| Tracked { body, _busy: busy }))
            }
        })
    };
    let mut builder = http1::Builder::new();
    // No timer is set, so hyper's header_read_timeout is off (module docs).
    builder.max_headers(limits.hyper_max_headers).max_buf_size(limits.hyper_max_buf);
    let conn = builder.serve_connection(io, svc);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        let deadline = watch.deadline(&limits);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = watch.idle.notified() => {}
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                if let Some(reason) = watch.expired(&limits) {
                    // The rest of a response may wait in the kernel's send queue: a client that
                    // keeps reading drains it without any new write here (Linux wakes a writer
                    // only once a third of a large send buffer has drained, which takes longer
                    // than the idle timeout for a slow reader). Draining counts as progress.
                    if reason == "idle" && watch.unsent.drained() {
                        watch.mark(IDLE);
                        continue;
                    }
                    metrics::counter!("baton_http_connections_timed_out_total", "reason" => reason).increment(1);
                    break;
                }
            }
            _ = shutdown.cancelled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
    metrics::gauge!("baton_http_connections").decrement(1.0);
}

/// The bytes a connection's socket has not yet had acknowledged by the client (Linux:
/// `SIOCOUTQ`), to tell a slow reader from a stalled one when the idle timeout passes.
struct Unsent {
    #[cfg(target_os = "linux")]
    fd: std::os::fd::RawFd,
    /// At the last write or look (`u64::MAX`: unknown).
    last: AtomicU64,
}

impl Unsent {
    fn of(stream: &TcpStream) -> Unsent {
        #[cfg(target_os = "linux")]
        let u = Unsent { fd: std::os::fd::AsRawFd::as_raw_fd(stream), last: AtomicU64::new(u64::MAX) };
        #[cfg(not(target_os = "linux"))]
        let u = {
            let _ = stream;
            Unsent { last: AtomicU64::new(u64::MAX) }
        };
        u
    }

    /// No socket (its queue is never known).
    #[cfg(test)]
    fn none() -> Unsent {
        Unsent {
            #[cfg(target_os = "linux")]
            fd: -1,
            last: AtomicU64::new(u64::MAX),
        }
    }

    /// Notes the queue after a write.
    fn note(&self) {
        self.last.store(self.queued().unwrap_or(u64::MAX), Relaxed);
    }

    /// The send queue holds bytes and fewer than after the last write or look (the client read
    /// some since). Always `false` where the queue cannot be read (then the idle time counts
    /// from the last write alone).
    fn drained(&self) -> bool {
        let Some(now) = self.queued() else { return false };
        let before = self.last.swap(now, Relaxed);
        now > 0 && now < before
    }

    #[cfg(target_os = "linux")]
    fn queued(&self) -> Option<u64> {
        let mut n: libc::c_int = 0;
        // SAFETY: `fd` is the connection's socket, open while its `Watch` is in use (the stream
        // is owned by the hyper connection of the same task, which outlives every look);
        // SIOCOUTQ (= TIOCOUTQ) writes one int.
        let r = unsafe { libc::ioctl(self.fd, libc::TIOCOUTQ, &mut n) };
        (r == 0 && n >= 0).then_some(n as u64)
    }

    #[cfg(not(target_os = "linux"))]
    fn queued(&self) -> Option<u64> {
        None
    }
}

/// Waiting for the first request's head (since the connection started).
const FRESH: u8 = 0;
/// A kept-alive connection waiting for the first byte of its next request.
const IDLE: u8 = 1;
/// Receiving a later request's head (since its first byte).
const HEAD: u8 = 2;
/// A request in flight: no timeout applies.
const BUSY: u8 = 3;

/// The phase of one connection and since when (milliseconds after `start`).
struct Watch {
    start: Instant,
    phase: AtomicU8,
    since_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Woken when the last request in flight ends (the deadline comes back).
    idle: Notify,
    /// The socket's send queue: draining is progress too.
    unsent: Unsent,
}

impl Watch {
    fn new(unsent: Unsent) -> Watch {
        Watch {
            start: Instant::now(),
            phase: AtomicU8::new(FRESH),
            since_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            unsent,
        }
    }

    fn mark(&self, phase: u8) {
        self.since_ms.store(self.start.elapsed().as_millis() as u64, Relaxed);
        self.phase.store(phase, Relaxed);
    }

    /// Bytes arrived.
    fn read(&self) {
        if self.phase.load(Relaxed) == IDLE {
            self.mark(HEAD);
        }
    }

    /// Bytes were written. While idle these are the rest of a response whose body has ended (a
    /// slow reader still receiving it): the idle time counts from the last progress, so a
    /// response is never cut while the client keeps reading, and one the client stopped reading
    /// is closed an idle timeout after its last progress.
    fn wrote(&self) {
        if self.phase.load(Relaxed) == IDLE {
            self.mark(IDLE);
            self.unsent.note();
        }
    }

    fn deadline(&self, limits: &Limits) -> Option<Instant> {
        let since = self.start + Duration::from_millis(self.since_ms.load(Relaxed));
        match self.phase.load(Relaxed) {
            FRESH | HEAD => Some(since + limits.header_timeout),
            IDLE => Some(since + limits.idle_timeout),
            _ => None,
        }
    }

    /// Which timeout has passed, if one has.
    fn expired(&self, limits: &Limits) -> Option<&'static str> {
        let deadline = self.deadline(limits)?;
        (Instant::now() >= deadline).then(|| if self.phase.load(Relaxed) == IDLE { "idle" } else { "header" })
    }
}

/// A request in flight, from its head until its response body is dropped.
struct Busy(Arc<Watch>);

impl Busy {
    fn begin(watch: &Arc<Watch>) -> Busy {
        watch.in_flight.fetch_add(1, Relaxed);
        watch.phase.store(BUSY, Relaxed);
        Busy(watch.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Relaxed) == 1 {
            self.0.mark(IDLE);
            self.0.idle.notify_one();
        }
    }
}

/// A response body that keeps its request in flight until hyper drops it (after its end).
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that ends with [`BodyTimeout`] when the handler has waited `timeout` for its
/// next bytes (a client that announced a body and stopped sending it, or never started). The
/// timer runs only while the body is polled and not ready, so a handler that reads the body
/// late, or a body already received, never times out; its sleep is allocated on the first wait.
struct Receiving {
    body: Incoming,
    timeout: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The sleep is set for the current wait.
    armed: bool,
    /// Set once the body has been read to its end.
    ended: Arc<AtomicBool>,
}

impl Receiving {
    fn new(body: Incoming, timeout: Duration, ended: Arc<AtomicBool>) -> Receiving {
        Receiving { body, timeout, sleep: None, armed: false, ended }
    }
}

impl HttpBody for Receiving {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let me = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut me.body).poll_frame(cx) {
            me.armed = false;
            if frame.is_none() || me.body.is_end_stream() {
                me.ended.store(true, Relaxed);
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = Instant::now() + me.timeout;
        let sleep = me.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !me.armed {
            sleep.as_mut().reset(deadline);
            me.armed = true;
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                metrics::counter!("baton_http_connections_timed_out_total", "reason" => "body").increment(1);
                Poll::Ready(Some(Err(Box::new(BodyTimeout { after: me.timeout }))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The connection's socket, telling the watch when bytes arrive.
struct Watched {
    io: TcpStream,
    watch: Arc<Watch>,
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut me.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            me.watch.read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            me.watch.wrote();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            me.watch.wrote();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_address_names_the_flag() {
        let addr: SocketAddr = "127.0.0.1:7700".parse().unwrap();
        let e = io::Error::from(io::ErrorKind::AddrInUse);
        let m = bind_error(addr, "--listen", "or BATON_LISTEN", &e);
        assert_eq!(
            m,
            "cannot listen on 127.0.0.1:7700: the address is already in use (another baton or another program listens there); stop that process, or pick another address with --listen (or BATON_LISTEN), e.g. --listen 127.0.0.1:7701"
        );
    }

    #[test]
    fn phases_and_deadlines() {
        let conns = Connections {
            header_timeout: Duration::from_millis(20),
            idle_timeout: Duration::from_secs(5),
            max_connections: Some(10),
        };
        let limits = Limits::new(&conns, 16 << 10);
        assert_eq!(limits.hyper_max_headers, 409);
        let w = Arc::new(Watch::new(Unsent::none()));
        assert_eq!(w.deadline(&limits), Some(w.start + Duration::from_millis(20)), "fresh: header timeout");
        let busy = Busy::begin(&w);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!((w.deadline(&limits), w.expired(&limits)), (None, None), "a request in flight has no deadline");
        drop(busy);
        let idle = w.deadline(&limits).unwrap();
        assert!(idle >= Instant::now() + Duration::from_millis(4900), "idle: idle timeout from the response's end");
        w.read();
        let head = w.deadline(&limits).unwrap();
        assert!(head <= Instant::now() + Duration::from_millis(20), "a later head: header timeout from its first byte");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(w.expired(&limits), Some("header"));
    }
}
