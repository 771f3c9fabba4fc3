//! Next-token choice: greedy, or a seeded draw from the softmax of the logits at a temperature,
//! cut to the nucleus (top-p) when asked. Each sequence owns its sampler, so a seed gives the
//! same tokens whatever else shares the batch.

use std::cmp::Ordering::Less;

use candle_core::{D, DType, Tensor};
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
            Mode::Greedy => return largest_logit(logits),
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

/// The greedy token of one row of logits (`[vocab]`): the index of the first largest, as candle's
/// `argmax` picks it, NaNs included (one at index 0 wins; elsewhere a NaN is never the largest).
/// On the CPU, candle compares one logit after another, each waiting for the last, which cost
/// 1.6–2.2% of a GGUF model's decode step over a 49,152-token vocabulary on a 2-core Intel Xeon
/// (family 6 model 207, AVX-512); sixteen lanes of maxima, which the compiler makes vector
/// instructions, then one pass for the first equal logit, pick the same index. Logits on a GPU
/// stay there for candle's own `argmax`.
pub fn largest_logit(logits: &Tensor) -> Result<u32> {
    const LANES: usize = 16;
    if !logits.device().is_cpu() {
        return Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?);
    }
    let index = crate::fused::read(&logits.to_dtype(DType::F32)?, |logits| {
        let Some(first) = logits.first() else {
            return Err(candle_core::Error::Msg("no logits to choose from".into()));
        };
        if first.is_nan() {
            return Ok(0);
        }
        let (chunks, tail) = logits.as_chunks::<LANES>();
        let mut lanes = [f32::NEG_INFINITY; LANES];
        for chunk in chunks {
            for (lane, &logit) in lanes.iter_mut().zip(chunk) {
                if logit > *lane {
                    *lane = logit;
                }
            }
        }
        let largest = lanes
            .iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        // Always found: the first logit is a number, so the largest is at least it.
        Ok(logits.iter().position(|&x| x == largest).unwrap_or(0))
    })?;
    Ok(index as u32)
}

/// Zeroes every weight outside the likeliest tokens whose share of the total first reaches `p`;
/// the likeliest token always stays.
///
/// The tokens are taken likeliest first, ties in index order (the order of a stable sort by
/// weight, and the same sums in the same order), but only as far as the nucleus reaches: each
/// round picks out the next, twice as large, run of them (`select_nth_unstable_by`, linear) and
/// sorts that run alone. On a 2-core Intel Xeon (family 6 model 207, AVX-512), sorting the whole
/// vocabulary took about 2 ms a token over 49,152 weights, half a small GGUF model's decode
/// step, where a nucleus of a hundred tokens is picked out in about a fifth of that.
fn keep_nucleus(weights: &mut [f32], p: f32) {
    let budget = p * weights.iter().sum::<f32>();
    let likelier = |a: &usize, b: &usize| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..weights.len()).collect();
    let (mut taken, mut sorted, mut kept) = (0, 0, 0.0);
    // Short of the budget, or not comparable with it (NaN weights): every token stays then.
    while taken < order.len() && matches!(kept.partial_cmp(&budget), Some(Less) | None) {
        if taken == sorted {
            let end = (sorted.max(32) * 2).min(order.len());
            if end < order.len() {
                order[sorted..].select_nth_unstable_by(end - sorted - 1, likelier);
            }
            order[sorted..end].sort_unstable_by(likelier);
            sorted = end;
        }
        kept += weights[order[taken]];
        taken += 1;
    }
    for &index in &order[taken..] {
        weights[index] = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::Rng;

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

    /// Against candle's own `argmax` (the choice before), on rows of every length around the
    /// lanes' multiples and of a real vocabulary, whose values repeat (ties), and with infinities,
    /// signed zeros and NaNs put in.
    #[test]
    fn the_largest_logit_is_the_one_candle_picks() {
        let mut rng = StdRng::seed_from_u64(7);
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MAX,
        ];
        let lengths = (1..=70).chain([49_152, 49_153]);
        for (case, len) in lengths.flat_map(|len| (0..12).map(move |case| (case, len))) {
            let mut logits: Vec<f32> = (0..len)
                .map(|_| match case % 3 {
                    // Few distinct values, so that the largest repeats.
                    0 => rng.random_range(0..4) as f32,
                    _ => rng.random_range(-20.0..20.0),
                })
                .collect();
            for _ in 0..case / 3 {
                let at = rng.random_range(0..len);
                logits[at] = specials[rng.random_range(0..specials.len())];
            }
            if case == 11 {
                logits.fill(f32::NEG_INFINITY);
                logits[rng.random_range(0..len)] = f32::NAN;
            }
            let candle = row(&logits).argmax(D::Minus1).unwrap();
            assert_eq!(
                largest_logit(&row(&logits)).unwrap(),
                candle.to_scalar::<u32>().unwrap(),
                "length {len}, case {case}: {logits:?}"
            );
        }
        for logits in [[f32::NAN, 5.0, 1.0], [1.0, f32::NAN, 5.0], [f32::NAN; 3]] {
            let candle = row(&logits).argmax(D::Minus1).unwrap();
            assert_eq!(
                largest_logit(&row(&logits)).unwrap(),
                candle.to_scalar::<u32>().unwrap(),
                "{logits:?}"
            );
        }
        assert!(largest_logit(&row(&[])).is_err());
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

    /// Against the definition: every token in a stable sort by weight, likeliest first, kept
    /// while the sum of those before it is short of `p` of the total.
    #[test]
    fn the_nucleus_is_the_one_a_full_sort_gives() {
        let by_full_sort = |weights: &mut [f32], p: f32| {
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
        };
        let mut rng = StdRng::seed_from_u64(11);
        for (case, len) in [1, 2, 31, 64, 65, 200, 49_152].into_iter().enumerate() {
            for p in [0.0, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0] {
                // Peaked (a small nucleus), flat (a large one), and few distinct values (ties).
                for shape in 0..3 {
                    let mut weights: Vec<f32> = (0..len)
                        .map(|_| match shape {
                            0 => (25.0 * rng.random::<f32>().powi(40)).exp(),
                            1 => rng.random_range(0.0..1.0),
                            _ => rng.random_range(0..3) as f32,
                        })
                        .collect();
                    if case == 3 && shape == 1 {
                        weights[7] = f32::NAN;
                    }
                    let (mut ours, mut expected) = (weights.clone(), weights);
                    keep_nucleus(&mut ours, p);
                    by_full_sort(&mut expected, p);
                    let bits = |w: &[f32]| w.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&ours),
                        bits(&expected),
                        "case {case}, length {len}, p {p}, shape {shape}"
                    );
                }
            }
        }
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
