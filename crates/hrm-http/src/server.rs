//! The accept loop of both servers, with the connection hygiene a public server needs, built
//! from hyper's and tower-http's own means:
//!
//! * a client has `--header-timeout` to send a request's headers (hyper's header read timeout,
//!   which also closes a kept-alive connection that sends nothing for that long: the idle
//!   timeout);
//! * a request body must keep flowing (`--body-timeout` between frames) and end within
//!   `--body-deadline` (tower-http's body timeouts), so a slow-drip upload cannot hold a
//!   connection;
//! * at most `--max-connections` connections are served at once; beyond that, new ones wait
//!   in the listen backlog;
//! * on shutdown (SIGTERM or Ctrl-C) the listener closes, and every connection without a request
//!   in flight closes at once: idle ones, and ones still sending a request's headers (a slow
//!   client must not hold the drain). In-flight requests, streamed responses included, may
//!   finish; whatever is still open after `--shutdown-timeout` is closed.
//!
//! Every request carries the peer address as `ConnectInfo<SocketAddr>` for per-IP limits.

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use clap::Args;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_http::timeout::{RequestBodyDeadlineLayer, RequestBodyTimeoutLayer};

/// The connection flags every server takes.
#[derive(Args, Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ConnectionArgs {
    /// Seconds a client has to send a request's headers; a kept-alive connection idle for this
    /// long is closed (default 15).
    #[arg(long, value_name = "SECONDS")]
    pub header_timeout: Option<u64>,
    /// Seconds a request body may stall between two reads (default 30).
    #[arg(long, value_name = "SECONDS")]
    pub body_timeout: Option<u64>,
    /// Seconds a request body may take in all (default 300).
    #[arg(long, value_name = "SECONDS")]
    pub body_deadline: Option<u64>,
    /// Connections served at once; more wait in the listen backlog (default 512).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds in-flight requests get to finish after SIGTERM or Ctrl-C before their
    /// connections are closed (default 30).
    #[arg(long, value_name = "SECONDS")]
    pub shutdown_timeout: Option<u64>,
}

/// Checked connection limits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ConnectionLimits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub body_deadline: Duration,
    pub max_connections: usize,
    pub shutdown_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(15),
            body_timeout: Duration::from_secs(30),
            body_deadline: Duration::from_secs(300),
            max_connections: 512,
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

impl ConnectionArgs {
    pub fn limits(&self) -> anyhow::Result<ConnectionLimits> {
        let defaults = ConnectionLimits::default();
        let seconds = |value: Option<u64>, default: Duration, flag: &str| match value {
            Some(0) => anyhow::bail!("--{flag} must be at least 1 second"),
            Some(s) => Ok(Duration::from_secs(s)),
            None => Ok(default),
        };
        let limits = ConnectionLimits {
            header_timeout: seconds(
                self.header_timeout,
                defaults.header_timeout,
                "header-timeout",
            )?,
            body_timeout: seconds(self.body_timeout, defaults.body_timeout, "body-timeout")?,
            body_deadline: seconds(self.body_deadline, defaults.body_deadline, "body-deadline")?,
            max_connections: self.max_connections.unwrap_or(defaults.max_connections),
            // 0 is allowed here: close everything at once.
            shutdown_timeout: self
                .shutdown_timeout
                .map_or(defaults.shutdown_timeout, Duration::from_secs),
        };
        anyhow::ensure!(
            limits.max_connections >= 1,
            "--max-connections must be at least 1"
        );
        Ok(limits)
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT), whichever comes first.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("Ctrl-C received"),
        _ = terminate => tracing::info!("SIGTERM received"),
    }
}

/// Requests of one connection that are in flight: from the moment the handler is called until
/// the response body has been sent or dropped.
#[derive(Clone)]
struct InFlight(Arc<tokio::sync::watch::Sender<usize>>);

impl InFlight {
    fn enter(&self) -> InFlightGuard {
        self.0.send_modify(|n| *n += 1);
        InFlightGuard(self.0.clone())
    }
}

