//! Llama-family baselines: Hugging Face `LlamaForCausalLM` safetensors (grouped-query attention,
//! optionally tied embeddings) and llama.cpp GGUF files, quantised or not.
//!
//! GGUF stores the q and k rows permuted for llama.cpp's interleaved rotary pairs, so GGUF models
//! use [`RopeLayout::Interleaved`] on the stored weights instead of un-permuting them.

use candle_core::quantized::{QTensor, ggml_file, gguf_file};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::cache::ForwardBatch;
use crate::config::ModelFamily;
use crate::config::{self, EosTokenId, ModelConfig, RopeParameters};
use crate::layers::{
    Attention, AttnContext, AttnInput, DecoderLayer, FeedForward, GateUp, Linear, Outputs, RmsNorm,
    RopeLayout, Rotary, SwiGlu,
};
use crate::{CausalLm, Logits, ModelInfo, ModelOutput};

/// `config.json` of a `llama` checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<EosTokenId>,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_hidden_act() -> String {
    "silu".into()
}
fn default_max_position_embeddings() -> usize {
    2048
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}

impl ModelConfig for LlamaConfig {
    fn validate(&self) -> std::result::Result<(), String> {
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only silu)",
                self.hidden_act
            ));
        }
        if self.attention_bias || self.mlp_bias {
            return Err("attention_bias and mlp_bias are not supported".into());
        }
        config::check_rope(&self.rope_parameters)?;
        if self.num_attention_heads == 0 || self.kv_heads() == 0 {
            return Err("num_attention_heads and num_key_value_heads must be at least 1".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        Ok(())
    }
}

impl LlamaConfig {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        config::head_dim(self.head_dim, self.hidden_size, self.num_attention_heads)
    }

    pub fn rope_theta(&self) -> f64 {
        config::rope_theta(&self.rope_parameters, self.rope_theta)
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        config::eos_ids(&self.eos_token_id)
    }
}

/// A `LlamaForCausalLM`, from safetensors or GGUF.
#[derive(Clone, Debug)]
pub struct Llama {
    embed_tokens: candle_nn::Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    info: ModelInfo,
}

