//! Batched generation and scoring, shared by every model family.
//!
//! Generation keeps one [`Sequence`] per prompt, each with its own KV cache and its own seeded
//! sampler. [`Engine::step`] advances any set of sequences by one token: new ones are prefilled
//! together (left-padded, masked), running ones decode together. Because batches are rebuilt at
//! every step, sequences can join and leave between steps; [`Engine::generate`] uses that to keep
//! up to `max_batch_size` prompts in flight, and the server's scheduler does the same across
//! requests.
//!
//! Scoring is a teacher-forced full pass. [`Engine::loglikelihood`] encodes context and
//! continuation the way lm-evaluation-harness does: the pair is encoded together and split at the
//! length of the encoded context, with trailing spaces of the context moved to the continuation.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};

use candle_core::{D, DType};

use crate::cache::{ForwardBatch, SeqCache};
use crate::loader::LoadedModel;
use crate::sampling::Sampler;
use crate::tokenizer::TextTokenizer;
use crate::{CausalLm, Error, Logits, ModelInfo, Result};

/// Decoding settings of one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    pub max_tokens: usize,
    /// 0 means greedy decoding.
    pub temperature: f64,
    /// Nucleus sampling mass in (0, 1]; 1 disables the cut.
    pub top_p: f64,
    /// Seeds the sampler; the same seed gives the same output whatever else is batched with it.
    pub seed: Option<u64>,
    /// Output ends before the first occurrence of any of these.
    pub stop: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            temperature: 0.7,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context window is full.
    Length,
}

/// A prompt being generated.
pub struct Sequence {
    prompt: Vec<u32>,
    generated: Vec<u32>,
    text: String,
    cache: SeqCache,
    sampler: Sampler,
    params: GenerateParams,
    finish: Option<FinishReason>,
    truncated: bool,
}

impl Sequence {
    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The output so far, cut before any stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The prompt's token ids (after truncation to the context window).
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt.len()
    }

    /// Tokens generated so far (an end-of-sequence token is not counted).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the prompt lost tokens to the context window.
    pub fn was_truncated(&self) -> bool {
        self.truncated
    }

    pub fn into_generation(self) -> Generation {
        Generation {
            completion_tokens: self.generated.len(),
            prompt_tokens: self.prompt.len(),
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            token_ids: self.generated,
            text: self.text,
        }
    }
}

/// A finished completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: FinishReason,
}

/// The log-probability of one token given everything before it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// Whether the token is the model's top choice at its position.
    pub is_greedy: bool,
    /// The `top_n` most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

/// A teacher-forced row to score: log-probs are returned for `tokens[score_from..]`.
#[derive(Clone, Debug)]
pub struct ScoreRow {
    pub tokens: Vec<u32>,
    pub score_from: usize,
    /// Leading tokens that form a bidirectional block for prefix-LM models (the context).
    pub block: usize,
}

/// The score of a continuation given a context.
#[derive(Clone, Debug, PartialEq)]
pub struct Loglikelihood {
    /// Sum of the continuation tokens' log-probabilities.
    pub logprob: f64,
    /// Whether every continuation token is the greedy choice.
    pub is_greedy: bool,
    pub tokens: Vec<TokenLogprob>,
}

/// Temperatures below this decode greedily (see [`Engine::start`]).
pub const MIN_TEMPERATURE: f64 = 1e-6;

/// Logit elements one scoring pass may materialise (`rows * positions * vocab`): 256 MiB of f32.
const SCORING_LOGITS_BUDGET: usize = 64 << 20;

/// A loaded model with its tokenizer, ready to generate and score.
pub struct Engine {
    model: Box<dyn CausalLm>,
    tokenizer: TextTokenizer,
    context_window: usize,
    name: String,
    format: String,
}

