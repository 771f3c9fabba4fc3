//! Logits against transformers, on the committed random-weight fixtures: full passes,
//! step-by-step decoding with the KV cache, and batches with padding against single rows.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{Expected, expected, load, max_abs_diff};
use hrm_model::{CausalLm, ForwardBatch, Logits, SeqCache};

const TOLERANCE: f32 = 1e-4;
const FIXTURES: [&str; 4] = ["hrm-text", "hrm-text-prefix", "llama-gqa", "llama-tied"];

fn block_for(model: &dyn CausalLm, prompt_len: usize) -> usize {
    if model.info().prefix_lm {
        prompt_len
    } else {
        0
    }
}

/// One forward pass of `rows` (extending `caches` when given), logits of every position.
fn forward(
    model: &dyn CausalLm,
    rows: &[Vec<u32>],
    blocks: &[usize],
    caches: Vec<&mut SeqCache>,
) -> Tensor {
    pass(model, rows, blocks, caches, Logits::All)
}

fn pass(
    model: &dyn CausalLm,
    rows: &[Vec<u32>],
    blocks: &[usize],
    caches: Vec<&mut SeqCache>,
    logits: Logits,
) -> Tensor {
    let mut batch =
        ForwardBatch::new(rows, blocks, caches, logits, &Device::Cpu, DType::F32).unwrap();
    model.forward(&mut batch).unwrap().logits
}

/// The fixture's prompt as a first pass into `cache`: `[positions, vocab]`, the positions
/// `logits` asks for.
fn prompt_pass(
    model: &dyn CausalLm,
    exp: &Expected,
    cache: &mut SeqCache,
    logits: Logits,
) -> Tensor {
    let prompt = exp.input_ids[..exp.prompt_len].to_vec();
    let block = block_for(model, exp.prompt_len);
    pass(model, &[prompt], &[block], vec![cache], logits)
        .squeeze(0)
        .unwrap()
}

/// The fixture's prompt as a first pass, then each later token as a decode step reading the
/// cache it filled: the logits of the positions `logits` asks for, `[positions, vocab]`, in
/// order. Checks that the cache ends holding every token.
fn prompt_then_steps(model: &dyn CausalLm, exp: &Expected, logits: Logits) -> Tensor {
    let mut cache = SeqCache::for_model(model.info());
    let mut steps = vec![prompt_pass(model, exp, &mut cache, logits)];
    for &token in &exp.input_ids[exp.prompt_len..] {
        steps.push(
            pass(model, &[vec![token]], &[0], vec![&mut cache], logits)
                .squeeze(0)
                .unwrap(),
        );
    }
    assert_eq!(cache.len(), exp.input_ids.len());
    Tensor::cat(&steps, 0).unwrap()
}

#[test]
fn full_pass_matches_transformers() {
    for name in FIXTURES {
        let loaded = load(name);
        let model = loaded.model.as_ref();
        let exp = expected(name);
        let block = block_for(model, exp.prompt_len);
        let logits = forward(
            model,
            std::slice::from_ref(&exp.input_ids),
            &[block],
            Vec::new(),
        )
        .squeeze(0)
        .unwrap();
        let diff = max_abs_diff(&logits, &exp.logits_full);
        assert!(
            diff < TOLERANCE,
            "{name}: full pass differs from transformers by {diff}"
        );
    }
}

#[test]
fn stepwise_decoding_matches_transformers() {
    for name in FIXTURES {
        let loaded = load(name);
        let model = loaded.model.as_ref();
        let exp = expected(name);
        let logits = prompt_then_steps(model, &exp, Logits::All);
        let diff = max_abs_diff(&logits, &exp.logits_stepwise);
        assert!(
            diff < TOLERANCE,
            "{name}: stepwise decoding differs from transformers by {diff}"
        );
        // And the cached decode agrees with our own full pass.
        let block = block_for(model, exp.prompt_len);
        let full = forward(
            model,
            std::slice::from_ref(&exp.input_ids),
            &[block],
            Vec::new(),
        )
        .squeeze(0)
        .unwrap();
        let diff = max_abs_diff(&logits, &full);
        assert!(
            diff < TOLERANCE,
            "{name}: incremental decoding differs from the full pass by {diff}"
        );
    }
}

/// A prompt's first pass reads no cache and runs attention as one op over its own tokens; a
/// later pass of several tokens reads the cache through the general path. Both against
/// transformers.
#[test]
fn continuation_of_several_tokens_in_one_pass_matches_transformers() {
    for name in FIXTURES {
        let loaded = load(name);
        let model = loaded.model.as_ref();
        let exp = expected(name);
        let mut cache = SeqCache::for_model(model.info());
        let rest = exp.input_ids[exp.prompt_len..].to_vec();
        assert!(rest.len() > 1, "{name}: the fixture continues its prompt");
        let first = prompt_pass(model, &exp, &mut cache, Logits::All);
        let second = forward(model, &[rest], &[0], vec![&mut cache]);
        assert_eq!(cache.len(), exp.input_ids.len());
        let logits = Tensor::cat(&[first, second.squeeze(0).unwrap()], 0).unwrap();
        let diff = max_abs_diff(&logits, &exp.logits_stepwise);
        assert!(
            diff < TOLERANCE,
            "{name}: prompt then continuation differs from transformers by {diff}"
        );
    }
}

