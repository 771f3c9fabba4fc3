//! candle's CPU matrix multiply, on whichever kernel `gemm` dispatches to on this CPU (AVX-512
//! where it has AVX-512 and the build has our `avx512-gemm` feature, which turns on gemm's
//! `x86-v4` kernels; AVX2 or scalar otherwise), against a plain product in f64, on the shapes the
//! models run. `scripts/test` runs these tests with the feature (the workspace's build) and, on
//! an AVX-512 CPU, again without it, so that both kinds of kernel are tested there.
//!
//! The bound is the classic one for any order of summation: |computed - exact| <= k * eps *
//! sum_k |a_ik * b_kj|, with eps f32's machine epsilon.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rows: usize, cols: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect()
}

/// The kernel gemm picks on this CPU for this build, named in every failure: its AVX-512 level
/// (pulp's `V4`) needs these five features.
fn gemm_kernel() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512-gemm")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512cd")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl")
        {
            return "AVX-512";
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return "AVX2";
        }
    }
    "portable"
}

/// `x [m, k] · wᵀ` with `w [n, k]`: how a linear layer multiplies.
fn check_linear(m: usize, k: usize, n: usize) {
    let mut rng = StdRng::seed_from_u64((m * 31 + k * 7 + n) as u64);
    let (x, w) = (random(m, k, &mut rng), random(n, k, &mut rng));
    let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
    let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
    let got: Vec<Vec<f32>> = xt.matmul(&wt.t().unwrap()).unwrap().to_vec2().unwrap();
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
            for p in 0..k {
                let term = f64::from(x[i * k + p]) * f64::from(w[j * k + p]);
                exact += term;
                magnitude += term.abs();
            }
            let bound = k as f64 * f64::from(f32::EPSILON) * magnitude + 1e-30;
            let error = (f64::from(got[i][j]) - exact).abs();
            assert!(
                error <= bound,
                "[{m}x{k}]·[{k}x{n}] at ({i}, {j}) on gemm's {} kernel: {} vs {exact}, error \
                 {error:.3e} > {bound:.3e}",
                gemm_kernel(),
                got[i][j]
            );
        }
    }
}

#[test]
fn decode_shapes_match_the_exact_product() {
    check_linear(1, 256, 768);
    check_linear(8, 576, 1536);
}

#[test]
fn prefill_shapes_match_the_exact_product() {
    check_linear(512, 256, 768);
    check_linear(128, 1536, 576);
}

#[test]
fn ragged_shapes_match_the_exact_product() {
    // Edges that no microkernel tile covers whole.
    check_linear(7, 13, 5);
    check_linear(33, 65, 17);
    check_linear(1, 1, 1);
}
