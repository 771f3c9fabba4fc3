//! Batch files: gzip JSON lines, one [`Sample`] per line. The hub writes them at ingest; the
//! worker (and the hub's re-verification) reads them.

use crate::messages::Sample;
use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use std::io::{BufRead, BufReader, Write};

#[derive(Debug, thiserror::Error)]
pub enum SamplesError {
    #[error("batch file: {0}")]
    Io(#[from] std::io::Error),
    #[error("batch file line {line}: {source}")]
    Json {
        line: usize,
        source: serde_json::Error,
    },
}

pub fn encode_samples(windows: &[Vec<u32>]) -> Result<Vec<u8>, SamplesError> {
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    for window in windows {
        let sample = Sample {
            input_ids: window.clone(),
        };
        serde_json::to_writer(&mut gz, &sample)
            .map_err(|source| SamplesError::Json { line: 0, source })?;
        gz.write_all(b"\n")?;
    }
    Ok(gz.finish()?)
}

/// The token ids of every sample; blank lines are skipped.
pub fn decode_samples(bytes: &[u8]) -> Result<Vec<Vec<u32>>, SamplesError> {
    let mut samples = Vec::new();
    for (index, line) in BufReader::new(GzDecoder::new(bytes)).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let sample: Sample = serde_json::from_str(&line).map_err(|source| SamplesError::Json {
            line: index + 1,
            source,
        })?;
        samples.push(sample.input_ids);
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_round_trip_and_bad_lines_name_their_number() {
        let windows = vec![vec![1, 2, 3], vec![4, 5, 6]];
        assert_eq!(
            decode_samples(&encode_samples(&windows).unwrap()).unwrap(),
            windows
        );
        let mut gz = GzEncoder::new(Vec::new(), Compression::default());
        gz.write_all(b"{\"input_ids\": [1]}\n\nnot json\n").unwrap();
        let err = decode_samples(&gz.finish().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3"), "{err}");
        assert!(decode_samples(b"not gzip").is_err());
    }
}
