//! The generation and scoring engine on the tiny HRM-Text fixture: batching, seeds, stop
//! strings, EOS, limits, truncation, and scores against transformers' logits.

mod common;

use candle_core::{D, DType, Device};
use common::{expected, fixture, load};
use hrm_model::engine::ScoreRow;
use hrm_model::{Engine, FinishReason, GenerateParams, LoadedModel, TextTokenizer, load_model};

fn engine(name: &str) -> Engine {
    Engine::new(load(name), None).unwrap()
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        temperature: 0.0,
        ..GenerateParams::default()
    }
}

const PROMPTS: [&str; 3] = [
    "It was a dark and stormy night",
    "The quick brown fox",
    "Call me",
];

#[test]
fn batched_generation_equals_one_at_a_time() {
    for name in ["hrm-text", "hrm-text-prefix", "llama-gqa"] {
        let engine = engine(name);
        let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
        let batched = engine.generate(&prompts, &greedy(12), 8).unwrap();
        for (prompt, together) in prompts.iter().zip(&batched) {
            let alone = engine
                .generate(std::slice::from_ref(prompt), &greedy(12), 1)
                .unwrap();
            assert_eq!(
                &alone[0], together,
                "{name}: {prompt:?} differs when batched"
            );
        }
        // A batch larger than the in-flight limit is served in input order.
        let limited = engine.generate(&prompts, &greedy(12), 2).unwrap();
        assert_eq!(
            limited, batched,
            "{name}: continuous admission changed the output"
        );
    }
}

#[test]
fn seeded_sampling_is_reproducible_whatever_the_batch() {
    let engine = engine("hrm-text");
    let params = GenerateParams {
        max_tokens: 16,
        temperature: 1.0,
        top_p: 0.9,
        seed: Some(7),
        stop: Vec::new(),
    };
    let run = |others: &[&str]| {
        let mut seqs =
            vec![engine.start(engine.encode_prompt(PROMPTS[0]).unwrap(), params.clone())];
        for (i, other) in others.iter().enumerate() {
            let p = GenerateParams {
                seed: Some(100 + i as u64),
                ..params.clone()
            };
            seqs.push(engine.start(engine.encode_prompt(other).unwrap(), p));
        }
        while seqs.iter().any(|s| !s.is_finished()) {
            let mut refs: Vec<_> = seqs.iter_mut().collect();
            engine.step(&mut refs).unwrap();
        }
        seqs.remove(0).into_generation()
    };
    let alone = run(&[]);
    assert_eq!(run(&PROMPTS[1..]), alone);
    assert_eq!(run(&["Some years ago"]), alone);
    // A different seed gives a different sample (16 tokens from a 320-token vocabulary).
    let other = engine
        .generate(
            &[PROMPTS[0].to_string()],
            &GenerateParams {
                seed: Some(8),
                ..params.clone()
            },
            1,
        )
        .unwrap();
    assert_ne!(other[0].token_ids, alone.token_ids);
}

#[test]
fn stop_strings_cut_before_the_stop() {
    let engine = engine("hrm-text");
    let prompt = vec![PROMPTS[0].to_string()];
    let free = engine.generate(&prompt, &greedy(24), 1).unwrap().remove(0);
    assert!(
        free.text.chars().count() > 6,
        "fixture output too short: {:?}",
        free.text
    );
    let stop: String = free.text.chars().skip(3).take(3).collect();
    let params = GenerateParams {
        stop: vec!["this never appears \u{1F600}".into(), stop.clone()],
        ..greedy(24)
    };
    let cut = engine.generate(&prompt, &params, 1).unwrap().remove(0);
    let expected_text = &free.text[..free.text.find(&stop).unwrap()];
    assert_eq!(cut.text, expected_text);
    assert_eq!(cut.finish_reason, FinishReason::Stop);
    assert!(cut.completion_tokens < free.completion_tokens);
}

#[test]
fn max_tokens_bounds_the_output() {
    let engine = engine("llama-tied");
    let out = engine
        .generate(&[PROMPTS[1].to_string()], &greedy(5), 1)
        .unwrap()
        .remove(0);
    assert!(out.completion_tokens <= 5);
    if out.completion_tokens == 5 {
        assert_eq!(out.finish_reason, FinishReason::Length);
    }
    let none = engine
        .generate(&[PROMPTS[1].to_string()], &greedy(0), 1)
        .unwrap()
        .remove(0);
    assert_eq!((none.completion_tokens, none.text.as_str()), (0, ""));
}

#[test]
fn end_of_sequence_ends_generation() {
    // Make the model's first greedy token the EOS token: generation must stop before it.
    let plain = engine("hrm-text");
    let first = plain
        .generate(&[PROMPTS[0].to_string()], &greedy(4), 1)
        .unwrap()[0]
        .token_ids[0];
    let LoadedModel {
        model,
        name,
        format,
        ..
    } = load("hrm-text");
    let tokenizer = TextTokenizer::from_file(
        &fixture("hrm-text").join("tokenizer.json"),
        vec![first],
        None,
    )
    .unwrap();
    let engine = Engine::new(
        LoadedModel {
            model,
            tokenizer,
            name,
            format,
        },
        None,
    )
    .unwrap();
    let out = engine
        .generate(&[PROMPTS[0].to_string()], &greedy(4), 1)
        .unwrap()
        .remove(0);
    assert_eq!(out.completion_tokens, 0);
    assert_eq!(out.finish_reason, FinishReason::Stop);
}

