//! The model core of HRM: every model family the project serves or trains, on candle.
//!
//! This crate owns
//! - the architectures, one file each with its config beside it:
//!   [`hrm_text`] (Hugging Face `hrm_text`, and our mixture-of-experts `hrm_text_moe` through
//!   [`moe`]) and [`llama`] (Hugging Face `LlamaForCausalLM` safetensors and quantised GGUF);
//! - the building blocks they share ([`layers`]) and the per-sequence KV cache ([`cache`]);
//! - checkpoint and tokenizer loading ([`loader`], [`tokenizer`]) and device selection ([`device`]);
//! - the batched generation and scoring [`engine`] that `hrm serve` and `hrm bench` drive.
//!
//! Every family has exactly one forward pass, [`CausalLm::forward`], used for a full pass, for
//! prefill and decode with a cache, and (with tracked variables) for training.

pub mod cache;
pub mod config;
mod decode_attention;
mod decode_layer;
mod decode_matmul;
pub mod device;
pub mod engine;
pub mod error;
pub mod fused;
pub mod hrm_text;
mod huge_pages;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod moe;
mod quant_matmul;
mod sampling;
mod team;
pub mod tokenizer;
pub mod train;

pub use cache::{ForwardBatch, SeqCache};
pub use config::{ModelConfig, ModelFamily, ModelSpec};
pub use device::{DeviceRequest, select_device};
pub use engine::{Engine, FinishReason, GenerateParams, Generation, TokenLogprob};
pub use error::{Error, Result};
pub use loader::{LoadedModel, load_model};
pub use sampling::largest_logit;
pub use tokenizer::TextTokenizer;

use candle_core::{DType, Device, Tensor};

/// What one forward pass returns.
pub struct ModelOutput {
    /// `[batch, positions, vocab]`: every input position, or only the last one
    /// when the batch asked for [`Logits::Last`]. With [`Logits::Hidden`], the final hidden
    /// states `[batch, positions, hidden]` instead.
    pub logits: Tensor,
    /// The mixture-of-experts load-balancing loss (Switch Transformer style), averaged over
    /// every MoE block invocation of the pass. `None` for dense models.
    pub aux_loss: Option<Tensor>,
}

/// Which positions the caller needs logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every input position (scoring, training).
    All,
    /// Only the last input position of each row (generation).
    Last,
    /// No logits: every position's final hidden state, the head's input, for a loss that
    /// applies the head itself ([`CausalLm::lm_head_weight`]).
    Hidden,
}

/// Static facts about a loaded model that the engine and the services need.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub family: ModelFamily,
    pub vocab_size: usize,
    /// The position range the model was trained for (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// Prompt tokens attend to each other bidirectionally at prefill (HRM-Text `prefix_lm`).
    pub prefix_lm: bool,
    /// KV-cache slots per sequence: one per attention invocation in a forward pass.
    pub cache_slots: usize,
    pub num_parameters: usize,
    /// Bytes of weights read for one decoded token (the memory-bandwidth cost of a step).
    pub weight_bytes: usize,
    pub dtype: DType,
    /// The dtype a sequence's KV cache stores: the activations' dtype, except for GGUF models on
    /// the CPU, whose caches hold f16 as llama.cpp's do (half the bytes a decode step reads).
    pub cache_dtype: DType,
    pub device: Device,
}

/// A causal language model with one forward path.
pub trait CausalLm: Send + Sync {
    /// Runs the model over `batch`. With caches in the batch, new keys and values are appended
    /// to each sequence's cache; without, the pass is a plain full (training or scoring) pass.
    fn forward(&self, batch: &mut ForwardBatch<'_>) -> candle_core::Result<ModelOutput>;

    fn info(&self) -> &ModelInfo;

    /// The language-model head's weight `[vocab, hidden]` when it is a dense matrix, which
    /// training's loss applies to the [`Logits::Hidden`] states itself; `None` for a quantised
    /// head.
    fn lm_head_weight(&self) -> Option<&Tensor>;
}
