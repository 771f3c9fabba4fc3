//! The OpenAI-compatible routes as OpenAI's clients use them: streamed completions in OpenAI's
//! chunk format, `n` samples, fields that are not implemented named in a 400, and chat
//! completions rendered with a chat template, streamed or not. Over real HTTP on 127.0.0.1 with
//! the tiny fixture models; the official `openai` package drives the real SmolLM2 GGUF in
//! `crates/hrm-cli/tests/openai_client.rs`.

mod common;

use common::{Server, config, reference_engine};
use serde_json::{Value, json};

/// The `data:` payloads of a server-sent event stream, `[DONE]` included.
async fn stream(server: &Server, path: &str, body: Value) -> Vec<String> {
    let r = server.post_response(path, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let text = r.text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn parse_chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_completions_add_up_to_the_plain_answer() {
    let server = Server::start(config("llama-gqa")).await;
    let body =
        json!({"prompt": ["Call me", "It was a dark"], "max_tokens": 8, "temperature": 0, "n": 2});
    let (status, plain) = server.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{plain}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = parse_chunks(&stream(&server, "/v1/completions", streamed).await);

    let id = &chunks[0]["id"];
    let mut texts = vec![String::new(); 4];
    let mut finished = vec![Value::Null; 4];
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(
            (&c["id"], c["object"].as_str()),
            (id, Some("text_completion"))
        );
        assert!(c["usage"].is_null(), "usage only on the last chunk: {c}");
        for choice in c["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            texts[i].push_str(choice["text"].as_str().unwrap());
            if !choice["finish_reason"].is_null() {
                finished[i] = choice["finish_reason"].clone();
            }
        }
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], plain["usage"]);
    for (i, choice) in plain["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(texts[i], choice["text"].as_str().unwrap(), "choice {i}");
        assert_eq!(finished[i], choice["finish_reason"], "choice {i}");
    }
    // n samples of a prompt sit side by side: choices 0 and 1 are "Call me" (greedy, so equal).
    assert_eq!(texts[0], texts[1]);

    // With echo, each choice opens with its prompt; without include_usage, no usage field.
    let data = stream(
        &server,
        "/v1/completions",
        json!({"prompt": "Call me", "max_tokens": 4, "temperature": 0, "echo": true, "stream": true}),
    )
    .await;
    let chunks = parse_chunks(&data);
    assert_eq!(chunks[0]["choices"][0]["text"], "Call me");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_samples_are_the_seeded_samples_of_repeated_prompts() {
    let server = Server::start(config("llama-gqa")).await;
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": ["Call me", "It was"], "n": 3, "max_tokens": 6, "temperature": 1, "seed": 7}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let texts: Vec<&str> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 6);
    // Sample i of the request is drawn with seed + i, as /generate draws prompt i.
    let (_, generated) = server
        .post(
            "/generate",
            json!({"prompts": ["Call me", "Call me", "Call me", "It was", "It was", "It was"], "max_tokens": 6, "temperature": 1, "seed": 7}),
        )
        .await;
    assert_eq!(json!(texts), generated["completions"]);
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "three samples at temperature 1 should not all agree: {texts:?}"
    );
    assert_eq!(
        body["usage"]["completion_tokens"],
        generated["usage"]["completion_tokens"]
    );

    // n, echo, logprobs, stop and seed together: every sample has its own log-probabilities.
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": "Call me", "n": 2, "max_tokens": 4, "temperature": 1, "seed": 3, "echo": true, "logprobs": 1, "stop": ["\n"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    for choice in body["choices"].as_array().unwrap() {
        let text = choice["text"].as_str().unwrap();
        assert!(
            text.starts_with("Call me") && !text.contains('\n'),
            "{text:?}"
        );
        let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
        let logprobs = choice["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(tokens.len(), logprobs.len());
        assert!(logprobs[0].is_null() && logprobs[1..].iter().all(|l| l.as_f64().unwrap() <= 0.0));
    }
    // The samples share their prompt, so its echoed log-probabilities are the same.
    let per_prompt = body["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 2;
    let prompt_part =
        |c: &Value| c["logprobs"]["token_logprobs"].as_array().unwrap()[..per_prompt].to_vec();
    assert!(per_prompt >= 2);
    assert_eq!(
        prompt_part(&body["choices"][0]),
        prompt_part(&body["choices"][1])
    );

    // n multiplies the request's budget: 200 samples of a 2000-token prompt are too many tokens.
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"prompt": [vec![5u32; 2000]], "n": 200, "max_tokens": 1}),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("too_many_tokens")),
        "{body}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_that_are_not_implemented_are_named_not_dropped() {
    let server = Server::start(config("llama-gqa")).await;
    for (extra, field) in [
        (json!({"best_of": 3}), "best_of"),
        (json!({"suffix": " the end"}), "suffix"),
        (json!({"logit_bias": {"5": 10}}), "logit_bias"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"frequency_penalty": -1}), "frequency_penalty"),
        (json!({"temperatur": 0.5}), "temperatur"),
        (json!({"n": 0}), "n"),
        (json!({"n": 300}), "n"),
        (json!({"stream": true, "logprobs": 1}), "logprobs"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
    ] {
        let mut body = json!({"prompt": "Call me", "max_tokens": 2});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, answer) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["param"], field, "{body}: {answer}");
    }
    let (_, answer) = server
        .post("/v1/completions", json!({"prompt": "x", "best_of": 2}))
        .await;
    assert_eq!(answer["error"]["code"], "unsupported_field");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("equal to n"),
        "{answer}"
    );
    // Their neutral values change nothing and are accepted, as is `user`, OpenAI's label.
    let (status, answer) = server
        .post(
            "/v1/completions",
            json!({"prompt": "Call me", "max_tokens": 2, "best_of": 2, "n": 2, "suffix": "", "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "me", "suffix": null}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    // Chat names its own.
    let (status, answer) = server
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
        )
        .await;
    assert_eq!((status, &answer["error"]["param"]), (400, &json!("tools")));
    server.stop().await;
}

/// A chat template written for the test: every message as `<role>content`, then `<assistant>`.
fn template_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("chat.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_chat_template_says_so() {
    let server = Server::start(config("hrm-text")).await;
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("no_chat_template"))
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--chat-template"),
        "{body}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_the_template_and_answers_like_completions() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("llama-gqa");
    cfg.chat_template = Some(template_file(&dir));
    let server = Server::start(cfg).await;
    let engine = reference_engine("llama-gqa");
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Call"}, {"type": "text", "text": "me"}]},
    ]);
    let rendered = "<system>Be brief.<user>Call\nme<assistant>";
    let ids = engine.tokenizer().encode(rendered, false).unwrap();

    let (status, chat) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "llama-gqa", "messages": messages, "max_completion_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    let (_, plain) = server
        .post(
            "/v1/completions",
            json!({"prompt": [ids.clone()], "max_tokens": 6, "temperature": 0, "logprobs": 2}),
        )
        .await;
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], plain["choices"][0]["text"]);
    assert_eq!(
        choice["finish_reason"],
        plain["choices"][0]["finish_reason"]
    );
    assert_eq!(chat["usage"], plain["usage"]);
    assert_eq!(chat["usage"]["prompt_tokens"], ids.len());
    // The same log-probabilities, in chat's shape.
    let content = choice["logprobs"]["content"].as_array().unwrap();
    let want = plain["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), want.len());
    for (got, want) in content.iter().zip(want) {
        assert!((got["logprob"].as_f64().unwrap() - want.as_f64().unwrap()).abs() < 1e-6);
        assert_eq!(got["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(
            got["bytes"],
            json!(got["token"].as_str().unwrap().as_bytes())
        );
    }

    // Streamed: a role first, then the content in pieces, a finish reason, the usage.
    let data = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 6, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let chunks = parse_chunks(&data);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut finish = Value::Null;
    for c in &chunks {
        for choice in c["choices"].as_array().unwrap() {
            if let Some(piece) = choice["delta"]["content"].as_str() {
                text.push_str(piece);
            }
            if !choice["finish_reason"].is_null() {
                finish = choice["finish_reason"].clone();
            }
        }
    }
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    assert_eq!(finish, choice["finish_reason"]);
    assert_eq!(chunks.last().unwrap()["usage"], chat["usage"]);

    // The route is counted like the others.
    assert!(
        server
            .metric("hrm_requests_total{route=\"/v1/chat/completions\",status=\"200\"}")
            .await
            >= 2.0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_messages_are_validated_field_by_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("llama-gqa");
    cfg.chat_template = Some(template_file(&dir));
    let server = Server::start(cfg).await;
    for (body, param) in [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2}),
            "max_completion_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "logprobs": true}),
            "logprobs",
        ),
    ] {
        let (status, answer) = server.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{body}: {answer}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_template_that_does_not_compile_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.jinja");
    std::fs::write(&path, "{% for m in messages %}").unwrap();
    let mut cfg = config("llama-gqa");
    cfg.chat_template = Some(path);
    let Err(error) = hrm_serve::load_engine(&cfg) else {
        panic!("a template that does not compile was accepted");
    };
    assert!(
        format!("{error:#}").contains("compiling the chat template"),
        "{error:#}"
    );
}