struct InFlightGuard(Arc<tokio::sync::watch::Sender<usize>>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// A response body that keeps its request in flight until it is dropped.
struct Tracked {
    body: Body,
    _guard: InFlightGuard,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

async fn track_in_flight(req: Request, next: Next) -> Response {
    let guard = req.extensions().get::<InFlight>().map(InFlight::enter);
    let response = next.run(req).await;
    match guard {
        Some(guard) => response.map(|body| {
            Body::new(Tracked {
                body,
                _guard: guard,
            })
        }),
        None => response,
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module doc).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let app = app
        .layer(RequestBodyDeadlineLayer::new(limits.body_deadline))
        .layer(RequestBodyTimeoutLayer::new(limits.body_timeout))
        .layer(middleware::from_fn(track_in_flight));
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    // Tells connections that have not sent a byte yet that the server is closing.
    let (closing_tx, closing) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Finished connections are reaped as we go, so the set stays as small as the load.
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit.context("connection permits")?,
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (busy, mut idle) = tokio::sync::watch::channel(0usize);
        let in_flight = InFlight(Arc::new(busy));
        let service = app.clone().map_request(
            move |mut req: axum::extract::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req.extensions_mut().insert(in_flight.clone());
                req.map(axum::body::Body::new)
            },
        );
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let mut closing = closing.clone();
        let header_timeout = limits.header_timeout;
        connections.spawn(async move {
            // hyper's header timer starts with the first byte; a client that connects and says
            // nothing gets the same time to start.
            let mut byte = [0u8; 1];
            let first_byte = tokio::select! {
                peeked = tokio::time::timeout(header_timeout, stream.peek(&mut byte)) => {
                    matches!(peeked, Ok(Ok(1..)))
                }
                _ = closing.wait_for(|closing| *closing) => false,
            };
            if first_byte {
                let connection = builder.serve_connection_with_upgrades(
                    TokioIo::new(stream),
                    TowerToHyperService::new(service),
                );
                let connection = watcher.watch(connection.into_owned());
                // Once the server is closing, a connection with no request in flight (idle, or
                // still sending headers) is dropped, which closes it.
                let nothing_in_flight = async {
                    let _ = closing.wait_for(|closing| *closing).await;
                    let _ = idle.wait_for(|requests| *requests == 0).await;
                };
                tokio::select! {
                    ended = connection => if let Err(e) = ended {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    },
                    () = nothing_in_flight => {}
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    let open = graceful.count();
    tracing::info!(
        connections = open,
        deadline_seconds = limits.shutdown_timeout.as_secs(),
        "shutting down: no new connections; in-flight requests may finish"
    );
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = connections.len(),
            "shutdown deadline reached; closing the connections still open"
        );
        connections.abort_all();
    }
    while connections.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use futures::StreamExt;
    use std::net::SocketAddr;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    fn limits(header: u64, body: u64, max_connections: usize, shutdown: u64) -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_secs(header),
            body_timeout: Duration::from_secs(body),
            body_deadline: Duration::from_secs(body * 3),
            max_connections,
            shutdown_timeout: Duration::from_secs(shutdown),
        }
    }

    fn app() -> Router {
        Router::new()
            .route("/", get(|| async { "hello" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    "done"
                }),
            )
            .route(
                "/echo",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
            .route(
                "/stream",
                get(|| async {
                    let pieces = futures::stream::iter(0..10).then(|i| async move {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Ok::<_, std::convert::Infallible>(i.to_string())
                    });
                    Body::from_stream(pieces)
                }),
            )
            .route(
                "/peer",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
            )
    }

    struct Running {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        done: tokio::task::JoinHandle<anyhow::Result<()>>,
    }

    async fn start(limits: ConnectionLimits) -> Running {
        hrm_wire::install_tls_provider();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            serve(listener, app(), &limits, async {
                let _ = stopped.await;
            })
            .await
        });
        Running {
            addr,
            stop: Some(stop),
            done,
        }
    }

    /// Reads until the peer closes the connection; true if it did within `within`.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1024];
        tokio::time::timeout(within, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }

    /// A connection that has been answered `GET /` and is kept alive.
    async fn served_and_kept_alive(addr: SocketAddr) -> TcpStream {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 512];
        let n = conn.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).contains("hello"));
        conn
    }

    #[tokio::test]
    async fn half_sent_headers_are_cut_off_at_the_header_timeout() {
        let server = start(limits(1, 5, 16, 5)).await;
        let mut slow = TcpStream::connect(server.addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        assert!(closed_within(&mut slow, Duration::from_secs(5)).await);
        assert!(started.elapsed() >= Duration::from_millis(900));
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed() {
        let server = start(limits(1, 5, 16, 5)).await;
        let mut conn = served_and_kept_alive(server.addr).await;
        assert!(closed_within(&mut conn, Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn a_stalled_body_is_cut_off() {
        let server = start(limits(5, 1, 16, 5)).await;
        let mut conn = TcpStream::connect(server.addr).await.unwrap();
        conn.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            .await
            .unwrap();
        let mut response = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut response))
            .await
            .expect("the server answers and closes");
        // The handler's body read fails; it never answers 200.
        assert!(!response.contains("200 OK"), "{response}");
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_for_a_free_slot() {
        let server = start(limits(2, 5, 1, 5)).await;
        // The one slot is held by a connection that says nothing.
        let mut holder = TcpStream::connect(server.addr).await.unwrap();
        let client = reqwest::Client::new();
        let url = format!("http://{}/", server.addr);
        let started = Instant::now();
        let answer = client.get(&url).send().await.unwrap().text().await.unwrap();
        assert_eq!(answer, "hello");
        // It was served only once the holder timed out.
        assert!(started.elapsed() >= Duration::from_millis(1500));
        assert!(closed_within(&mut holder, Duration::from_secs(1)).await);
    }

    #[tokio::test]
    async fn requests_know_their_peer_address() {
        let server = start(limits(5, 5, 16, 5)).await;
        let peer = reqwest::get(format!("http://{}/peer", server.addr))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(peer.starts_with("127.0.0.1:"), "{peer}");
    }

    #[tokio::test]
    async fn half_sent_headers_do_not_hold_the_drain() {
        let mut server = start(limits(30, 30, 16, 30)).await;
        let mut slow = Vec::new();
        for _ in 0..5 {
            let mut conn = TcpStream::connect(server.addr).await.unwrap();
            conn.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
            slow.push(conn);
        }
        // A kept-alive connection that has been served and sits idle.
        let _kept = served_and_kept_alive(server.addr).await;
        let started = Instant::now();
        server.stop.take().unwrap().send(()).unwrap();
        server.done.await.unwrap().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the drain waited {:?} for clients with no request in flight",
            started.elapsed()
        );
        for conn in &mut slow {
            assert!(closed_within(conn, Duration::from_secs(1)).await);
        }
    }

    #[tokio::test]
    async fn a_streamed_response_finishes_during_the_drain() {
        let mut server = start(limits(30, 30, 16, 10)).await;
        let url = format!("http://{}/stream", server.addr);
        let response = reqwest::get(url).await.unwrap();
        let started = Instant::now();
        server.stop.take().unwrap().send(()).unwrap();
        // The handler has returned; the body is still streaming, and must arrive whole.
        assert_eq!(response.text().await.unwrap(), "0123456789");
        server.done.await.unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn shutdown_lets_in_flight_requests_finish_and_closes_slow_clients() {
        let mut server = start(limits(30, 30, 16, 3)).await;
        let url = format!("http://{}/slow", server.addr);
        let in_flight = tokio::spawn(async move { reqwest::get(url).await?.text().await });
        // A slow client holding half its headers: the header timeout (30 s) is far away.
        let mut slow = TcpStream::connect(server.addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        server.stop.take().unwrap().send(()).unwrap();
        assert_eq!(in_flight.await.unwrap().unwrap(), "done");
        server.done.await.unwrap().unwrap();
        let took = started.elapsed();
        assert!(
            took <= Duration::from_millis(3800),
            "drain took {took:?}, past the 3 s deadline"
        );
        assert!(closed_within(&mut slow, Duration::from_secs(1)).await);
        // The listener is gone.
        assert!(TcpStream::connect(server.addr).await.is_err());
    }

    #[test]
    fn zero_timeouts_are_refused() {
        let args = ConnectionArgs {
            header_timeout: Some(0),
            ..ConnectionArgs::default()
        };
        assert!(args.limits().is_err());
        assert_eq!(
            ConnectionArgs::default().limits().unwrap(),
            ConnectionLimits::default()
        );
    }
}
