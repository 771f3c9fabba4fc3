//! Tokenizers: a Hugging Face `tokenizer.json`, or the byte-level BPE stored in a GGUF file's
//! metadata, both run by the `tokenizers` crate.

use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::{AddedToken, Tokenizer};

use crate::{Error, Result};

/// A tokenizer plus what generation needs to know about its special tokens.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    eos_ids: Vec<u32>,
    bos_id: Option<u32>,
    /// The BOS token's text, whether or not prompts get it (chat templates write it).
    bos_token: Option<String>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`. End-of-sequence ids come from the model config; when it names
    /// none, from `tokenizer_config.json`'s `eos_token` beside the tokenizer.
    pub fn from_file(path: &Path, config_eos: Vec<u32>, bos_id: Option<u32>) -> Result<Self> {
        let inner = Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        let config = tokenizer_config(path);
        let mut eos_ids = config_eos;
        if eos_ids.is_empty() {
            eos_ids.extend(
                config
                    .as_ref()
                    .and_then(|c| token_of_config(c, "eos_token"))
                    .and_then(|eos| inner.token_to_id(&eos)),
            );
        }
        let bos_token = config
            .as_ref()
            .and_then(|c| token_of_config(c, "bos_token"))
            .or_else(|| bos_id.and_then(|id| inner.id_to_token(id)));
        Ok(Self {
            inner,
            eos_ids,
            bos_id,
            bos_token,
            chat_template: config.as_ref().and_then(chat_template_of_config),
        })
    }

    /// Rebuilds the byte-level BPE (`tokenizer.ggml.model == "gpt2"`) stored in a GGUF file.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = |key: &str| {
            content
                .metadata
                .get(key)
                .ok_or_else(|| Error::Tokenizer(format!("GGUF metadata {key} is missing")))
        };
        let kind = md("tokenizer.ggml.model")?
            .to_string()
            .map_err(|e| Error::Tokenizer(e.to_string()))?
            .clone();
        if kind != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "GGUF tokenizer {kind:?} is not supported (only the byte-level BPE \"gpt2\")"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            md(key)?
                .to_vec()
                .map_err(|e| Error::Tokenizer(e.to_string()))?
                .iter()
                .map(|v| {
                    v.to_string()
                        .cloned()
                        .map_err(|e| Error::Tokenizer(e.to_string()))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("malformed GGUF merge {m:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let token_types: Vec<i32> = match md("tokenizer.ggml.token_type") {
            Ok(v) => v
                .to_vec()
                .map_err(|e| Error::Tokenizer(e.to_string()))?
                .iter()
                .map(|t| t.to_i32().unwrap_or(1))
                .collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner.with_post_processor(Some(ByteLevel::new(false, false, true)));
        // Control tokens (type 3) stay whole and are skipped when decoding, as in llama.cpp.
        let control: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, t)| **t == 3)
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        inner
            .add_special_tokens(control)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;

        let id = |key: &str| md(key).ok().and_then(|v| v.to_u32().ok());
        let add_bos = md("tokenizer.ggml.add_bos_token")
            .ok()
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        Ok(Self {
            inner,
            eos_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            bos_id: if add_bos {
                id("tokenizer.ggml.bos_token_id")
            } else {
                None
            },
            bos_token: id("tokenizer.ggml.bos_token_id")
                .and_then(|id| tokens.get(id as usize).cloned()),
            chat_template: md("tokenizer.chat_template")
                .ok()
                .and_then(|v| v.to_string().ok().cloned()),
        })
    }

    /// Token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor runs and a
    /// GGUF tokenizer that asks for it gets its BOS token.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens
            && let Some(bos) = self.bos_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Text of `ids` with special tokens kept (for per-token log-prob listings).
    pub fn decode_verbatim(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The first end-of-sequence token's text, if any.
    pub fn eos_token(&self) -> Option<String> {
        self.eos_ids
            .first()
            .and_then(|&id| self.inner.id_to_token(id))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The BOS token's text, whether or not prompts get it.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The model's chat template (Jinja), from the GGUF's `tokenizer.chat_template` or
    /// `chat_template` in `tokenizer_config.json` beside `tokenizer.json`.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

/// `tokenizer_config.json` beside `tokenizer.json`, when it is there and is JSON.
fn tokenizer_config(tokenizer_path: &Path) -> Option<serde_json::Value> {
    let config_path = tokenizer_path.with_file_name("tokenizer_config.json");
    let text = std::fs::read_to_string(config_path).ok()?;
    serde_json::from_str(&text).ok()
}

/// A special token's text: a string, or an object with `content`.
fn token_of_config(config: &serde_json::Value, key: &str) -> Option<String> {
    match &config[key] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => Some(o.get("content")?.as_str()?.to_string()),
        _ => None,
    }
}

/// `chat_template` is one template, or a list of named ones of which `default` is the chat's.
fn chat_template_of_config(config: &serde_json::Value) -> Option<String> {
    match &config["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// The end-of-text token of tokenizers trained here: id 0, also the document separator.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Trains a byte-level BPE of `vocab_size` tokens (including the 256 byte symbols and
/// [`END_OF_TEXT`]) on text files, the way GPT-2's tokenizer is built.
pub fn train_byte_level_bpe(files: &[std::path::PathBuf], vocab_size: usize) -> Result<Tokenizer> {
    use tokenizers::models::bpe::BpeTrainerBuilder;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel as ByteLevelPre;
    use tokenizers::{
        DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerBuilder,
    };

    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(ByteLevelPre::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, true, true,
    ))))
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(
        false, false, true,
    ))))
    .build()
    .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    tokenizer
        .train_from_files(&mut trainer, files)
        .map_err(|e| Error::Tokenizer(format!("training: {e}")))?;
    Ok(tokenizer.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenizer_config_gives_its_chat_template_and_special_tokens() {
        let one: serde_json::Value = serde_json::json!({
            "chat_template": "{{ messages }}",
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
        });
        assert_eq!(
            chat_template_of_config(&one).as_deref(),
            Some("{{ messages }}")
        );
        assert_eq!(token_of_config(&one, "bos_token").as_deref(), Some("<s>"));
        assert_eq!(token_of_config(&one, "eos_token").as_deref(), Some("</s>"));
        // Several named templates: the chat's is `default`.
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "chat"},
        ]});
        assert_eq!(chat_template_of_config(&named).as_deref(), Some("chat"));
        assert_eq!(chat_template_of_config(&serde_json::json!({})), None);
    }
}
