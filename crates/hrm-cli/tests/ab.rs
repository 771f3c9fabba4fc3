//! `hrm bench ab` against three targets: `hrm serve` through its own API, the same server
//! through its OpenAI-compatible route, and a stub that follows TGI's documented
//! `/generate_stream` contract. TGI itself cannot run on this machine (it needs its CUDA
//! server build), so the stub stands in for it and checks what the adapter sends.

use axum::Json;
use axum::response::IntoResponse;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{Process, free_port};

mod support;

async fn serve_fixture() -> (Process, String) {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hrm-text");
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args(["serve", "--device", "cpu", "--port", &port.to_string()])
        .arg("--model-path")
        .arg(&fixture)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Process(child);
    let url = format!("http://127.0.0.1:{port}");
    hrm_wire::install_tls_provider();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = reqwest::get(format!("{url}/readyz")).await
            && r.status().is_success()
        {
            return (server, url);
        }
        assert!(Instant::now() < deadline, "hrm serve did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// TGI's streaming contract: one `data:` event per token, the last one with
/// `generated_text` and `details.generated_tokens`.
async fn tgi_stub(seen: Arc<Mutex<Vec<Value>>>) -> String {
    let app = axum::Router::new().route(
        "/generate_stream",
        axum::routing::post(move |Json(body): Json<Value>| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(body.clone());
                let n = body["parameters"]["max_new_tokens"].as_u64().unwrap_or(1);
                let mut events = String::new();
                for i in 0..n {
                    let last = i + 1 == n;
                    let event = json!({
                        "token": {"id": i, "text": " la", "logprob": -0.5, "special": false},
                        "generated_text": if last { json!(" la".repeat(n as usize)) } else { Value::Null },
                        "details": if last { json!({"finish_reason": "length", "generated_tokens": n}) } else { Value::Null },
                    });
                    events.push_str(&format!("data:{event}\n\n"));
                }
                ([("content-type", "text/event-stream")], events).into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ab_measures_hrm_openai_and_tgi_targets_and_compares_them() {
    let (_server, hrm_url) = serve_fixture().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tgi_url = tgi_stub(seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        [
            json!({"prompt": "The capital of France is", "continuation": " Paris"}),
            json!({"prompt": "Once upon a time", "max_tokens": 4}),
            json!({"prompt": "It was a dark", "temperature": 0.8, "top_p": 0.9, "continuation": " night"}),
        ]
        .map(|v| v.to_string())
        .join("\n"),
    )
    .unwrap();
    let out = dir.path().join("report");
    let output = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args([
            "bench",
            "ab",
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--max-tokens",
            "8",
        ])
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&out)
        .args(["--target", &format!("hrm={hrm_url}")])
        .args([
            "--target",
            &format!("openai={hrm_url},model=hrm-text,name=hrm-openai"),
        ])
        .args(["--target", &format!("tgi={tgi_url}")])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let targets = results["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 3);
    for t in targets {
        assert_eq!(t["requests"], 6, "{t}");
        assert_eq!(t["errors"], 0, "{t}");
        assert!(t["output_tokens_per_s"].as_f64().unwrap() > 0.0, "{t}");
        assert!(
            t["latency_ms"]["p99"].as_f64().unwrap() >= t["latency_ms"]["p50"].as_f64().unwrap()
        );
    }
    // Every target streams here (our OpenAI route too), so each has a time to first token.
    for t in targets {
        assert!(t["ttft_ms"]["p50"].is_number(), "{t}");
    }

    // The same model behind two APIs: identical greedy outputs and log-likelihoods.
    let pair = &results["agreement"][0];
    assert_eq!(pair["a"], "hrm");
    assert_eq!(pair["b"], "hrm-openai");
    assert_eq!(pair["greedy_prompts"], 2);
    assert_eq!(pair["greedy_identical"], 2);
    assert_eq!(pair["scored"], 2);
    assert!(pair["max_abs_ll_diff"].as_f64().unwrap() < 1e-3, "{pair}");
    // TGI cannot score; the stub's greedy text differs from the model's.
    let with_tgi = &results["agreement"][1];
    assert_eq!(with_tgi["scored"], 0);
    assert_eq!(with_tgi["greedy_identical"], 0);

    // What TGI received: one input per request, greedy as do_sample false with neither
    // temperature 0 nor top_p 1, max_tokens as max_new_tokens.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 6);
    for body in seen.iter() {
        assert!(body["inputs"].is_string(), "{body}");
        let p = &body["parameters"];
        match body["inputs"].as_str().unwrap() {
            "It was a dark" => {
                assert_eq!(p["do_sample"], true);
                assert_eq!(p["temperature"], 0.8);
                assert_eq!(p["top_p"], 0.9);
                assert_eq!(p["max_new_tokens"], 8);
            }
            input => {
                assert_eq!(p["do_sample"], false, "{body}");
                assert!(
                    p.get("temperature").is_none() && p.get("top_p").is_none(),
                    "{body}"
                );
                let expected = if input == "Once upon a time" { 4 } else { 8 };
                assert_eq!(p["max_new_tokens"], expected);
            }
        }
    }
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    for row in [
        "| hrm |",
        "| hrm-openai |",
        "| tgi |",
        "hrm vs hrm-openai",
        "![latency](latency.png)",
    ] {
        assert!(report.contains(row), "{row} missing from\n{report}");
    }
    for chart in ["latency.png", "throughput.png"] {
        let bytes = std::fs::read(out.join(chart)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{chart} is not a PNG");
    }
}
