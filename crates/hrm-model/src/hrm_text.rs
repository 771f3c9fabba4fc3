//! HRM-Text (`model_type: hrm_text`), as in transformers' `modeling_hrm_text.py`, and our
//! mixture-of-experts variant (`model_type: hrm_text_moe`).
//!
//! Two transformer stacks of `num_layers_per_stack` blocks each, a slow high-level one (H) and a
//! fast low-level one (L), are applied recurrently:
//!
//! ```text
//! z_H = embed(ids) * embedding_scale        z_L = z_L_init (broadcast)
//! for h in 0..H_cycles:
//!     for l in 0..L_cycles:  z_L = L(z_L + z_H)
//!     z_H = H(z_H + z_L)
//! logits = lm_head(z_H)
//! ```
//!
//! Each stack ends with its own norm; every norm is a weightless RMSNorm; attention has a
//! sigmoid output gate; the MLP is SwiGLU (or, for `hrm_text_moe`, a mixture of SwiGLU experts).
//! Every stack invocation has its own KV-cache slots: invocation `(h, l)` of the L stack uses
//! slots `(h * (L_cycles + 1) + l) * layers + layer`, and the H stack at cycle `h` uses
//! `(h * (L_cycles + 1) + L_cycles) * layers + layer`.
//!
//! During training only the last `L_bp_cycles` low-level iterations of each high-level cycle
//! carry gradients; the earlier ones are detached, as transformers runs them under `no_grad`.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::cache::ForwardBatch;
use crate::config::ModelFamily;
use crate::config::{self, EosTokenId, ModelConfig, RopeParameters};
use crate::layers::{
    Attention, AttnContext, AttnInput, DecoderLayer, FeedForward, GateUp, Linear, Outputs, RmsNorm,
    RopeLayout, Rotary, SwiGlu,
};
use crate::moe::MoeMlp;
use crate::{CausalLm, Logits, ModelInfo, ModelOutput};

/// `config.json` of an `hrm_text` or `hrm_text_moe` checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HrmTextConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// As saved by transformers: the KV-slot count `num_layers_per_stack * H_cycles * (L_cycles + 1)`.
    /// A hand-written config without `num_layers_per_stack` gives the real depth here instead.
    pub num_hidden_layers: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_layers_per_stack: Option<usize>,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    /// transformers < 5 kept `rope_theta` at the top level.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(rename = "H_cycles", default = "default_h_cycles")]
    pub h_cycles: usize,
    #[serde(rename = "L_cycles", default = "default_l_cycles")]
    pub l_cycles: usize,
    #[serde(
        rename = "L_bp_cycles",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub l_bp_cycles: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_scale: Option<f64>,
    #[serde(default = "default_true")]
    pub prefix_lm: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<EosTokenId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    /// `hrm_text_moe` only: experts per block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    /// `hrm_text_moe` only: experts each token is routed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// `hrm_text_moe` only: weight of the load-balancing loss in the training objective.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
}

fn default_hidden_act() -> String {
    "silu".into()
}
fn default_max_position_embeddings() -> usize {
    2048
}
fn default_initializer_range() -> f64 {
    0.02
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_h_cycles() -> usize {
    2
}
fn default_l_cycles() -> usize {
    3
}
fn default_true() -> bool {
    true
}

impl ModelConfig for HrmTextConfig {
    fn validate(&self) -> std::result::Result<(), String> {
        if !matches!(
            ModelFamily::from_model_type(&self.model_type),
            Some(ModelFamily::HrmText | ModelFamily::HrmTextMoe)
        ) {
            return Err(format!(
                "model_type {:?} is not hrm_text or hrm_text_moe",
                self.model_type
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only silu)",
                self.hidden_act
            ));
        }
        if self.attention_bias || self.mlp_bias {
            return Err(
                "attention_bias and mlp_bias are not supported by the hrm_text checkpoint format"
                    .into(),
            );
        }
        if self.num_attention_heads == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err(
                "hidden_size, num_attention_heads and vocab_size must be at least 1".into(),
            );
        }
        if self.h_cycles == 0 || self.l_cycles == 0 {
            return Err("H_cycles and L_cycles must be at least 1".into());
        }
        if self.layers_per_stack() == 0 {
            return Err("num_layers_per_stack must be at least 1".into());
        }
        config::check_rope(&self.rope_parameters)?;
        if self.is_moe() {
            let experts = self.num_experts.unwrap_or(0);
            let top_k = self.num_experts_per_tok.unwrap_or(0);
            if experts == 0 || top_k == 0 || top_k > experts {
                return Err(format!(
                    "hrm_text_moe needs 1 <= num_experts_per_tok ({top_k}) <= num_experts ({experts})"
                ));
            }
        }
        Ok(())
    }
}

