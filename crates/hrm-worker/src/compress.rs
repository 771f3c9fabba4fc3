//! Upload encoding: every value, or top-k sparsification with error feedback. What top-k
//! leaves out of one update is kept here and added to the next, so that no part of the
//! gradient is dropped for good, only delayed.

use anyhow::{Result, anyhow};
use hrm_wire::update::{Encoding, Schema, decode_update, encode_update};

/// The encoder of one worker; it holds the residual between uploads.
pub struct UpdateEncoder {
    encoding: Encoding,
    residual: Option<Vec<f32>>,
}

impl UpdateEncoder {
    /// `ratio`: the fraction of values sent when compressing (0.1 sends 10%).
    pub fn new(compress: bool, ratio: f32) -> Self {
        Self {
            encoding: if compress {
                Encoding::TopK { ratio }
            } else {
                Encoding::Dense
            },
            residual: None,
        }
    }

    /// The update file for `update` (computed on `base_version`). The residual moves on only
    /// when the hub has taken the file: pass it to [`UpdateEncoder::accept`] then.
    pub fn encode(&self, schema: &Schema, update: &[f32], base_version: &str) -> Result<Encoded> {
        let Encoding::TopK { .. } = self.encoding else {
            return Ok(Encoded {
                bytes: encode_update(schema, update, base_version, Encoding::Dense),
                residual: None,
            });
        };
        let mut corrected = update.to_vec();
        if let Some(residual) = self.residual.as_ref().filter(|r| r.len() == update.len()) {
            for (value, carried) in corrected.iter_mut().zip(residual) {
                *value += carried;
            }
        }
        let bytes = encode_update(schema, &corrected, base_version, self.encoding);
        // What the hub will decode is exactly what was sent; the rest is carried over.
        let sent = decode_update(&bytes, schema, base_version)
            .map_err(|e| anyhow!("re-reading our own update: {e}"))?;
        for (value, sent) in corrected.iter_mut().zip(&sent) {
            *value -= sent;
        }
        Ok(Encoded {
            bytes,
            residual: Some(corrected),
        })
    }

    /// The hub took `encoded`: what it left out is carried into the next update.
    pub fn accept(&mut self, encoded: Encoded) {
        if encoded.residual.is_some() {
            self.residual = encoded.residual;
        }
    }
}

/// An encoded update file and the residual it leaves.
pub struct Encoded {
    pub bytes: Vec<u8>,
    residual: Option<Vec<f32>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use hrm_wire::ParamSpec;

    fn schema() -> Schema {
        Schema::new(vec![ParamSpec {
            name: "w".into(),
            shape: vec![10],
        }])
    }

    #[test]
    fn dense_sends_everything_and_keeps_nothing() {
        let encoder = UpdateEncoder::new(false, 0.1);
        let update: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let encoded = encoder.encode(&schema(), &update, "v0.1.1").unwrap();
        assert_eq!(
            decode_update(&encoded.bytes, &schema(), "v0.1.1").unwrap(),
            update
        );
        assert!(encoded.residual.is_none());
    }

    #[test]
    fn what_top_k_leaves_out_is_sent_later() {
        let mut encoder = UpdateEncoder::new(true, 0.2);
        let first = vec![5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0];
        let encoded = encoder.encode(&schema(), &first, "v0.1.1").unwrap();
        let sent = decode_update(&encoded.bytes, &schema(), "v0.1.1").unwrap();
        assert_eq!(sent, [5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0]);
        // Not taken by the hub yet: nothing is carried.
        assert!(encoder.residual.is_none());
        encoder.accept(encoded);
        assert_eq!(encoder.residual.as_ref().unwrap()[1], 1.0);
        // The second update is small, but the carried 1.0 now makes index 1 one of the top 2.
        let second = vec![0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0];
        let encoded = encoder.encode(&schema(), &second, "v0.1.2").unwrap();
        let sent = decode_update(&encoded.bytes, &schema(), "v0.1.2").unwrap();
        assert_eq!(sent[1], 1.5);
        assert_eq!(sent[8], 0.3);
        // Sent plus carried equals everything computed so far.
        let residual = encoded.residual.unwrap();
        let total_sent = 5.0 + 4.0 + 1.5 + 0.3;
        let total: f32 = first.iter().chain(&second).sum();
        assert!((total_sent + residual.iter().sum::<f32>() - total).abs() < 1e-6);
    }
}
