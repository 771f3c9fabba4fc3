//! Chat templates: the model's own Jinja template (a GGUF's `tokenizer.chat_template`, or
//! `chat_template` in `tokenizer_config.json`) or the operator's (`--chat-template FILE`),
//! rendered with minijinja the way Hugging Face's `apply_chat_template` renders it: `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token` in the context, blocks trimmed, Python's
//! string methods (`.strip()`, `.startswith()`, ...) and `raise_exception`.
//!
//! The messages come from strangers, so rendering runs with fuel: a template that would loop
//! without end is stopped and the request answered 400, never a stuck thread.

use std::path::Path;

use anyhow::Context;
use hrm_http::ApiError;
use hrm_model::tokenizer::TextTokenizer;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, context};

use crate::validation::ChatMessage;

/// Template instructions one rendering may run (a conversation of the largest body the server
/// accepts takes far fewer).
const RENDER_FUEL: u64 = 5_000_000;

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// `model` or the operator's file, for the start-up log and `--dry-run`.
    pub source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `template`.
    pub fn new(
        template: &str,
        tokenizer: &TextTokenizer,
        source: String,
    ) -> Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", template.to_string())?;
        Ok(Self {
            env,
            bos_token: tokenizer.bos_token().unwrap_or_default().to_string(),
            eos_token: tokenizer.eos_token().unwrap_or_default(),
            source,
        })
    }

    /// The operator's template when `path` is given (an error if it does not compile), else the
    /// model's own (a warning if it does not compile), else none.
    pub fn for_model(
        path: Option<&Path>,
        tokenizer: &TextTokenizer,
    ) -> anyhow::Result<Option<Self>> {
        if let Some(path) = path {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the chat template {}", path.display()))?;
            let template = Self::new(&text, tokenizer, path.display().to_string())
                .with_context(|| format!("compiling the chat template {}", path.display()))?;
            return Ok(Some(template));
        }
        let Some(text) = tokenizer.chat_template() else {
            return Ok(None);
        };
        match Self::new(text, tokenizer, "model".into()) {
            Ok(template) => Ok(Some(template)),
            Err(e) => {
                tracing::warn!(error = %e, "the model's chat template does not compile; /v1/chat/completions needs --chat-template");
                Ok(None)
            }
        }
    }

    /// The prompt of a conversation, ending where the assistant's answer starts. A template
    /// that refuses the conversation (`raise_exception`), fails, or runs out of fuel is a 400
    /// `template_error` with its message.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ApiError> {
        let template = self.env.get_template("chat").map_err(ApiError::internal)?;
        template
            .render(context! {
                messages => Serde(messages),
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| {
                let message = match e.kind() {
                    ErrorKind::OutOfFuel => {
                        "the chat template ran too long on these messages".to_string()
                    }
                    _ => format!(
                        "the chat template refused these messages: {}",
                        e.detail().unwrap_or(&e.to_string())
                    ),
                };
                ApiError::invalid("template_error", message).with_param("messages")
            })
    }
}

/// 400 for a chat request to a model with no chat template.
pub fn no_template() -> ApiError {
    ApiError::invalid(
        "no_chat_template",
        "this model has no chat template (its files carry none, or it does not compile); use /v1/completions, or start the server with --chat-template FILE",
    )
    .with_param("messages")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/sample");
        TextTokenizer::from_file(&dir.join("tokenizer.json"), vec![0], None).unwrap()
    }

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
        }
    }

    /// SmolLM2-Instruct's template, as its GGUF carries it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_a_real_template_as_transformers_does() {
        let t = ChatTemplate::new(SMOLLM2, &tokenizer(), "test".into()).unwrap();
        let text = t.render(&[message("user", "Hi there")]).unwrap();
        // Jinja2 3.1, in the sandboxed environment with trimmed blocks that transformers'
        // `apply_chat_template` uses, renders this text.
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}{% for m in messages %}[{{ m.content.strip() | upper }}]{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(source, &tokenizer(), "test".into()).unwrap();
        assert_eq!(
            t.render(&[message("user", "  hello  ")]).unwrap(),
            "[HELLO]<|endoftext|>"
        );
        let e = t.render(&[message("assistant", "x")]).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, "template_error"));
        assert!(
            e.message.contains("Conversations must start with the user"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let source =
            "{% for i in range(20000) %}{% for j in range(20000) %}x{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(source, &tokenizer(), "test".into()).unwrap();
        let e = t.render(&[message("user", "hi")]).unwrap_err();
        assert_eq!(e.code, "template_error");
        assert!(e.message.contains("too long"), "{}", e.message);
    }
}