impl HrmTextConfig {
    /// `hrm_text` or `hrm_text_moe`, as validated.
    pub fn family(&self) -> ModelFamily {
        ModelFamily::from_model_type(&self.model_type).unwrap_or(ModelFamily::HrmText)
    }

    pub fn is_moe(&self) -> bool {
        self.family() == ModelFamily::HrmTextMoe
    }

    /// The real depth of each stack.
    pub fn layers_per_stack(&self) -> usize {
        self.num_layers_per_stack.unwrap_or(self.num_hidden_layers)
    }

    pub fn head_dim(&self) -> usize {
        config::head_dim(self.head_dim, self.hidden_size, self.num_attention_heads)
    }

    pub fn rope_theta(&self) -> f64 {
        config::rope_theta(&self.rope_parameters, self.rope_theta)
    }

    pub fn embedding_scale(&self) -> f64 {
        self.embedding_scale.unwrap_or(1.0 / self.initializer_range)
    }

    /// KV-cache slots per sequence: one per stack invocation and layer.
    pub fn cache_slots(&self) -> usize {
        self.layers_per_stack() * self.h_cycles * (self.l_cycles + 1)
    }

    /// `L_bp_cycles` left-padded with 1s to one entry per high-level cycle, as transformers does.
    pub fn grad_cycles(&self) -> Vec<usize> {
        let raw = self.l_bp_cycles.clone().unwrap_or_else(|| vec![2]);
        let mut padded = vec![1; self.l_cycles.saturating_sub(raw.len())];
        padded.extend(raw);
        padded
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        config::eos_ids(&self.eos_token_id)
    }
}

/// One of the two recurrent stacks.
#[derive(Clone, Debug)]
struct Stack {
    layers: Vec<DecoderLayer>,
    final_norm: RmsNorm,
}

impl Stack {
    fn load(vb: VarBuilder, cfg: &HrmTextConfig) -> Result<Self> {
        let (hidden, heads, head_dim) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim());
        let norm = || RmsNorm::new(None, hidden, cfg.rms_norm_eps, vb.device());
        let layers = (0..cfg.layers_per_stack())
            .map(|i| {
                let vb = vb.pp("layers").pp(i);
                let attn = Attention {
                    input: AttnInput::FusedGqkv(Linear::load(
                        vb.pp("attn.gqkv_proj"),
                        hidden,
                        4 * heads * head_dim,
                    )?),
                    o_proj: Linear::load(vb.pp("attn.o_proj"), heads * head_dim, hidden)?,
                    num_heads: heads,
                    num_kv_heads: heads,
                    head_dim,
                };
                let mlp = if cfg.is_moe() {
                    FeedForward::Experts(MoeMlp::load(
                        vb.pp("mlp"),
                        hidden,
                        cfg.intermediate_size,
                        cfg.num_experts.unwrap_or(1),
                        cfg.num_experts_per_tok.unwrap_or(1),
                    )?)
                } else {
                    FeedForward::Dense(SwiGlu {
                        gate_up: GateUp::Fused(Linear::load(
                            vb.pp("mlp.gate_up_proj"),
                            hidden,
                            2 * cfg.intermediate_size,
                        )?),
                        down: Linear::load(vb.pp("mlp.down_proj"), cfg.intermediate_size, hidden)?,
                    })
                };
                Ok(DecoderLayer {
                    input_norm: norm()?,
                    attn,
                    post_attention_norm: norm()?,
                    mlp,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            final_norm: norm()?,
        })
    }

    fn forward(
        &self,
        mut x: Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        first_slot: usize,
        outputs: Outputs,
        aux: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let count = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            let (next, layer_aux) =
                layer.forward(&x, batch, ctx, first_slot + i, outputs.for_block(i, count))?;
            aux.extend(layer_aux);
            x = next;
        }
        self.final_norm.forward(&x)
    }
}

/// An `HrmTextForCausalLM` (dense or mixture-of-experts).
#[derive(Clone, Debug)]
pub struct HrmText {
    config: HrmTextConfig,
    embed_tokens: candle_nn::Embedding,
    z_l_init: Tensor,
    low: Stack,
    high: Stack,
    lm_head: Linear,
    rotary: Rotary,
    info: ModelInfo,
}

