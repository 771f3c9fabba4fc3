//! The service end to end over real HTTP on 127.0.0.1, with the tiny fixture model: the v1
//! contract, errors, continuous batching and backpressure.

mod common;

use common::{Server, config, reference_engine};
use hrm_model::GenerateParams;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness() {
    let server = Server::start(config("hrm-text")).await;
    let r = server
        .client
        .get(format!("{}/healthz", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        (r.status().as_u16(), r.json::<Value>().await.unwrap()),
        (200, json!({"status": "ok"}))
    );
    let r = server
        .client
        .get(format!("{}/readyz", server.base))
        .send()
        .await
        .unwrap();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "ready");
    assert_eq!(body["device"], "cpu");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_returns_completions_in_order_with_usage() {
    let server = Server::start(config("hrm-text-prefix")).await;
    let prompts = [
        "It was a dark and stormy night",
        "Call me",
        "The quick brown fox jumps",
    ];
    let (status, body) = server
        .post(
            "/generate",
            json!({"prompts": prompts, "max_tokens": 10, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let engine = reference_engine("hrm-text-prefix");
    let params = GenerateParams {
        max_tokens: 10,
        temperature: 0.0,
        ..GenerateParams::default()
    };
    let prompts: Vec<String> = prompts.iter().map(|s| s.to_string()).collect();
    let expected = engine.generate(&prompts, &params, 1).unwrap();
    let completions: Vec<String> = serde_json::from_value(body["completions"].clone()).unwrap();
    assert_eq!(
        completions,
        expected.iter().map(|g| g.text.clone()).collect::<Vec<_>>()
    );
    let prompt_tokens: usize = expected.iter().map(|g| g.prompt_tokens).sum();
    let completion_tokens: usize = expected.iter().map(|g| g.completion_tokens).sum();
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_is_capped_at_the_server_maximum() {
    let server = Server::start(config("llama-tied")).await;
    let (status, body) = server
        .post(
            "/generate",
            json!({"prompts": ["Call me"], "max_tokens": 5000, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() <= 24);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loglikelihood_matches_the_engine() {
    let server = Server::start(config("hrm-text-prefix")).await;
    let (status, body) = server
        .post("/loglikelihood", json!({"prompts": ["It was a dark and", "Call"], "continuations": [" stormy night", " me"]}))
        .await;
    assert_eq!(status, 200, "{body}");
    let engine = reference_engine("hrm-text-prefix");
    let pairs = vec![
        ("It was a dark and".to_string(), " stormy night".to_string()),
        ("Call".to_string(), " me".to_string()),
    ];
    let expected = engine.loglikelihood(&pairs, 8).unwrap();
    let ll: Vec<f64> = serde_json::from_value(body["ll"].clone()).unwrap();
    assert_eq!(ll.len(), 2);
    for (got, want) in ll.iter().zip(&expected) {
        assert!(
            (got - want.logprob).abs() < 1e-4,
            "{got} vs {}",
            want.logprob
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_one_error_shape_and_changes_nothing() {
    let server = Server::start(config("hrm-text")).await;
    let cases = [
        ("/generate", json!({"prompts": []}), 400, Some("prompts")),
        (
            "/generate",
            json!({"prompts": ["a"], "temperature": 3}),
            400,
            Some("temperature"),
        ),
        (
            "/generate",
            json!({"prompts": ["a"], "top_p": 0}),
            400,
            Some("top_p"),
        ),
        (
            "/generate",
            json!({"prompts": ["a"], "max_tokens": -2}),
            400,
            Some("max_tokens"),
        ),
        ("/generate", json!({"prompts": "a"}), 422, None),
        ("/generate", json!({"prompt": ["a"]}), 422, None),
        (
            "/loglikelihood",
            json!({"prompts": ["a", "b"], "continuations": ["c"]}),
            400,
            Some("continuations"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, err) = server.post(path, body.clone()).await;
        assert_eq!(got, status, "{path} {body}: {err}");
        let e = &err["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{err}"
        );
        assert!(e["type"].is_string() && e["code"].is_string(), "{err}");
        assert_eq!(e["param"].as_str(), param, "{err}");
    }
    // Too large a body: 413 in the same shape.
    let big = "x".repeat(70 * 1024);
    let (got, err) = server.post("/generate", json!({"prompts": [big]})).await;
    assert_eq!(got, 413, "{err}");
    assert_eq!(err["error"]["code"], "body_too_large");
    // Not JSON at all.
    let r = server
        .client
        .post(format!("{}/generate", server.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    // The server still serves.
    let (ok, _) = server
        .post("/generate", json!({"prompts": ["a"], "max_tokens": 2}))
        .await;
    assert_eq!(ok, 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_batched_without_changing_results() {
    let server = Server::start(config("hrm-text")).await;
    let engine = reference_engine("hrm-text");
    let prompts: Vec<String> = (0..10).map(|i| format!("Call me {i}")).collect();
    let params = GenerateParams {
        max_tokens: 12,
        temperature: 0.0,
        ..GenerateParams::default()
    };
    let requests = prompts.iter().map(|p| {
        server.post(
            "/generate",
            json!({"prompts": [p], "max_tokens": 12, "temperature": 0}),
        )
    });
    let responses = futures::future::join_all(requests).await;
    for (prompt, (status, body)) in prompts.iter().zip(responses) {
        assert_eq!(status, 200);
        let want = engine
            .generate(std::slice::from_ref(prompt), &params, 1)
            .unwrap()
            .remove(0)
            .text;
        assert_eq!(body["completions"][0], want, "{prompt}");
    }
    let metrics = server.metrics_text().await;
    assert!(
        metrics.contains("hrm_batch_size_bucket"),
        "batch sizes are recorded"
    );
    assert!(metrics.contains("hrm_time_to_first_token_seconds_bucket"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_when_backpressure_is_on() {
    let mut cfg = config("hrm-text");
    // About one request's worth of tokens: 40 prompts of a few tokens, 24 new tokens each.
    cfg.max_queued_tokens = 1500;
    cfg.max_batch_size = 1;
    let server = Server::start(cfg).await;
    let many: Vec<String> = (0..40).map(|i| format!("prompt {i}")).collect();
    let requests =
        (0..12).map(|_| server.post("/generate", json!({"prompts": many, "max_tokens": 24})));
    let responses = futures::future::join_all(requests).await;
    let limited: Vec<&Value> = responses
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, b)| b)
        .collect();
    assert!(!limited.is_empty(), "no request was turned away");
    assert!(
        responses.iter().any(|(s, _)| *s == 200),
        "no request was served"
    );
    assert_eq!(limited[0]["error"]["code"], "queue_full");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_tokens_then_the_result() {
    let server = Server::start(config("llama-gqa")).await;
    let body = json!({"prompts": ["Call me", "It was a dark"], "max_tokens": 8, "temperature": 0});
    let (_, plain) = server.post("/generate", body.clone()).await;
    let text = server
        .client
        .post(format!("{}/generate_stream", server.base))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut pieces = [String::new(), String::new()];
    let mut done = None;
    let mut event = "";
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("event: ") {
            event = name;
        } else if let Some(data) = line.strip_prefix("data: ") {
            let data: Value = serde_json::from_str(data).unwrap();
            match event {
                "token" => pieces[data["index"].as_u64().unwrap() as usize]
                    .push_str(data["text"].as_str().unwrap()),
                "done" => done = Some(data),
                other => panic!("unexpected event {other}: {data}"),
            }
        }
    }
    let done = done.expect("a done event");
    assert_eq!(done["completions"], plain["completions"]);
    assert_eq!(done["usage"], plain["usage"]);
    assert_eq!(
        json!(pieces),
        plain["completions"],
        "the streamed pieces add up to the completions"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_completions_with_echo_and_logprobs() {
    let server = Server::start(config("hrm-text-prefix")).await;
    let engine = reference_engine("hrm-text-prefix");
    let prompt = engine.encode_prompt("It was a dark and stormy").unwrap();
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"model": "hrm-text-prefix", "prompt": [prompt.clone()], "max_tokens": 1, "logprobs": 2, "echo": true, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    let lp = &choice["logprobs"];
    let n = prompt.len() + 1;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["text_offset"][0], 0);
    // The prompt's tokens are scored causally, each seeing only the tokens before it; scored
    // inside the prefix-LM block they would see themselves, and the two differ on this model.
    let causal = hrm_model::engine::ScoreRow {
        tokens: prompt.clone(),
        score_from: 1,
        block: 0,
    };
    let in_block = hrm_model::engine::ScoreRow {
        block: prompt.len(),
        ..causal.clone()
    };
    let mut scored = engine.token_logprobs(&[causal, in_block], 2, 1).unwrap();
    let (want, leaked) = (scored.remove(0), scored.remove(0));
    assert!(
        want.iter()
            .zip(&leaked)
            .any(|(a, b)| (a.logprob - b.logprob).abs() > 1e-2),
        "the fixture cannot tell causal from block scoring"
    );
    for (k, w) in want.iter().enumerate() {
        let got = lp["token_logprobs"][k + 1].as_f64().unwrap();
        assert!(
            (got - f64::from(w.logprob)).abs() < 1e-4,
            "token {k}: {got} vs {}",
            w.logprob
        );
        // Two alternatives, unless both decode to the same text (OpenAI's map is keyed by text).
        let top = lp["top_logprobs"][k + 1].as_object().unwrap().len();
        assert!((1..=2).contains(&top), "{top} alternatives");
    }
    // The generated token is scored as generation saw it: after the prompt block.
    let after_block = hrm_model::engine::ScoreRow {
        tokens: prompt.iter().copied().chain([0]).collect(),
        score_from: prompt.len(),
        block: prompt.len(),
    };
    let (greedy, greedy_logprob) =
        engine.token_logprobs(&[after_block], 1, 1).unwrap()[0][0].top[0];
    let got = lp["token_logprobs"][prompt.len()].as_f64().unwrap();
    assert!(
        (got - f64::from(greedy_logprob)).abs() < 1e-4,
        "generated token: {got} vs {greedy_logprob}"
    );
    assert_eq!(
        lp["tokens"][prompt.len()],
        engine.tokenizer().decode_verbatim(&[greedy]).unwrap()
    );
    assert!(
        choice["text"]
            .as_str()
            .unwrap()
            .starts_with(&engine.tokenizer().decode(&prompt).unwrap())
    );
    assert_eq!(body["usage"]["completion_tokens"], 1);

    // Text prompts, a list of them, max_tokens 0 with echo.
    let (status, body) = server
        .post("/v1/completions", json!({"prompt": ["Call me", "The quick"], "max_tokens": 0, "echo": true, "logprobs": 0}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(body["choices"][1]["text"], "The quick");
    // Errors in the same shape.
    let (status, body) = server
        .post("/v1/completions", json!({"model": "gpt-5", "prompt": "hi"}))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (status, body) = server
        .post("/v1/completions", json!({"prompt": "hi", "logprobs": 99}))
        .await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("logprobs"))
    );
    let (status, body) = server
        .post("/v1/completions", json!({"prompt": [[99999]]}))
        .await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("prompt"))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_tokenizer_routes_match_what_lm_eval_expects() {
    let server = Server::start(config("hrm-text")).await;
    let info: Value = server
        .client
        .get(format!("{}/tokenizer_info", server.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let eos = info["eos_token"].as_str().unwrap().to_string();
    let (_, tokens) = server
        .post(
            "/tokenize",
            json!({"prompt": "Call me Ishmael", "add_special_tokens": false}),
        )
        .await;
    let ids = tokens["tokens"].as_array().unwrap().clone();
    assert!(!ids.is_empty());
    let (_, text) = server.post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(text["prompt"], "Call me Ishmael");
    // lm-eval finds the EOS id by tokenising the EOS text: it must be one token.
    let (_, eos_ids) = server
        .post(
            "/tokenize",
            json!({"prompt": eos, "add_special_tokens": false}),
        )
        .await;
    assert_eq!(eos_ids["tokens"], json!([info["eos_token_id"]]));
    let models: Value = server
        .client
        .get(format!("{}/v1/models", server.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "hrm-text");
    assert_eq!(models["data"][0]["prefix_lm"], false);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_auth_guards_everything_but_health() {
    let mut cfg = config("hrm-text");
    cfg.api_key = Some("s3cret-key".into());
    let server = Server::start(cfg).await;
    let url = |p: &str| format!("{}{p}", server.base);
    let c = &server.client;
    assert_eq!(c.get(url("/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(
        c.get(url("/metrics")).send().await.unwrap().status(),
        200,
        "metrics are open by default"
    );
    let body = json!({"prompts": ["Call me"], "max_tokens": 2});
    let r = c.post(url("/generate")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["type"], "authentication_error");
    for wrong in [
        "Bearer s3cret-kez",
        "Bearer s3cret-key-longer",
        "s3cret-key",
        "Basic s3cret-key",
    ] {
        let r = c
            .post(url("/generate"))
            .header("authorization", wrong)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{wrong}");
    }
    let r = c
        .post(url("/generate"))
        .bearer_auth("s3cret-key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(url("/v1/models")).send().await.unwrap().status(), 401);
    server.stop().await;

    let mut cfg = config("hrm-text");
    cfg.api_key = Some("s3cret-key".into());
    cfg.metrics_auth = true;
    let server = Server::start(cfg).await;
    let r = server
        .client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "metrics behind the key when configured");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_is_off_unless_enabled_and_then_only_for_listed_origins() {
    let preflight = |server: &Server, origin: &str| {
        server
            .client
            .request(
                reqwest::Method::OPTIONS,
                format!("{}/generate", server.base),
            )
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .send()
    };
    let server = Server::start(config("hrm-text")).await;
    let r = preflight(&server, "http://allowed.example").await.unwrap();
    assert!(
        r.headers().get("access-control-allow-origin").is_none(),
        "CORS must be off by default"
    );
    server.stop().await;

    let mut cfg = config("hrm-text");
    cfg.enable_cors = true;
    cfg.cors_origins = vec!["http://allowed.example".into()];
    let server = Server::start(cfg).await;
    let r = preflight(&server, "http://allowed.example").await.unwrap();
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "http://allowed.example"
    );
    let r = preflight(&server, "http://evil.example").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manual_test_page_is_served_only_with_ui() {
    let server = Server::start(config("hrm-text")).await;
    assert_eq!(
        server
            .client
            .get(format!("{}/ui", server.base))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    server.stop().await;
    let mut cfg = config("hrm-text");
    cfg.ui = true;
    cfg.api_key = Some("k".into());
    let server = Server::start(cfg).await;
    let r = server
        .client
        .get(format!("{}/ui", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "the page is open even with a key; its calls carry the key"
    );
    let html = r.text().await.unwrap();
    for id in [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "generate",
        "score",
        "output",
        "usage",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "missing #{id}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_model_is_loaded_readyz_says_loading() {
    use tower::ServiceExt;
    let cfg = config("hrm-text");
    let app = hrm_serve::routes::router(hrm_serve::AppState::new(&cfg), &cfg);
    let get = |path: &str| {
        axum::http::Request::get(path)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let r = app.clone().oneshot(get("/readyz")).await.unwrap();
    assert_eq!(r.status(), 503);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap(),
        json!({"status": "loading"})
    );
    assert_eq!(
        app.clone().oneshot(get("/healthz")).await.unwrap().status(),
        200
    );
    let post = axum::http::Request::post("/generate")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"prompts":["hi"]}"#))
        .unwrap();
    let r = app.oneshot(post).await.unwrap();
    assert_eq!(r.status(), 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_cannot_load_ends_the_run_with_the_reason() {
    let mut cfg = config("hrm-text");
    cfg.model_path = "/no/such/checkpoint".into();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = hrm_serve::run(cfg, listener, std::future::pending())
        .await
        .unwrap_err();
    let message = format!("{err:#}");
    assert!(message.contains("/no/such/checkpoint"), "{message}");
}

/// The published OpenAPI document names every route the server answers, with the request
/// schemas that the handlers themselves decode, and every route it names is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_the_served_routes() {
    let mut cfg = config("hrm-text");
    cfg.api_key = Some("the-key".into());
    let server = Server::start(cfg).await;
    // Open, like the health checks: it holds no data.
    let r = server
        .client
        .get(format!("{}/openapi.json", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut paths: Vec<(String, String)> = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            paths.push((method.clone(), path.clone()));
        }
    }
    paths.sort();
    let expected = [
        ("get", "/healthz"),
        ("get", "/metrics"),
        ("get", "/readyz"),
        ("get", "/tokenizer_info"),
        ("get", "/v1/models"),
        ("post", "/detokenize"),
        ("post", "/generate"),
        ("post", "/generate_stream"),
        ("post", "/loglikelihood"),
        ("post", "/tokenize"),
        ("post", "/v1/chat/completions"),
        ("post", "/v1/completions"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(paths, expected);
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "GenerateRequest",
        "LoglikelihoodRequest",
        "CompletionRequest",
        "ChatRequest",
        "ErrorBody",
    ] {
        assert!(schemas.contains_key(name), "no schema {name}");
    }
    let generate = &schemas["GenerateRequest"];
    assert_eq!(generate["required"], json!(["prompts"]));
    // Each named route is served: with the key, none falls through to the 404 of unknown routes.
    for (method, path) in &paths {
        let url = format!("{}{path}", server.base);
        let request = match method.as_str() {
            "get" => server.client.get(url),
            _ => server.client.post(url).json(&json!({})),
        };
        let r = request.bearer_auth("the-key").send().await.unwrap();
        assert_ne!(r.status(), 404, "{method} {path}");
    }
    server.stop().await;
}
