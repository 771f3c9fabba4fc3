//! Corpora as token ids, and the windows training and evaluation draw from them.

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::{Error, Result};

/// Token ids of a training text: a `.txt` corpus (one paragraph per line, documents separated by
/// blank lines, as `data/build_corpus.py` writes) or gzip JSON lines (`.jsonl.gz`, one
/// `{"text": ...}` document per line, the hub's batch format). Paragraphs are joined by newlines;
/// documents are separated by the end-of-text token `eot`.
pub fn corpus_tokens(path: &Path, tokenizer: &tokenizers::Tokenizer, eot: u32) -> Result<Vec<u32>> {
    let documents = read_documents(path)?;
    let encodings = tokenizer
        .encode_batch(documents, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokens = Vec::new();
    for enc in encodings {
        tokens.extend_from_slice(enc.get_ids());
        tokens.push(eot);
    }
    Ok(tokens)
}

fn read_documents(path: &Path) -> Result<Vec<String>> {
    let name = path.to_string_lossy();
    if name.ends_with(".jsonl.gz") || name.ends_with(".jsonl") {
        use std::io::{BufRead, BufReader};
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let reader: Box<dyn BufRead> = if name.ends_with(".gz") {
            Box::new(BufReader::new(flate2::read::GzDecoder::new(file)))
        } else {
            Box::new(BufReader::new(file))
        };
        let mut docs = Vec::new();
        for (i, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| Error::io(path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| Error::InvalidInput(format!("{}:{}: {e}", path.display(), i + 1)))?;
            let text = value["text"].as_str().ok_or_else(|| {
                Error::InvalidInput(format!("{}:{}: no \"text\" string", path.display(), i + 1))
            })?;
            docs.push(text.to_string());
        }
        return Ok(docs);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(text
        .split("\n\n")
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(String::from)
        .collect())
}

/// `count` random windows of `len` tokens, drawn from a generator seeded with `seed`.
pub fn sample_windows(
    tokens: &[u32],
    count: usize,
    len: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>> {
    use rand::Rng;
    if tokens.len() <= len {
        return Err(Error::InvalidInput(format!(
            "the corpus has {} tokens, fewer than one window of {len}",
            tokens.len()
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    Ok((0..count)
        .map(|_| {
            let start = rng.random_range(0..=tokens.len() - len);
            tokens[start..start + len].to_vec()
        })
        .collect())
}

/// Up to `count` evenly spaced, non-overlapping windows of `len` tokens (a fixed evaluation set).
pub fn evaluation_windows(tokens: &[u32], count: usize, len: usize) -> Vec<Vec<u32>> {
    let available = tokens.len() / len.max(1);
    let count = count.min(available);
    if count == 0 {
        return Vec::new();
    }
    let stride = available / count;
    (0..count)
        .map(|i| tokens[i * stride * len..(i * stride + 1) * len].to_vec())
        .collect()
}
