//! Next-token choice: greedy, or a seeded draw from the softmax of the logits at a temperature,
//! cut to the nucleus (top-p) when asked. Each sequence owns its sampler, so a seed gives the
//! same tokens whatever else shares the batch.

use candle_core::{D, Tensor};
use rand::SeedableRng;
use rand::distr::Distribution;
use rand::distr::weighted::WeightedIndex;
use rand::rngs::StdRng;

use crate::Result;

pub struct Sampler {
    rng: StdRng,
    mode: Mode,
}

enum Mode {
    Greedy,
    Draw { temperature: f32, top_p: f32 },
}

impl Sampler {
    pub fn greedy() -> Self {
        Self {
            rng: StdRng::seed_from_u64(0),
            mode: Mode::Greedy,
        }
    }

    /// Draws at `temperature` (above 0) from the smallest set of likeliest tokens whose
    /// probability reaches `top_p` (1 or more: every token).
    pub fn draw(seed: u64, temperature: f64, top_p: f64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            mode: Mode::Draw {
                temperature: temperature as f32,
                top_p: top_p as f32,
            },
        }
    }

    /// The next token from one row of logits (`[vocab]`, f32).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let (temperature, top_p) = match self.mode {
            Mode::Greedy => return Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?),
            Mode::Draw { temperature, top_p } => (temperature, top_p),
        };
        let logits: Vec<f32> = logits.to_vec1()?;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Unnormalised probabilities: the weighted draw normalises them itself.
        let mut weights: Vec<f32> = logits
            .iter()
            .map(|&logit| ((logit - max) / temperature).exp())
            .collect();
        if top_p < 1.0 {
            keep_nucleus(&mut weights, top_p);
        }
        let index = WeightedIndex::new(&weights)
            .map_err(candle_core::Error::wrap)?
            .sample(&mut self.rng);
        Ok(index as u32)
    }
}

/// Zeroes every weight outside the likeliest tokens whose share of the total first reaches `p`;
/// the likeliest token always stays.
fn keep_nucleus(weights: &mut [f32], p: f32) {
    let budget = p * weights.iter().sum::<f32>();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let mut kept = 0.0;
    for index in order {
        if kept >= budget {
            weights[index] = 0.0;
        } else {
            kept += weights[index];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn row(logits: &[f32]) -> Tensor {
        Tensor::new(logits, &Device::Cpu).unwrap()
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        assert_eq!(
            Sampler::greedy().sample(&row(&[0.1, 2.0, -1.0])).unwrap(),
            1
        );
    }

    #[test]
    fn draws_follow_the_softmax_and_repeat_with_the_seed() {
        // Probabilities 0.1, 0.2, 0.7 as logits at temperature 1.
        let logits = row(&[0.1f32.ln(), 0.2f32.ln(), 0.7f32.ln()]);
        let mut sampler = Sampler::draw(42, 1.0, 1.0);
        let draws: Vec<u32> = (0..4000)
            .map(|_| sampler.sample(&logits).unwrap())
            .collect();
        for (token, p) in [0.1, 0.2, 0.7].into_iter().enumerate() {
            let share = draws.iter().filter(|&&t| t == token as u32).count() as f64 / 4000.0;
            assert!((share - p).abs() < 0.03, "token {token}: {share} vs {p}");
        }
        let mut again = Sampler::draw(42, 1.0, 1.0);
        let repeated: Vec<u32> = (0..4000).map(|_| again.sample(&logits).unwrap()).collect();
        assert_eq!(draws, repeated);
    }

    #[test]
    fn the_nucleus_keeps_the_likeliest_tokens_that_reach_p() {
        let mut weights = vec![0.1, 0.2, 0.7];
        keep_nucleus(&mut weights, 0.8);
        assert_eq!(weights, [0.0, 0.2, 0.7]);
        let mut weights = vec![0.1, 0.2, 0.7];
        keep_nucleus(&mut weights, 0.5);
        assert_eq!(
            weights,
            [0.0, 0.0, 0.7],
            "the likeliest token alone reaches 0.5"
        );
        let mut sampler = Sampler::draw(1, 1.0, 0.5);
        let logits = row(&[0.1f32.ln(), 0.2f32.ln(), 0.7f32.ln()]);
        assert!((0..200).all(|_| sampler.sample(&logits).unwrap() == 2));
    }
}