impl HrmText {
    /// Builds the model from a var builder rooted at the checkpoint's top level (`model.*`,
    /// `lm_head.*`). Works for loading (mmaped safetensors) and for training (a `VarMap`).
    pub fn new(config: HrmTextConfig, vb: VarBuilder) -> Result<Self> {
        config.validate().map_err(candle_core::Error::msg)?;
        let hidden = config.hidden_size;
        let model = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(config.vocab_size, hidden, model.pp("embed_tokens"))?;
        let lm_head = if config.tie_word_embeddings && !vb.contains_tensor("lm_head.weight") {
            Linear::Dense(candle_nn::Linear::new(
                embed_tokens.embeddings().clone(),
                None,
            ))
        } else {
            Linear::load(vb.pp("lm_head"), hidden, config.vocab_size)?
        };
        let z_l_init = model.get(hidden, "z_L_init")?;
        let low = Stack::load(model.pp("L_module"), &config)?;
        let high = Stack::load(model.pp("H_module"), &config)?;
        let rotary = Rotary::new(
            config.head_dim(),
            config.rope_theta(),
            RopeLayout::Halves,
            vb.device(),
        )?;

        let per_token: usize = low
            .layers
            .iter()
            .map(DecoderLayer::weight_bytes_per_token)
            .sum::<usize>()
            * config.h_cycles
            * config.l_cycles
            + high
                .layers
                .iter()
                .map(DecoderLayer::weight_bytes_per_token)
                .sum::<usize>()
                * config.h_cycles;
        let info = ModelInfo {
            family: config.family(),
            vocab_size: config.vocab_size,
            max_position_embeddings: config.max_position_embeddings,
            prefix_lm: config.prefix_lm,
            cache_slots: config.cache_slots(),
            num_parameters: 0,
            weight_bytes: per_token + lm_head.weight_bytes() + hidden * vb.dtype().size_in_bytes(),
            dtype: vb.dtype(),
            cache_dtype: vb.dtype(),
            device: vb.device().clone(),
        };
        Ok(Self {
            config,
            embed_tokens,
            z_l_init,
            low,
            high,
            lm_head,
            rotary,
            info,
        })
    }

    pub fn config(&self) -> &HrmTextConfig {
        &self.config
    }

    pub(crate) fn set_num_parameters(&mut self, n: usize) {
        self.info.num_parameters = n;
    }
}

impl CausalLm for HrmText {
    fn forward(&self, batch: &mut ForwardBatch<'_>) -> Result<ModelOutput> {
        let cfg = &self.config;
        let dtype = self.info.dtype;
        let (cos, sin) = self.rotary.angles(batch, dtype)?;
        let ctx = AttnContext {
            cos: &cos,
            sin: &sin,
            rotary: &self.rotary,
        };
        let layers = cfg.layers_per_stack();
        let mut aux = Vec::new();

        let embeds = self.embed_tokens.forward(&batch.input_ids)?;
        let mut z_high = (embeds * cfg.embedding_scale())?;
        // z_L_init is frozen, as in transformers (`requires_grad=False`).
        let mut z_low = self
            .z_l_init
            .detach()
            .to_dtype(dtype)?
            .broadcast_as(z_high.shape())?
            .contiguous()?;
        let grad_cycles = cfg.grad_cycles();
        for h in 0..cfg.h_cycles {
            // transformers indexes the padded list by the high-level cycle.
            let detached_below = cfg
                .l_cycles
                .saturating_sub(grad_cycles.get(h).copied().unwrap_or(1));
            for l in 0..cfg.l_cycles {
                let slot = (h * (cfg.l_cycles + 1) + l) * layers;
                z_low = self.low.forward(
                    (&z_low + &z_high)?,
                    batch,
                    &ctx,
                    slot,
                    Outputs::All,
                    &mut aux,
                )?;
                if l < detached_below {
                    z_low = z_low.detach();
                }
            }
            let slot = (h * (cfg.l_cycles + 1) + cfg.l_cycles) * layers;
            // Only the final high-level pass's last block may drop positions: every earlier
            // pass's output is the next pass's input at every position.
            let outputs = Outputs::for_logits(batch.logits).for_block(h, cfg.h_cycles);
            z_high =
                self.high
                    .forward((&z_high + &z_low)?, batch, &ctx, slot, outputs, &mut aux)?;
        }
        batch.commit();

        let logits = if batch.logits == Logits::Hidden {
            z_high
        } else {
            self.lm_head.forward(&z_high)?
        };
        let aux_loss = if aux.is_empty() {
            None
        } else {
            let n = aux.len() as f64;
            Some((Tensor::stack(&aux, 0)?.sum_all()? / n)?)
        };
        Ok(ModelOutput { logits, aux_loss })
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn lm_head_weight(&self) -> Option<&Tensor> {
        self.lm_head.dense_weight()
    }
}
