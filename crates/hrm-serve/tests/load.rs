//! The server under careless and hostile load: scoring that must not stop generation, clients
//! that leave, requests larger than their budget, faults in the scheduler, slow clients at
//! shutdown. Each test is an attack on one defence (docs/api.md, "Limits").

mod common;

use std::time::{Duration, Instant};

use common::*;
use hrm_serve::scheduler::Faults;
use serde_json::json;
use tokio::io::AsyncWriteExt;

/// Text of about `words` tokens for the tiny fixtures.
fn text(words: usize, seed: usize) -> String {
    (0..words)
        .map(|i| format!("w{}", (i * 7 + seed) % 13))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_scoring_job_does_not_stop_generation() {
    let mut cfg = config("hrm-text");
    cfg.score_chunk_tokens = 64;
    let server = Server::start(cfg).await;
    let prompts: Vec<String> = (0..256).map(|i| text(20, i)).collect();
    let continuations: Vec<String> = (0..256).map(|i| text(8, i + 1)).collect();
    let scoring = {
        let client = server.client.clone();
        let url = format!("{}/loglikelihood", server.base);
        tokio::spawn(async move {
            let r = client
                .post(url)
                .json(&json!({"prompts": prompts, "continuations": continuations}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            Instant::now()
        })
    };
    // Once scoring is under way, a one-token generation is served between its chunks.
    server.wait_for_queued_tokens(1).await;
    let (status, body) = server
        .post("/generate", json!({"prompts": ["w1 w2"], "max_tokens": 1}))
        .await;
    assert_eq!(status, 200, "{body}");
    let generated = Instant::now();
    let scored = scoring.await.unwrap();
    assert!(
        generated < scored,
        "the one-token generation waited for the whole scoring job"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_stops_when_its_client_leaves() {
    let mut cfg = config("hrm-text");
    cfg.score_chunk_tokens = 16;
    cfg.max_batch_size = 1;
    cfg.max_new_tokens = 500;
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("chat.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    cfg.chat_template = Some(template);
    let server = Server::start(cfg).await;
    let prompts: Vec<String> = (0..256).map(|i| text(40, i)).collect();
    let chat = |stream: bool| json!({"messages": [{"role": "user", "content": text(40, 1)}], "n": 128, "max_tokens": 500, "stream": stream});
    let continuations: Vec<String> = (0..256).map(|i| text(16, i)).collect();
    let long = json!({"prompts": prompts, "max_tokens": 500, "temperature": 0});
    for (path, body, kind) in [
        (
            "/loglikelihood",
            json!({"prompts": prompts, "continuations": continuations}),
            "score",
        ),
        ("/generate", long.clone(), "generate"),
        ("/generate_stream", long, "generate"),
        (
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 500, "temperature": 0}),
            "generate",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 500, "stream": true}),
            "generate",
        ),
        ("/v1/chat/completions", chat(false), "generate"),
        ("/v1/chat/completions", chat(true), "generate"),
        // Echo with log-probabilities scores the prompts after generating nothing.
        (
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 0, "echo": true, "logprobs": 5}),
            "score",
        ),
    ] {
        let metric = format!("hrm_requests_cancelled_total{{kind=\"{kind}\"}}");
        let before = server.metric(&metric).await;
        // A client that sends its request and leaves once the server has taken the work in.
        hrm_wire::install_tls_provider();
        let client = reqwest::Client::new();
        let url = format!("{}{path}", server.base);
        let request = tokio::spawn(async move {
            let response = client.post(url).json(&body).send().await?;
            response.bytes().await
        });
        server.wait_for_queued_tokens(1).await;
        request.abort();
        assert!(
            request.await.unwrap_err().is_cancelled(),
            "{path} finished before its client left"
        );
        server.wait_for_metric(&metric, before + 1.0).await;
        server.wait_for_no_queued_tokens().await;
    }
    // Nothing of theirs is left: a short request is served at once.
    let started = Instant::now();
    let (status, _) = server
        .post("/generate", json!({"prompts": ["w1"], "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(5));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_their_budget_are_refused_before_any_work() {
    let mut cfg = config("hrm-text");
    cfg.max_request_tokens = 4096;
    cfg.max_logprob_entries = 10_000;
    let server = Server::start(cfg).await;
    // 256 prompts of 64 ids with echo and 20 alternatives: a small body, a huge answer.
    let ids: Vec<Vec<u32>> = (0..256).map(|_| vec![5u32; 64]).collect();
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": ids, "max_tokens": 1, "echo": true, "logprobs": 20}),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "too_many_tokens");
    let ids: Vec<Vec<u32>> = (0..40).map(|_| vec![5u32; 64]).collect();
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": ids, "max_tokens": 1, "echo": true, "logprobs": 20}),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "too_many_logprobs");
    assert_eq!(body["error"]["param"], "logprobs");
    let prompts: Vec<String> = (0..100).map(|i| text(30, i)).collect();
    let (status, body) = server
        .post(
            "/loglikelihood",
            json!({"prompts": prompts, "continuations": prompts}),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "too_many_tokens");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_token_budget_answers_429_with_retry_after() {
    let mut cfg = config("hrm-text");
    cfg.score_chunk_tokens = 16;
    cfg.max_queued_tokens = 20_000;
    cfg.max_new_tokens = 100_000;
    let server = Server::start(cfg).await;
    // A long scoring job takes most of the budget ...
    let prompts: Vec<String> = (0..100).map(|i| text(30, i)).collect();
    let first = {
        let client = server.client.clone();
        let url = format!("{}/loglikelihood", server.base);
        let body = json!({"prompts": prompts, "continuations": prompts});
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap().status() })
    };
    server.wait_for_queued_tokens(1).await;
    let held = server.queued_tokens().await as usize;
    // ... so a request that may need more than what is left (its prompt and `room` new
    // tokens) is turned away at once.
    let room = 20_000 - held;
    let body = json!({"prompts": [text(10, 1)], "max_tokens": room});
    let refused = server.post_response("/generate", &body).await;
    assert_eq!(refused.status(), 429);
    let retry: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full");
    assert_eq!(first.await.unwrap(), 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_sequence_fails_alone() {
    let faults = Faults {
        fail_on_token: Some(7),
        ..Faults::default()
    };
    let server = Server::start_with_faults(config("hrm-text"), faults).await;
    let good = server.post(
        "/v1/completions",
        json!({"prompt": [[5, 6, 5]], "max_tokens": 8, "temperature": 0}),
    );
    let bad = server.post(
        "/v1/completions",
        json!({"prompt": [[5, 7, 5]], "max_tokens": 8, "temperature": 0}),
    );
    let ((good_status, good_body), (bad_status, bad_body)) = tokio::join!(good, bad);
    assert_eq!(good_status, 200, "{good_body}");
    assert_eq!(bad_status, 500, "{bad_body}");
    assert_eq!(bad_body["error"]["code"], "internal_error");
    assert_eq!(server.metric("hrm_sequences_failed_total").await, 1.0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_scheduler_is_restarted() {
    let faults = Faults {
        panic_on_token: Some(9),
        ..Faults::default()
    };
    let server = Server::start_with_faults(config("hrm-text"), faults).await;
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": [[5, 9]], "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "scheduler_restarting");
    // The restart is counted once the unwinding has dropped the work in flight, which is
    // also what answered the client, so the count may trail the answer.
    server
        .wait_for_metric("hrm_scheduler_restarts_total", 1.0)
        .await;
    assert_eq!(server.metric("hrm_scheduler_restarts_total").await, 1.0);
    // It is ready again, and serves.
    server.wait_ready().await;
    let (status, _) = server
        .post("/generate", json!({"prompts": ["w1"], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_with_slow_clients_connected() {
    let mut cfg = config("hrm-text");
    cfg.connections.shutdown_timeout = Duration::from_secs(1);
    cfg.connections.header_timeout = Duration::from_secs(60);
    let server = Server::start(cfg).await;
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(server.base.trim_start_matches("http://"))
            .await
            .unwrap();
        s.write_all(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    let started = Instant::now();
    server.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "drain took {:?}",
        started.elapsed()
    );
}

static GAVE_UP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A loop that keeps panicking is not restarted for ever: the service says it is not ready and
/// gives up (in service, the process exits with status 70 for its supervisor).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_that_keeps_panicking_gives_up() {
    let faults = Faults {
        panic_on_token: Some(9),
        give_up: || GAVE_UP.store(true, std::sync::atomic::Ordering::SeqCst),
        ..Faults::default()
    };
    let server = Server::start_with_faults(config("hrm-text"), faults).await;
    for _ in 0..4 {
        let (status, body) = server
            .post(
                "/v1/completions",
                json!({"prompt": [[5, 9]], "max_tokens": 4}),
            )
            .await;
        assert_eq!(status, 503, "{body}");
    }
    server
        .wait_for_metric("hrm_scheduler_restarts_total", 4.0)
        .await;
    assert!(GAVE_UP.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(server.get("/readyz").await.status(), 503);
    let (status, body) = server
        .post("/generate", json!({"prompts": ["w1"], "max_tokens": 1}))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("scheduler_restarting"))
    );
}