impl Llama {
    /// Builds the model from Hugging Face tensor names (`model.layers.{i}...`).
    pub fn new(config: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        config.validate().map_err(candle_core::Error::msg)?;
        let (hidden, heads, kv_heads, head_dim) = (
            config.hidden_size,
            config.num_attention_heads,
            config.kv_heads(),
            config.head_dim(),
        );
        let model = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(config.vocab_size, hidden, model.pp("embed_tokens"))?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let vb = model.pp("layers").pp(i);
                let attn = vb.pp("self_attn");
                let mlp = vb.pp("mlp");
                Ok(DecoderLayer {
                    input_norm: norm(vb.pp("input_layernorm"), hidden, config.rms_norm_eps)?,
                    attn: Attention {
                        input: AttnInput::Split {
                            q: Linear::load(attn.pp("q_proj"), hidden, heads * head_dim)?,
                            k: Linear::load(attn.pp("k_proj"), hidden, kv_heads * head_dim)?,
                            v: Linear::load(attn.pp("v_proj"), hidden, kv_heads * head_dim)?,
                        },
                        o_proj: Linear::load(attn.pp("o_proj"), heads * head_dim, hidden)?,
                        num_heads: heads,
                        num_kv_heads: kv_heads,
                        head_dim,
                    },
                    post_attention_norm: norm(
                        vb.pp("post_attention_layernorm"),
                        hidden,
                        config.rms_norm_eps,
                    )?,
                    mlp: FeedForward::Dense(SwiGlu {
                        gate_up: GateUp::Split {
                            gate: Linear::load(
                                mlp.pp("gate_proj"),
                                hidden,
                                config.intermediate_size,
                            )?,
                            up: Linear::load(mlp.pp("up_proj"), hidden, config.intermediate_size)?,
                        },
                        down: Linear::load(mlp.pp("down_proj"), config.intermediate_size, hidden)?,
                    }),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = norm(model.pp("norm"), hidden, config.rms_norm_eps)?;
        let lm_head = if config.tie_word_embeddings && !vb.contains_tensor("lm_head.weight") {
            Linear::Dense(candle_nn::Linear::new(
                embed_tokens.embeddings().clone(),
                None,
            ))
        } else {
            Linear::load(vb.pp("lm_head"), hidden, config.vocab_size)?
        };
        let rotary = Rotary::new(
            head_dim,
            config.rope_theta(),
            RopeLayout::Halves,
            vb.device(),
        )?;
        Ok(Self::assemble(
            embed_tokens,
            layers,
            final_norm,
            lm_head,
            rotary,
            config.vocab_size,
            config.max_position_embeddings,
            vb.dtype(),
            vb.device(),
        ))
    }

    /// Loads a llama.cpp GGUF file (`general.architecture == "llama"`). Quantised matrices stay
    /// quantised; the token embedding is dequantised for lookups, as in llama.cpp.
    pub fn from_gguf(
        content: &gguf_file::Content,
        reader: &mut std::fs::File,
        device: &Device,
    ) -> crate::Result<(Self, LlamaConfig)> {
        let md = |key: &str| {
            content
                .metadata
                .get(key)
                .ok_or_else(|| candle_core::Error::msg(format!("GGUF metadata {key} is missing")))
        };
        let arch = md("general.architecture")?.to_string()?.clone();
        if arch != "llama" {
            return Err(candle_core::Error::msg(format!(
                "GGUF architecture {arch:?} is not supported (only llama)"
            ))
            .into());
        }
        let u = |key: &str| -> Result<usize> { Ok(md(key)?.to_u32()? as usize) };
        let heads = u("llama.attention.head_count")?;
        let kv_heads = u("llama.attention.head_count_kv")?;
        let hidden = u("llama.embedding_length")?;
        let layers_n = u("llama.block_count")?;
        let eps = md("llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64;
        let theta = md("llama.rope.freq_base")
            .and_then(|v| v.to_f32())
            .unwrap_or(10_000.0) as f64;
        let context = u("llama.context_length").unwrap_or(2048);
        let head_dim = u("llama.rope.dimension_count").unwrap_or(hidden / heads);

        let mut tensor = |name: &str| content.tensor(reader, name, device);
        let embed_q = tensor("token_embd.weight")?;
        let vocab = embed_q.shape().dims()[0];
        let embed = embed_q.dequantize(device)?;
        let embed_tokens = candle_nn::Embedding::new(embed, hidden);
        let mut layers = Vec::with_capacity(layers_n);
        for i in 0..layers_n {
            let mut q = |suffix: &str| tensor(&format!("blk.{i}.{suffix}.weight"));
            let (wq, wk, wv) = (q("attn_q")?, q("attn_k")?, q("attn_v")?);
            let input = match stack_rows(&[&wq, &wk, &wv], device)? {
                Some(qkv) => AttnInput::FusedQkv(Linear::quantized(qkv)?),
                None => AttnInput::Split {
                    q: Linear::quantized(wq)?,
                    k: Linear::quantized(wk)?,
                    v: Linear::quantized(wv)?,
                },
            };
            let o_proj = Linear::quantized(q("attn_output")?)?;
            let (gate, up) = (q("ffn_gate")?, q("ffn_up")?);
            let gate_up = match stack_rows(&[&gate, &up], device)? {
                Some(both) => GateUp::Fused(Linear::quantized(both)?),
                None => GateUp::Split {
                    gate: Linear::quantized(gate)?,
                    up: Linear::quantized(up)?,
                },
            };
            let down = Linear::quantized(q("ffn_down")?)?;
            let attn_norm = tensor(&format!("blk.{i}.attn_norm.weight"))?.dequantize(device)?;
            let ffn_norm = tensor(&format!("blk.{i}.ffn_norm.weight"))?.dequantize(device)?;
            layers.push(DecoderLayer {
                input_norm: RmsNorm::new(Some(attn_norm), hidden, eps, device)?,
                attn: Attention {
                    input,
                    o_proj,
                    num_heads: heads,
                    num_kv_heads: kv_heads,
                    head_dim,
                },
                post_attention_norm: RmsNorm::new(Some(ffn_norm), hidden, eps, device)?,
                mlp: FeedForward::Dense(SwiGlu { gate_up, down }),
            });
        }
        let final_norm = RmsNorm::new(
            Some(tensor("output_norm.weight")?.dequantize(device)?),
            hidden,
            eps,
            device,
        )?;
        // A tied head reuses the embedding's quantised copy rather than reading it again.
        let tied = !content.tensor_infos.contains_key("output.weight");
        let lm_head = Linear::quantized(if tied {
            embed_q
        } else {
            tensor("output.weight")?
        })?;
        let rotary = Rotary::new(head_dim, theta, RopeLayout::Interleaved, device)?;
        let config = LlamaConfig {
            model_type: "llama".into(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: 0,
            num_hidden_layers: layers_n,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv_heads),
            head_dim: Some(head_dim),
            hidden_act: "silu".into(),
            max_position_embeddings: context,
            rms_norm_eps: eps,
            rope_parameters: None,
            rope_theta: Some(theta),
            tie_word_embeddings: tied,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: None,
            eos_token_id: None,
        };
        let mut model = Self::assemble(
            embed_tokens,
            layers,
            final_norm,
            lm_head,
            rotary,
            vocab,
            context,
            DType::F32,
            device,
        );
        if device.is_cpu() {
            // Decode attention reads f16 keys and values in place on the CPU
            // (`decode_attention.rs`); elsewhere the general path would convert the whole cache
            // at every step.
            model.info.cache_dtype = DType::F16;
        }
        Ok((model, config))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        embed_tokens: candle_nn::Embedding,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Linear,
        rotary: Rotary,
        vocab_size: usize,
        max_position_embeddings: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let weight_bytes = layers
            .iter()
            .map(DecoderLayer::weight_bytes_per_token)
            .sum::<usize>()
            + lm_head.weight_bytes();
        let info = ModelInfo {
            family: ModelFamily::Llama,
            vocab_size,
            max_position_embeddings,
            prefix_lm: false,
            cache_slots: layers.len(),
            num_parameters: 0,
            weight_bytes,
            dtype,
            cache_dtype: dtype,
            device: device.clone(),
        };
        Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            info,
        }
    }

    pub(crate) fn set_num_parameters(&mut self, n: usize) {
        self.info.num_parameters = n;
    }
}

/// One quantised matrix holding `parts`' rows one after another, or `None` when their formats
/// or widths differ. A row's product reads only its own blocks, so the stacked product is the
/// parts' products side by side, bit for bit, in one parallel pass instead of one per part: a
/// batch-1 decode step is short enough that each pass's hand-off to the threads shows.
fn stack_rows(parts: &[&QTensor], device: &Device) -> Result<Option<QTensor>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let (_, k) = first.shape().dims2()?;
    let mut bytes = Vec::new();
    let mut rows = 0;
    for part in parts {
        let (part_rows, part_k) = part.shape().dims2()?;
        if part.dtype() != first.dtype() || part_k != k {
            return Ok(None);
        }
        bytes.extend_from_slice(&part.data()?);
        rows += part_rows;
    }
    ggml_file::qtensor_from_ggml(first.dtype(), &bytes, vec![rows, k], device).map(Some)
}

fn norm(vb: VarBuilder, hidden: usize, eps: f64) -> Result<RmsNorm> {
    let weight = vb.get_with_hints(hidden, "weight", candle_nn::Init::Const(1.0))?;
    RmsNorm::new(Some(weight), hidden, eps, vb.device())
}

impl CausalLm for Llama {
    fn forward(&self, batch: &mut ForwardBatch<'_>) -> Result<ModelOutput> {
        let dtype = self.info.dtype;
        let (cos, sin) = self.rotary.angles(batch, dtype)?;
        let ctx = AttnContext {
            cos: &cos,
            sin: &sin,
            rotary: &self.rotary,
        };
        let mut x = self.embed_tokens.forward(&batch.input_ids)?;
        let outputs = Outputs::for_logits(batch.logits);
        for (slot, layer) in self.layers.iter().enumerate() {
            let layer_outputs = outputs.for_block(slot, self.layers.len());
            x = layer.forward(&x, batch, &ctx, slot, layer_outputs)?.0;
        }
        batch.commit();
        let hidden = self.norm.forward(&x)?;
        let logits = if batch.logits == Logits::Hidden {
            hidden
        } else {
            self.lm_head.forward(&hidden)?
        };
        Ok(ModelOutput {
            logits,
            aux_loss: None,
        })
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn lm_head_weight(&self) -> Option<&Tensor> {
        self.lm_head.dense_weight()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QMatMul};
    use candle_core::{Device, Module, Tensor};

    use super::*;

    fn quantized(rows: usize, k: usize, dtype: GgmlDType, seed: u64) -> QTensor {
        let w = Tensor::rand(-1f32, 1.0, (rows, k), &Device::Cpu)
            .unwrap()
            .affine(1.0, seed as f64 * 1e-3)
            .unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    /// The stacked matrix gives each part's outputs, bit for bit, side by side, at batch 1 (a
    /// decode step) and over several positions (prefill).
    #[test]
    fn stacked_rows_give_the_parts_outputs() {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let parts = [quantized(96, 64, dtype, 1), quantized(32, 64, dtype, 2)];
            let stacked = stack_rows(&[&parts[0], &parts[1]], &Device::Cpu)
                .unwrap()
                .expect("same format and width");
            let stacked = QMatMul::from_qtensor(stacked).unwrap();
            let parts = parts.map(|p| QMatMul::from_qtensor(p).unwrap());
            for positions in [1, 5] {
                let x = Tensor::rand(-1f32, 1.0, (2, positions, 64), &Device::Cpu).unwrap();
                let separate: Vec<Tensor> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
                let expected = Tensor::cat(&separate, 2).unwrap();
                let got = stacked.forward(&x).unwrap();
                let bits = |t: &Tensor| -> Vec<u32> {
                    let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                    values.into_iter().map(f32::to_bits).collect()
                };
                assert_eq!(
                    bits(&got),
                    bits(&expected),
                    "{dtype:?}, {positions} positions"
                );
            }
        }
    }

    #[test]
    fn parts_of_other_formats_or_widths_stay_apart() {
        let q4 = quantized(32, 64, GgmlDType::Q4_1, 3);
        let q8 = quantized(32, 64, GgmlDType::Q8_0, 4);
        let wide = quantized(32, 128, GgmlDType::Q4_1, 5);
        assert!(stack_rows(&[&q4, &q8], &Device::Cpu).unwrap().is_none());
        assert!(stack_rows(&[&q4, &wide], &Device::Cpu).unwrap().is_none());
    }
}
