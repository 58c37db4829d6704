//! The load generator's HTTP client: hyper's low-level HTTP/1.1 client connection
//! (`hyper::client::conn::http1`), one keep-alive TCP connection per in-flight request slot (its
//! `Connection` driven by a spawned task), no pool. A [`Req`] holds the parsed parts of a request
//! (method, URI, headers, body as `Bytes`); each send builds an `http::Request` from them (a few
//! reference-count increments and a small header map) and reads the whole response body with
//! `BodyExt::collect`. It costs 10–12 µs of CPU per request against `baton serve` (about 20 µs
//! against the Node reference, whose responses are chunked).

use std::io;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{HeaderName, HeaderValue, HOST};
use hyper::{HeaderMap, Method, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A request, parsed once; [`Conn::send`] builds an `http::Request` from it per call.
#[derive(Clone)]
pub struct Req {
    method: Method,
    uri: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

impl Req {
    /// `method path` on `host`, with `headers` (`name: value`) and `body`.
    pub fn new(method: &str, host: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Req {
        let mut hs = vec![(HOST, HeaderValue::from_str(host).expect("host is a header value"))];
        hs.extend(headers.iter().map(|(k, v)| {
            (
                HeaderName::from_bytes(k.as_bytes()).expect("header name"),
                HeaderValue::from_str(v).expect("header value"),
            )
        }));
        Req {
            method: method.parse().expect("method"),
            uri: path.parse().expect("request path"),
            headers: hs,
            body: Bytes::copy_from_slice(body),
        }
    }

    fn build(&self) -> Request<Full<Bytes>> {
        let mut b = Request::builder().method(self.method.clone()).uri(self.uri.clone());
        for (k, v) in &self.headers {
            b = b.header(k, v);
        }
        b.body(Full::new(self.body.clone())).expect("valid request")
    }
}

/// Splits `http://host:port/prefix` into (`host:port`, `/prefix`).
pub fn split_url(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").expect("only http:// URLs");
    match rest.find('/') {
        Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        None => (rest.to_string(), String::new()),
    }
}

/// One keep-alive connection (hyper's `SendRequest`; its `Connection` runs in a spawned task);
/// reconnects when the server closed it. Keeps the headers and body of the last response.
pub struct Conn {
    addr: String,
    sender: Option<SendRequest<Full<Bytes>>>,
    headers: HeaderMap,
    body: Bytes,
}

fn other(e: hyper::Error) -> io::Error {
    io::Error::other(e)
}

impl Conn {
    pub fn new(addr: &str) -> Conn {
        Conn { addr: addr.to_string(), sender: None, headers: HeaderMap::new(), body: Bytes::new() }
    }

    async fn connect(&self) -> io::Result<SendRequest<Full<Bytes>>> {
        let tcp = TcpStream::connect(&self.addr).await?;
        tcp.set_nodelay(true)?;
        let (sender, conn) = http1::handshake(TokioIo::new(tcp)).await.map_err(other)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// A connection ready for a request: the kept one, or a new one when the server closed it.
    async fn ready(&mut self) -> io::Result<SendRequest<Full<Bytes>>> {
        if let Some(mut s) = self.sender.take() {
            if !s.is_closed() && s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let mut s = self.connect().await?;
        s.ready().await.map_err(other)?;
        Ok(s)
    }

    /// Sends `req` and reads the whole response; returns its status. A request that hyper did
    /// not send (the connection had closed first) is sent once more on a new connection.
    pub async fn send(&mut self, req: &Req) -> io::Result<u16> {
        let mut sender = self.ready().await?;
        let res = match sender.try_send_request(req.build()).await {
            Ok(res) => res,
            Err(e) if e.message().is_some() => {
                sender = self.connect().await?;
                sender.ready().await.map_err(other)?;
                sender.send_request(req.build()).await.map_err(other)?
            }
            Err(e) => return Err(other(e.into_error())),
        };
        let (parts, body) = res.into_parts();
        self.body = body.collect().await.map_err(other)?.to_bytes();
        self.headers = parts.headers;
        self.sender = Some(sender);
        Ok(parts.status.as_u16())
    }

    /// A header of the last response (first of that name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }

    /// The body of the last response.
    pub fn body(&self) -> &[u8] {
        &self.body
    }
}