#[test]
fn long_prompts_keep_their_last_tokens() {
    let loaded = load_model(&fixture("hrm-text"), None, &Device::Cpu, DType::F32).unwrap();
    let engine = Engine::new(loaded, Some(16)).unwrap();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(4);
    let ids = engine.encode_prompt(&long).unwrap();
    assert!(ids.len() > 16);
    let seq = engine.start(ids.clone(), greedy(4));
    assert!(seq.was_truncated());
    assert_eq!(
        seq.prompt_tokens(),
        12,
        "16-token window minus the 4 reserved for output"
    );
    let out = engine.generate(&[long], &greedy(40), 1).unwrap().remove(0);
    assert_eq!(
        out.prompt_tokens, 8,
        "half the window is reserved when max_tokens is larger"
    );
    assert!(out.prompt_tokens + out.completion_tokens <= 16);
}

#[test]
fn scores_match_transformers_logits() {
    for name in ["hrm-text", "hrm-text-prefix", "llama-gqa"] {
        let engine = engine(name);
        let exp = expected(name);
        let p = exp.prompt_len;
        let block = if engine.info().prefix_lm { p } else { 0 };
        let row = ScoreRow {
            tokens: exp.input_ids.clone(),
            score_from: p,
            block,
        };
        let ours = engine.token_logprobs(&[row], 3, 8).unwrap().remove(0);
        let reference: Vec<Vec<f32>> = candle_nn::ops::log_softmax(&exp.logits_full, D::Minus1)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(ours.len(), exp.input_ids.len() - p);
        for (k, scored) in ours.iter().enumerate() {
            let pos = p + k;
            let want = reference[pos - 1][exp.input_ids[pos] as usize];
            assert!(
                (scored.logprob - want).abs() < 1e-4,
                "{name} pos {pos}: {} vs {want}",
                scored.logprob
            );
            assert_eq!(scored.top.len(), 3);
            assert!(
                scored.top.windows(2).all(|w| w[0].1 >= w[1].1),
                "top-n not sorted"
            );
            let row_best = reference[pos - 1].iter().cloned().fold(f32::MIN, f32::max);
            assert!((scored.top[0].1 - row_best).abs() < 1e-4);
            assert_eq!(scored.is_greedy, scored.top[0].0 == scored.token);
        }
    }
}

#[test]
fn loglikelihood_is_batch_independent_and_splits_like_lm_eval() {
    let engine = engine("hrm-text-prefix");
    let pairs: Vec<(String, String)> = vec![
        ("It was a dark and stormy".into(), " night".into()),
        (
            "The quick brown fox jumps over the ".into(),
            "lazy dog".into(),
        ),
        ("".into(), "Call me Ishmael".into()),
    ];
    let batched = engine.loglikelihood(&pairs, 8).unwrap();
    for (pair, together) in pairs.iter().zip(&batched) {
        let alone = engine
            .loglikelihood(std::slice::from_ref(pair), 1)
            .unwrap()
            .remove(0);
        assert!((alone.logprob - together.logprob).abs() < 1e-4, "{pair:?}");
        assert!(together.logprob < 0.0 && together.logprob.is_finite());
        let sum: f64 = together.tokens.iter().map(|t| f64::from(t.logprob)).sum();
        assert!((sum - together.logprob).abs() < 1e-9);
    }
    // A trailing space of the context moves to the continuation.
    let (ctx, cont) = engine.split_pair("over the ", "lazy").unwrap();
    let (ctx2, cont2) = engine.split_pair("over the", " lazy").unwrap();
    assert_eq!((ctx, cont), (ctx2, cont2));
    // An empty context scores from the end-of-text token.
    let (ctx, _) = engine.split_pair("", "Call").unwrap();
    assert_eq!(ctx, engine.tokenizer().eos_ids()[..1].to_vec());
}

/// A top-p that rounds to zero in f32 (found by the fuzzer: `top_p: 5e-324` crashed the
/// scheduler) keeps the likeliest token: it decodes greedily.
#[test]
fn a_vanishing_temperature_decodes_greedily() {
    // Found by the API fuzzer: a temperature of 2.2e-311 made the sampler fail.
    let engine = engine("hrm-text");
    let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    for temperature in [2.225073858507e-311, 1e-40, 1e-7] {
        let tiny = GenerateParams {
            max_tokens: 8,
            temperature,
            seed: Some(3),
            ..GenerateParams::default()
        };
        assert_eq!(
            engine.generate(&prompts, &tiny, 4).unwrap(),
            engine.generate(&prompts, &greedy(8), 4).unwrap(),
            "temperature {temperature}"
        );
    }
}

#[test]
fn a_vanishing_top_p_decodes_greedily() {
    let engine = engine("hrm-text");
    let prompts: Vec<String> = PROMPTS.iter().map(|s| s.to_string()).collect();
    let tiny = GenerateParams {
        max_tokens: 8,
        temperature: 1.0,
        top_p: 5e-324,
        seed: Some(3),
        ..GenerateParams::default()
    };
    assert_eq!(
        engine.generate(&prompts, &tiny, 4).unwrap(),
        engine.generate(&prompts, &greedy(8), 4).unwrap()
    );
}