impl Engine {
    /// `context_window` defaults to the model's `max_position_embeddings`.
    pub fn new(loaded: LoadedModel, context_window: Option<usize>) -> Result<Self> {
        let context_window = context_window.unwrap_or(loaded.model.info().max_position_embeddings);
        if context_window < 2 {
            return Err(Error::InvalidInput(format!(
                "context window {context_window} is too small (at least 2 tokens)"
            )));
        }
        Ok(Self {
            model: loaded.model,
            tokenizer: loaded.tokenizer,
            context_window,
            name: loaded.name,
            format: loaded.format,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        self.model.info()
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn format(&self) -> &str {
        &self.format
    }

    pub fn context_window(&self) -> usize {
        self.context_window
    }

    /// Token ids of a prompt, with the tokenizer's special tokens.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, true)
    }

    /// Starts a sequence. A prompt longer than the window keeps its last tokens, leaving room for
    /// `min(max_tokens, context_window / 2)` new ones. An empty prompt starts from the BOS (or
    /// EOS) token, as lm-evaluation-harness does.
    pub fn start(&self, mut prompt: Vec<u32>, params: GenerateParams) -> Sequence {
        if prompt.is_empty() {
            prompt.push(self.start_token());
        }
        let reserve = params.max_tokens.min(self.context_window / 2);
        let budget = self.context_window - reserve;
        let truncated = prompt.len() > budget;
        if truncated {
            prompt.drain(..prompt.len() - budget);
        }
        let seed = params
            .seed
            .unwrap_or_else(|| RandomState::new().hash_one(std::time::Instant::now()));
        // Sampling runs in f32. A p that rounds to 0 there would keep no token at all, and
        // logits divided by a temperature near 0 overflow to infinities; top-p and temperature
        // tending to 0 both keep the likeliest token, which is greedy decoding.
        let sampler = if params.temperature < MIN_TEMPERATURE || (params.top_p as f32) <= 0.0 {
            Sampler::greedy()
        } else {
            Sampler::draw(seed, params.temperature, params.top_p)
        };
        let finish = (params.max_tokens == 0).then_some(FinishReason::Length);
        Sequence {
            prompt,
            generated: Vec::new(),
            text: String::new(),
            cache: SeqCache::for_model(self.info()).with_decode_room(params.max_tokens),
            sampler,
            params,
            finish,
            truncated,
        }
    }

    fn start_token(&self) -> u32 {
        self.tokenizer
            .bos_id()
            .or_else(|| self.tokenizer.eos_ids().first().copied())
            .unwrap_or(0)
    }

    /// Advances every unfinished sequence by one token: new ones are prefilled as one batch and
    /// running ones decode as another.
    pub fn step(&self, seqs: &mut [&mut Sequence]) -> Result<()> {
        let (fresh, running): (Vec<&mut Sequence>, Vec<&mut Sequence>) = seqs
            .iter_mut()
            .filter(|s| !s.is_finished())
            .map(|s| &mut **s)
            .partition(|s| s.cache.is_empty());
        for group in [fresh, running] {
            if !group.is_empty() {
                self.advance(group)?;
            }
        }
        Ok(())
    }

    fn advance(&self, mut group: Vec<&mut Sequence>) -> Result<()> {
        let prefix_lm = self.info().prefix_lm;
        let mut tokens = Vec::with_capacity(group.len());
        let mut blocks = Vec::with_capacity(group.len());
        for seq in &group {
            if seq.cache.is_empty() {
                tokens.push(seq.prompt.clone());
                blocks.push(if prefix_lm { seq.prompt.len() } else { 0 });
            } else {
                // A step that failed after the forward pass leaves a filled cache and no new
                // token: the sequence cannot go on, and fails alone.
                let last = *seq.generated.last().ok_or_else(|| {
                    Error::InvalidInput(
                        "the sequence lost its state in an earlier failed step".into(),
                    )
                })?;
                tokens.push(vec![last]);
                blocks.push(0);
            }
        }
        let info = self.info();
        let caches = group.iter_mut().map(|s| &mut s.cache).collect();
        let mut batch = ForwardBatch::new(
            &tokens,
            &blocks,
            caches,
            Logits::Last,
            &info.device,
            info.dtype,
        )?;
        let logits = self.model.forward(&mut batch)?.logits;
        drop(batch);
        let logits = logits.squeeze(1)?.to_dtype(DType::F32)?;
        for (i, seq) in group.iter_mut().enumerate() {
            let token = seq.sampler.sample(&logits.get(i)?)?;
            self.accept(seq, token)?;
        }
        Ok(())
    }

    fn accept(&self, seq: &mut Sequence, token: u32) -> Result<()> {
        if self.tokenizer.eos_ids().contains(&token) {
            seq.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        seq.generated.push(token);
        seq.text = self.tokenizer.decode(&seq.generated)?;
        if let Some(cut) = seq
            .params
            .stop
            .iter()
            .filter_map(|s| seq.text.find(s.as_str()))
            .min()
        {
            seq.text.truncate(cut);
            seq.finish = Some(FinishReason::Stop);
        } else if seq.generated.len() >= seq.params.max_tokens
            || seq.prompt.len() + seq.generated.len() >= self.context_window
        {
            seq.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Generates a completion for every prompt, in input order, keeping at most
    /// `max_batch_size` of them in flight. Prompt `i` is seeded with `seed + i`.
    pub fn generate(
        &self,
        prompts: &[String],
        params: &GenerateParams,
        max_batch_size: usize,
    ) -> Result<Vec<Generation>> {
        let mut waiting: VecDeque<(usize, Vec<u32>)> = prompts
            .iter()
            .map(|p| self.encode_prompt(p))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .enumerate()
            .collect();
        let mut results: Vec<Option<Generation>> = vec![None; prompts.len()];
        let mut active: Vec<(usize, Sequence)> = Vec::new();
        loop {
            while active.len() < max_batch_size.max(1) {
                let Some((i, ids)) = waiting.pop_front() else {
                    break;
                };
                let mut p = params.clone();
                p.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                active.push((i, self.start(ids, p)));
            }
            if active.is_empty() {
                break;
            }
            let mut refs: Vec<&mut Sequence> = active.iter_mut().map(|(_, s)| s).collect();
            self.step(&mut refs)?;
            let (done, still): (Vec<_>, Vec<_>) =
                active.into_iter().partition(|(_, s)| s.is_finished());
            active = still;
            for (i, seq) in done {
                results[i] = Some(seq.into_generation());
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every prompt finishes"))
            .collect())
    }

    /// Context and continuation token ids, split the way lm-evaluation-harness splits them.
    pub fn split_pair(&self, context: &str, continuation: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let trimmed = context.trim_end_matches(' ');
        let (context, continuation) = if trimmed.len() < context.len() {
            (
                trimmed.to_string(),
                format!("{}{continuation}", &context[trimmed.len()..]),
            )
        } else {
            (context.to_string(), continuation.to_string())
        };
        if context.is_empty() {
            return Ok((
                vec![self.start_token()],
                self.tokenizer.encode(&continuation, false)?,
            ));
        }
        let whole = self
            .tokenizer
            .encode(&format!("{context}{continuation}"), false)?;
        let ctx = self.tokenizer.encode(&context, false)?;
        let split = ctx.len().min(whole.len());
        Ok((whole[..split].to_vec(), whole[split..].to_vec()))
    }

    /// Scores each continuation given its context; see the module docs for the encoding.
    pub fn loglikelihood(
        &self,
        pairs: &[(String, String)],
        max_batch_size: usize,
    ) -> Result<Vec<Loglikelihood>> {
        let prefix_lm = self.info().prefix_lm;
        let rows = pairs
            .iter()
            .map(|(ctx, cont)| {
                let (ctx, cont) = self.split_pair(ctx, cont)?;
                let score_from = ctx.len();
                let mut tokens = ctx;
                tokens.extend(cont);
                Ok(ScoreRow {
                    block: if prefix_lm { score_from } else { 0 },
                    tokens,
                    score_from,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let scored = self.token_logprobs(&rows, 0, max_batch_size)?;
        Ok(scored
            .into_iter()
            .map(|tokens| Loglikelihood {
                logprob: tokens.iter().map(|t| f64::from(t.logprob)).sum(),
                is_greedy: tokens.iter().all(|t| t.is_greedy),
                tokens,
            })
            .collect())
    }

    /// Teacher-forced log-probabilities of `row.tokens[row.score_from..]` for every row, with the
    /// `top_n` best alternatives at each position. Rows longer than the context window lose
    /// tokens from the left.
    pub fn token_logprobs(
        &self,
        rows: &[ScoreRow],
        top_n: usize,
        max_batch_size: usize,
    ) -> Result<Vec<Vec<TokenLogprob>>> {
        let rows: Vec<ScoreRow> = rows
            .iter()
            .map(|r| self.fit_to_window(r))
            .collect::<Result<_>>()?;
        let vocab = self.info().vocab_size;
        let mut results = Vec::with_capacity(rows.len());
        let mut start = 0;
        while start < rows.len() {
            let mut end = start + 1;
            let mut longest = rows[start].tokens.len();
            while end < rows.len() && end - start < max_batch_size.max(1) {
                let longer = longest.max(rows[end].tokens.len());
                if (end + 1 - start) * longer * vocab > SCORING_LOGITS_BUDGET {
                    break;
                }
                longest = longer;
                end += 1;
            }
            results.extend(self.score_batch(&rows[start..end], top_n)?);
            start = end;
        }
        Ok(results)
    }

    fn fit_to_window(&self, row: &ScoreRow) -> Result<ScoreRow> {
        if row.tokens.is_empty() || row.score_from == 0 || row.score_from > row.tokens.len() {
            return Err(Error::InvalidInput(format!(
                "cannot score from token {} of {}: the first scored token needs a token before it",
                row.score_from,
                row.tokens.len()
            )));
        }
        let excess = row.tokens.len().saturating_sub(self.context_window);
        Ok(ScoreRow {
            tokens: row.tokens[excess..].to_vec(),
            score_from: row.score_from.saturating_sub(excess).max(1),
            block: row.block.saturating_sub(excess),
        })
    }

    fn score_batch(&self, rows: &[ScoreRow], top_n: usize) -> Result<Vec<Vec<TokenLogprob>>> {
        let info = self.info();
        let tokens: Vec<Vec<u32>> = rows.iter().map(|r| r.tokens.clone()).collect();
        let blocks: Vec<usize> = rows.iter().map(|r| r.block).collect();
        let mut batch = ForwardBatch::full_pass(&tokens, &blocks, Logits::All, info)?;
        let logits = self.model.forward(&mut batch)?.logits;
        let seq_len = batch.seq_len();
        let mut out = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let padding = seq_len - row.tokens.len();
            // Position p predicts token p + 1.
            let first = padding + row.score_from - 1;
            let count = row.tokens.len() - row.score_from;
            if count == 0 {
                out.push(Vec::new());
                continue;
            }
            let row_logits = logits
                .get(i)?
                .narrow(0, first, count)?
                .to_dtype(DType::F32)?;
            let logprobs: Vec<Vec<f32>> =
                candle_nn::ops::log_softmax(&row_logits, D::Minus1)?.to_vec2()?;
            out.push(
                logprobs
                    .iter()
                    .zip(&row.tokens[row.score_from..])
                    .map(|(lp, &token)| describe_position(lp, token, top_n))
                    .collect(),
            );
        }
        Ok(out)
    }
}

fn describe_position(logprobs: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let best = logprobs
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .unwrap_or(0);
    let top = if top_n == 0 {
        Vec::new()
    } else {
        let mut order: Vec<u32> = (0..logprobs.len() as u32).collect();
        let n = top_n.min(order.len());
        order.select_nth_unstable_by(n - 1, |&a, &b| {
            logprobs[b as usize].total_cmp(&logprobs[a as usize])
        });
        order.truncate(n);
        order.sort_by(|&a, &b| logprobs[b as usize].total_cmp(&logprobs[a as usize]));
        order
            .into_iter()
            .map(|i| (i, logprobs[i as usize]))
            .collect()
    };
    TokenLogprob {
        token,
        logprob: logprobs[token as usize],
        is_greedy: logprobs[best as usize] <= logprobs[token as usize],
        top,
    }
}
