//! Graceful shutdown: stop accepting, finish what is in flight, exit cleanly.
//! (Its own test binary, so that its metrics are its own.)

mod common;

use common::{Server, config};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_in_flight_requests() {
    let mut cfg = config("hrm-text");
    cfg.max_batch_size = 1;
    let server = Server::start(cfg).await;
    let many: Vec<String> = (0..60).map(|i| format!("prompt {i}")).collect();
    let client = server.client.clone();
    let url = format!("{}/generate", server.base);
    let in_flight = tokio::spawn(async move {
        let r = client
            .post(url)
            .json(&json!({"prompts": many, "max_tokens": 24}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    // Shut down once the request is being decoded.
    server.wait_for_metric("hrm_batch_size_count", 1.0).await;
    let base = server.base.clone();
    server.stop().await;
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200, "the in-flight request was cut: {body}");
    assert_eq!(body["completions"].as_array().unwrap().len(), 60);
    assert!(
        reqwest::get(format!("{base}/healthz")).await.is_err(),
        "still accepting after shutdown"
    );
}
