//! A client that goes away loses its sequences; nobody else is affected.
//! (Its own test binary, so that its metrics are its own.)

mod common;

use common::{Server, config};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_clients_sequences_are_dropped() {
    let mut cfg = config("hrm-text");
    cfg.max_batch_size = 1;
    let server = Server::start(cfg).await;
    let many: Vec<String> = (0..200).map(|i| format!("prompt {i}")).collect();
    let client = server.client.clone();
    let url = format!("{}/generate", server.base);
    let doomed = tokio::spawn(async move {
        let _ = client
            .post(url)
            .json(&json!({"prompts": many, "max_tokens": 24}))
            .send()
            .await;
    });
    server.wait_for_metric("hrm_batch_size_count", 1.0).await;
    doomed.abort();
    let _ = doomed.await;
    server
        .wait_for_metric("hrm_sequences_cancelled_total", 1.0)
        .await;
    let finished = server.metric("hrm_generated_tokens_total").await;
    // The scheduler is free again: a new request is served at once.
    let (status, body) = server
        .post(
            "/generate",
            json!({"prompts": ["Call me"], "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        server.metric("hrm_generated_tokens_total").await - finished <= 3.0,
        "the dropped prompts kept decoding"
    );
    server.stop().await;
}