#[test]
fn prefix_lm_prompt_is_bidirectional() {
    // With prefix_lm, a later prompt token changes the logits at an earlier prompt position;
    // without it, it cannot. This guards against a mask that silently ignores the block.
    let exp = expected("hrm-text-prefix");
    let loaded = load("hrm-text-prefix");
    let model = loaded.model.as_ref();
    let p = exp.prompt_len;
    let mut changed = exp.input_ids[..p].to_vec();
    changed[p - 1] = (changed[p - 1] + 1) % 256;
    let a = forward(model, &[exp.input_ids[..p].to_vec()], &[p], Vec::new());
    let b = forward(model, &[changed.clone()], &[p], Vec::new());
    assert!(max_abs_diff(&a.i((0, 0)).unwrap(), &b.i((0, 0)).unwrap()) > 1e-3);
    let a = forward(model, &[exp.input_ids[..p].to_vec()], &[0], Vec::new());
    let b = forward(model, &[changed], &[0], Vec::new());
    assert!(max_abs_diff(&a.i((0, 0)).unwrap(), &b.i((0, 0)).unwrap()) < 1e-6);
}

#[test]
fn padded_batch_matches_single_rows() {
    for name in FIXTURES {
        let loaded = load(name);
        let model = loaded.model.as_ref();
        let exp = expected(name);
        let long = exp.input_ids[..9].to_vec();
        let short = exp.input_ids[3..7].to_vec();
        let blocks = [block_for(model, long.len()), block_for(model, short.len())];

        // Each row alone: prefill, then two decode steps.
        let mut alone = Vec::new();
        for (row, block) in [(&long, blocks[0]), (&short, blocks[1])] {
            let mut cache = SeqCache::for_model(model.info());
            let prefill = forward(model, std::slice::from_ref(row), &[block], vec![&mut cache]);
            let last = prefill.i((0, row.len() - 1)).unwrap();
            let step1 = forward(model, &[vec![11]], &[0], vec![&mut cache])
                .i((0, 0))
                .unwrap();
            let step2 = forward(model, &[vec![42]], &[0], vec![&mut cache])
                .i((0, 0))
                .unwrap();
            alone.push([last, step1, step2]);
        }

        // Both rows in one batch; the short one is left-padded at prefill.
        let (mut c0, mut c1) = (
            SeqCache::for_model(model.info()),
            SeqCache::for_model(model.info()),
        );
        let prefill = forward(
            model,
            &[long.clone(), short.clone()],
            &blocks,
            vec![&mut c0, &mut c1],
        );
        let seq_len = long.len();
        let step1 = forward(
            model,
            &[vec![11], vec![11]],
            &[0, 0],
            vec![&mut c0, &mut c1],
        );
        let step2 = forward(
            model,
            &[vec![42], vec![42]],
            &[0, 0],
            vec![&mut c0, &mut c1],
        );
        for (row, single) in alone.iter().enumerate() {
            let batched = [
                prefill.i((row, seq_len - 1)).unwrap(),
                step1.i((row, 0)).unwrap(),
                step2.i((row, 0)).unwrap(),
            ];
            for (step, (a, b)) in single.iter().zip(&batched).enumerate() {
                let diff = max_abs_diff(a, b);
                assert!(
                    diff < TOLERANCE,
                    "{name}: row {row} step {step} differs batched vs alone by {diff}"
                );
            }
        }
        assert_eq!((c0.len(), c1.len()), (long.len() + 2, short.len() + 2));
    }
}

/// A generation asks for the last position's logits only, and the model's final block then
/// runs its output projection and feed-forward half on that position alone. The prompt's pass
/// and the decode steps that read the cache it filled, against transformers; and a padded
/// batch's rows against their own full passes.
#[test]
fn generation_passes_match_transformers() {
    for name in FIXTURES {
        let loaded = load(name);
        let model = loaded.model.as_ref();
        let exp = expected(name);
        let p = exp.prompt_len;
        let logits = prompt_then_steps(model, &exp, Logits::Last);
        let want = exp
            .logits_stepwise
            .narrow(0, p - 1, exp.input_ids.len() - p + 1)
            .unwrap();
        let diff = max_abs_diff(&logits, &want);
        assert!(
            diff < TOLERANCE,
            "{name}: a generation's passes differ from transformers by {diff}"
        );

        let rows = [exp.input_ids[..p].to_vec(), exp.input_ids[2..p].to_vec()];
        let blocks = rows.each_ref().map(|row| block_for(model, row.len()));
        let last = pass(model, &rows, &blocks, Vec::new(), Logits::Last);
        assert_eq!(last.dims3().unwrap().1, 1);
        for (i, (row, block)) in rows.iter().zip(blocks).enumerate() {
            let full = forward(model, std::slice::from_ref(row), &[block], Vec::new());
            let diff = max_abs_diff(
                &last.i((i, 0)).unwrap(),
                &full.i((0, row.len() - 1)).unwrap(),
            );
            assert!(
                diff < TOLERANCE,
                "{name}: row {i}'s last position in a padded generation pass differs from its own full pass by {diff}"
            );
        }
    }
}
