//! Attention over a whole pass on the CPU as one op, with its backward pass for training.
//!
//! Inference runs the same op, forward only, over every pass whose rows see only their own
//! tokens (scoring, a prompt's first pass): the composed form's copies (transposes, rotated
//! queries made contiguous, the scores and probabilities as batch tensors) ran on the calling
//! thread while the team waited.
//!
//! The composed form splits the input projection into gate, q, k and v (narrows whose backward
//! passes each pad a full-width gradient with zeros, which is then summed), rotates q and k,
//! repeats grouped KV heads, and runs two batched products, the masked softmax and the gate:
//! some fifteen graph nodes per layer, each with its own gradient buffer to zero and add into.
//! [`AttentionOp`] reads the projection `[batch, seq, width]` in place and writes the attention
//! output `[batch, seq, heads · head_dim]`; its backward pass writes the projection's gradient
//! in the projection's own layout.
//!
//! Columns of the projection, per position: `[gate | q | k | v]`, with the gate (`heads · d`,
//! HRM-Text's sigmoid output gate) only when [`AttentionOp::gated`], q `heads · d`, k and v
//! `kv_heads · d`, each head's `d` values together. The rotary angles are the op's other two
//! operands (`[batch, seq, d / 2]`, no gradient).
//!
//! Invariants:
//! - One unit of work is one (sequence, KV head) pair with the query heads that share it, so
//!   the gradients of a shared key and value head are summed inside one unit, in a fixed order.
//! - Each unit writes its heads' outputs, gated, straight into the op's output (its sequence's
//!   rows, its heads' columns): the units tile the output, so nothing gathers it afterwards.
//! - The forward pass keeps what the backward pass needs (rotated q and k, the probabilities,
//!   the output before the gate) inside the op, which candle holds in the graph; the backward
//!   pass takes it, so each op runs backward once (as every graph in training does). An op made
//!   [`AttentionOp::forward_only`] (inference: no graph, so no backward pass) keeps nothing: each
//!   thread works its units in one set of buffers of its own, reused from call to call and
//!   overwritten in full by each unit, so it neither zeroes nor allocates them again, nor
//!   copies the output before the gate. The arithmetic is the same, so the output is the same
//!   bits (test).
//! - Values and gradients agree with the composed form within f32 rounding (tests, both rotary
//!   layouts, grouped heads, masks with a bidirectional prefix and padding).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::exp::{gate_in_place, sigmoid_in_place};
use super::{
    Split, Strided, cpu_storage, error, gemm_block, gemm_into, gemm_update, prefetch_head_ahead,
    rotate, softmax_grad_row, softmax_in_place, values,
};
use crate::layers::RopeLayout;
use crate::team::map_in_parallel;

/// Multi-head attention over a whole pass (no cache), with its backward pass; see the module
/// doc for the layout.
pub struct AttentionOp {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    gated: bool,
    layout: RopeLayout,
    /// The additive mask `[batch, seq, seq]`, or `None` when every query sees every key.
    mask: Option<Arc<[f32]>>,
    /// Whether the forward pass keeps its units for [`CustomOp3::bwd`].
    keeps_state: bool,
    saved: Mutex<Vec<Unit>>,
}

/// Forward-only units' buffers larger than this (a long prompt's probabilities) are not kept
/// for the thread's next unit: one prompt would otherwise hold them for the process's life.
const KEPT_SCRATCH_BYTES: usize = 4 << 20;

thread_local! {
    /// The buffers of the forward-only units this thread works (see the module doc).
    static SCRATCH: RefCell<Unit> = RefCell::new(Unit::default());
}

/// What the forward pass of one (sequence, KV head) unit leaves for the backward pass.
#[derive(Default)]
struct Unit {
    /// The rotated keys, `seq × d`.
    k: Vec<f32>,
    /// Per query head of the group: rotated queries (`seq × d`), probabilities (`seq × seq`)
    /// and, when gated, the output before the gate (`seq × d`), each head's after the other.
    q: Vec<f32>,
    p: Vec<f32>,
    o: Vec<f32>,
}

impl Unit {
    /// Buffers of the sizes a unit of `group` query heads over `s` positions of `d` values
    /// fills, zeroed.
    fn zeroed(group: usize, s: usize, d: usize, gated: bool) -> Self {
        Self {
            k: vec![0.0; s * d],
            q: vec![0.0; group * s * d],
            p: vec![0.0; group * s * s],
            o: if gated {
                vec![0.0; group * s * d]
            } else {
                Vec::new()
            },
        }
    }

    /// The same sizes, without the output before the gate, keeping the values already there:
    /// a forward-only unit overwrites every value before it reads it.
    fn fit_forward_only(&mut self, group: usize, s: usize, d: usize) {
        self.k.resize(s * d, 0.0);
        self.q.resize(group * s * d, 0.0);
        self.p.resize(group * s * s, 0.0);
    }

    fn bytes(&self) -> usize {
        (self.k.capacity() + self.q.capacity() + self.p.capacity() + self.o.capacity())
            * size_of::<f32>()
    }
}

impl AttentionOp {
    pub fn new(
        (heads, kv_heads, head_dim): (usize, usize, usize),
        gated: bool,
        layout: RopeLayout,
        mask: Option<Arc<[f32]>>,
    ) -> candle_core::Result<Self> {
        if kv_heads == 0 || heads % kv_heads != 0 || head_dim % 2 != 0 {
            return Err(error(
                "attention needs heads divisible by kv heads and an even head size",
            ));
        }
        Ok(Self {
            heads,
            kv_heads,
            head_dim,
            gated,
            layout,
            mask,
            keeps_state: true,
            saved: Mutex::new(Vec::new()),
        })
    }

    /// The same op for a pass that needs no backward pass (see the module doc).
    pub fn forward_only(self) -> Self {
        Self {
            keeps_state: false,
            ..self
        }
    }

    /// Column offsets of the gate, q, k and v parts, and the projection's width.
    fn columns(&self) -> (usize, usize, usize, usize, usize) {
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let gate = if self.gated { h * d } else { 0 };
        let (q, k) = (gate, gate + h * d);
        let v = k + kvh * d;
        (0, q, k, v, v + kvh * d)
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The mask's rows for sequence `i` (`seq × seq`), if any.
    fn mask_of(&self, i: usize, s: usize) -> Option<&[f32]> {
        self.mask.as_ref().map(|m| &m[i * s * s..(i + 1) * s * s])
    }
}

/// The `(batch, seq)` of a projection `[batch, seq, width]` and its angles, checked.
fn dims(
    op: &AttentionOp,
    proj: &Layout,
    cos: &Layout,
    sin: &Layout,
) -> candle_core::Result<(usize, usize)> {
    let (b, s, width) = proj.shape().dims3()?;
    let half = op.head_dim / 2;
    if width != op.columns().4 || cos.dims() != [b, s, half] || sin.dims() != [b, s, half] {
        return Err(error(
            "attention needs a [b, s, gate? + q + k + v] projection with angles [b, s, d / 2]",
        ));
    }
    if op.mask.as_ref().is_some_and(|m| m.len() != b * s * s) {
        return Err(error("attention mask of the wrong size"));
    }
    Ok((b, s))
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        proj_storage: &CpuStorage,
        proj_layout: &Layout,
        cos_storage: &CpuStorage,
        cos_layout: &Layout,
        sin_storage: &CpuStorage,
        sin_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, s) = dims(self, proj_layout, cos_layout, sin_layout)?;
        let proj = values(proj_storage, proj_layout)?;
        let (cos, sin) = (
            values(cos_storage, cos_layout)?,
            values(sin_storage, sin_layout)?,
        );
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let (gate_at, q_at, k_at, v_at, width) = self.columns();
        let half = d / 2;
        let scale = 1.0 / (d as f32).sqrt();
        let group = self.group();

        // Unit (i, g) writes rows `i · s..(i + 1) · s`, columns `g · group · d..(g + 1) · group
        // · d` (see the module doc).
        let out_width = h * d;
        let mut out: Vec<f32> = Vec::with_capacity(b * s * out_width);
        let dst = super::SharedOut(out.as_mut_ptr());
        let units = map_in_parallel(b * kvh, |unit| -> candle_core::Result<Unit> {
            let (i, g) = (unit / kvh, unit % kvh);
            let row = |t: usize| &proj[(i * s + t) * width..(i * s + t + 1) * width];
            let angles = |t: usize| {
                let at = (i * s + t) * half;
                (&cos[at..at + half], &sin[at..at + half])
            };
            let fill = |saved: &mut Unit| -> candle_core::Result<()> {
                for (t, k) in saved.k.chunks_exact_mut(d).enumerate() {
                    let (c, sn) = angles(t);
                    prefetch_head_ahead(proj, width, i * s + t, k_at + g * d, d);
                    rotate(self.layout, &row(t)[k_at + g * d..][..d], c, sn, k);
                }
                let v = Strided::matrix(proj, i * s * width + v_at + g * d, 1, (s, d), (width, 1))?;
                for j in 0..group {
                    let head = g * group + j;
                    let q = &mut saved.q[j * s * d..(j + 1) * s * d];
                    for (t, q) in q.chunks_exact_mut(d).enumerate() {
                        let (c, sn) = angles(t);
                        prefetch_head_ahead(proj, width, i * s + t, q_at + head * d, d);
                        rotate(self.layout, &row(t)[q_at + head * d..][..d], c, sn, q);
                    }
                    let p = &mut saved.p[j * s * s..(j + 1) * s * s];
                    let qm = Strided::matrix(q, 0, 0, (s, d), (d, 1))?;
                    let kt = Strided::matrix(&saved.k, 0, 0, (s, d), (d, 1))?.t();
                    gemm_into(p, &qm, &kt, (s, d, s), scale, Split::Serial);
                    for (t, p) in p.chunks_exact_mut(s).enumerate() {
                        if let Some(mask) = self.mask_of(i, s) {
                            for (x, m) in p.iter_mut().zip(&mask[t * s..(t + 1) * s]) {
                                *x += m;
                            }
                        }
                        softmax_in_place(p);
                    }
                    let pm = Strided::matrix(p, 0, 0, (s, s), (s, 1))?;
                    // SAFETY: this unit's head writes rows `i · s..(i + 1) · s` of its `d`
                    // columns, inside the output's `b · s × out_width` values, and no other unit
                    // or head writes them.
                    let o_at = unsafe {
                        let o_at = dst.ptr().add(i * s * out_width + head * d);
                        gemm_block(o_at, (out_width, 1), &pm, &v, (s, s, d), 1.0, false);
                        o_at
                    };
                    for t in 0..s {
                        // SAFETY: as above, for row `t` of the head's block, which gemm wrote.
                        let o =
                            unsafe { std::slice::from_raw_parts_mut(o_at.add(t * out_width), d) };
                        if self.keeps_state && self.gated {
                            saved.o[(j * s + t) * d..][..d].copy_from_slice(o);
                        }
                        if self.gated {
                            prefetch_head_ahead(proj, width, i * s + t, gate_at + head * d, d);
                            gate_in_place(&row(t)[gate_at + head * d..][..d], o);
                        }
                    }
                }
                Ok(())
            };
            if self.keeps_state {
                let mut saved = Unit::zeroed(group, s, d, self.gated);
                fill(&mut saved)?;
                return Ok(saved);
            }
            SCRATCH.with_borrow_mut(|scratch| {
                scratch.fit_forward_only(group, s, d);
                let filled = fill(scratch);
                if scratch.bytes() > KEPT_SCRATCH_BYTES {
                    *scratch = Unit::default();
                }
                filled
            })?;
            Ok(Unit::default())
        })
        .into_iter()
        .collect::<candle_core::Result<Vec<_>>>()?;
        // SAFETY: every unit returned without an error, so together they wrote all
        // `b · s × out_width` values (above).
        unsafe { out.set_len(b * s * out_width) };
        if self.keeps_state {
            *self.saved.lock().expect("attention state") = units;
        }
        Ok((CpuStorage::F32(out), Shape::from((b, s, out_width))))
    }

    fn bwd(
        &self,
        proj: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let saved = std::mem::take(&mut *self.saved.lock().expect("attention state"));
        let (b, s) = dims(self, proj.layout(), cos.layout(), sin.layout())?;
        if saved.len() != b * self.kv_heads {
            return Err(error("attention's backward pass without its forward pass"));
        }
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let (gate_at, q_at, k_at, v_at, width) = self.columns();
        let half = d / 2;
        let scale = 1.0 / (d as f32).sqrt();
        let group = self.group();

        let proj = proj.contiguous()?;
        let grad = grad.contiguous()?;
        let (cos, neg_sin) = (cos.contiguous()?, sin.neg()?.contiguous()?);
        let (proj_guard, proj_layout) = proj.storage_and_layout();
        let (grad_guard, grad_layout) = grad.storage_and_layout();
        let (cos_guard, cos_layout) = cos.storage_and_layout();
        let (sin_guard, sin_layout) = neg_sin.storage_and_layout();
        let proj_values = values(cpu_storage(&proj_guard)?, proj_layout)?;
        let grad_values = values(cpu_storage(&grad_guard)?, grad_layout)?;
        let (cos_values, sin_values) = (
            values(cpu_storage(&cos_guard)?, cos_layout)?,
            values(cpu_storage(&sin_guard)?, sin_layout)?,
        );

        // Per unit: the gradients of its gate and q columns (`group × seq × d` each), and of
        // its k and v head (`seq × d` each).
        type Grads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let units = map_in_parallel(saved.len(), |unit| -> candle_core::Result<Grads> {
            let saved = &saved[unit];
            let (i, g) = (unit / kvh, unit % kvh);
            let row = |t: usize| &proj_values[(i * s + t) * width..(i * s + t + 1) * width];
            let back = |t: usize, x: &[f32], out: &mut [f32]| {
                let at = (i * s + t) * half;
                rotate(
                    self.layout,
                    x,
                    &cos_values[at..at + half],
                    &sin_values[at..at + half],
                    out,
                );
            };
            let v = Strided::matrix(
                proj_values,
                i * s * width + v_at + g * d,
                1,
                (s, d),
                (width, 1),
            )?;
            let k = Strided::matrix(&saved.k, 0, 0, (s, d), (d, 1))?;
            let mut d_gate = if self.gated {
                vec![0.0; group * s * d]
            } else {
                Vec::new()
            };
            let mut d_q = vec![0.0; group * s * d];
            let mut d_k_rot = vec![0.0; s * d];
            let mut d_v = vec![0.0; s * d];
            let mut d_o = vec![0.0; s * d];
            let mut d_p = vec![0.0; s * s];
            let mut d_q_rot = vec![0.0; s * d];
            let mut sigmoids = vec![0.0; d];
            for j in 0..group {
                let head = g * group + j;
                for (t, d_o) in d_o.chunks_exact_mut(d).enumerate() {
                    let g_out = &grad_values[(i * s + t) * h * d + head * d..][..d];
                    if self.gated {
                        sigmoids.copy_from_slice(&row(t)[gate_at + head * d..][..d]);
                        sigmoid_in_place(&mut sigmoids);
                        let o = &saved.o[(j * s + t) * d..][..d];
                        let d_gate = &mut d_gate[(j * s + t) * d..][..d];
                        for e in 0..d {
                            let sg = sigmoids[e];
                            d_o[e] = g_out[e] * sg;
                            d_gate[e] = g_out[e] * o[e] * sg * (1.0 - sg);
                        }
                    } else {
                        d_o.copy_from_slice(g_out);
                    }
                }
                let p = &saved.p[j * s * s..(j + 1) * s * s];
                let pt = Strided::matrix(p, 0, 0, (s, s), (s, 1))?.t();
                let dom = Strided::matrix(&d_o, 0, 0, (s, d), (d, 1))?;
                gemm_update(&mut d_v, &pt, &dom, (s, s, d), 1.0, j > 0, Split::Serial);
                gemm_into(&mut d_p, &dom, &v.t(), (s, d, s), 1.0, Split::Serial);
                let mut d_s = vec![0.0; s];
                for (t, d_p) in d_p.chunks_exact_mut(s).enumerate() {
                    softmax_grad_row(&mut d_s, &p[t * s..(t + 1) * s], d_p);
                    for (x, ds) in d_p.iter_mut().zip(&d_s) {
                        *x = ds * scale;
                    }
                }
                let dsm = Strided::matrix(&d_p, 0, 0, (s, s), (s, 1))?;
                gemm_into(&mut d_q_rot, &dsm, &k, (s, s, d), 1.0, Split::Serial);
                let q =
                    Strided::matrix(&saved.q[j * s * d..(j + 1) * s * d], 0, 0, (s, d), (d, 1))?;
                gemm_update(
                    &mut d_k_rot,
                    &dsm.t(),
                    &q,
                    (s, s, d),
                    1.0,
                    j > 0,
                    Split::Serial,
                );
                for t in 0..s {
                    back(
                        t,
                        &d_q_rot[t * d..(t + 1) * d],
                        &mut d_q[(j * s + t) * d..][..d],
                    );
                }
            }
            let mut d_k = vec![0.0; s * d];
            for t in 0..s {
                back(
                    t,
                    &d_k_rot[t * d..(t + 1) * d],
                    &mut d_k[t * d..(t + 1) * d],
                );
            }
            Ok((d_gate, d_q, d_k, d_v))
        })
        .into_iter()
        .collect::<candle_core::Result<Vec<_>>>()?;

        // Each row of the projection's gradient gathers its heads from the units, on the team.
        let d_proj = super::fill_rows(b * s, width, |row_index, row| {
            let (i, t) = (row_index / s, row_index % s);
            for g in 0..kvh {
                let (d_gate, d_q, d_k, d_v) = &units[i * kvh + g];
                row[k_at + g * d..][..d].copy_from_slice(&d_k[t * d..(t + 1) * d]);
                row[v_at + g * d..][..d].copy_from_slice(&d_v[t * d..(t + 1) * d]);
                for j in 0..group {
                    let head = g * group + j;
                    row[q_at + head * d..][..d].copy_from_slice(&d_q[(j * s + t) * d..][..d]);
                    if self.gated {
                        row[gate_at + head * d..][..d]
                            .copy_from_slice(&d_gate[(j * s + t) * d..][..d]);
                    }
                }
            }
        });
        let d_proj = Tensor::from_vec(d_proj, (b, s, width), proj.device())?;
        Ok((Some(d_proj), None, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Var};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::super::tests::{close, grads_of, random, random_var};
    use super::*;
    use crate::layers::rope_composed;

    /// The attention the op replaces, in candle's differentiable tensor ops.
    fn composed(
        proj: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        op: &AttentionOp,
    ) -> Tensor {
        let (b, s, _) = proj.dims3().unwrap();
        let (h, kvh, d) = (op.heads, op.kv_heads, op.head_dim);
        let (gate_at, q_at, k_at, v_at, _) = op.columns();
        let heads = |at: usize, n: usize| {
            proj.narrow(D::Minus1, at, n * d)
                .unwrap()
                .reshape((b, s, n, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let repeat = |x: Tensor| {
            x.unsqueeze(2)
                .unwrap()
                .broadcast_as((b, kvh, h / kvh, s, d))
                .unwrap()
                .reshape((b, h, s, d))
                .unwrap()
        };
        let q = rope_composed(&heads(q_at, h), cos, sin, op.layout).unwrap();
        let k = repeat(rope_composed(&heads(k_at, kvh), cos, sin, op.layout).unwrap());
        let v = repeat(heads(v_at, kvh));
        let scores = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
        let scores = match mask {
            Some(mask) => scores.broadcast_add(mask).unwrap(),
            None => scores,
        };
        let probs = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        let out = probs.matmul(&v).unwrap().transpose(1, 2).unwrap();
        let out = if op.gated {
            let gate = proj
                .narrow(D::Minus1, gate_at, h * d)
                .unwrap()
                .reshape((b, s, h, d))
                .unwrap();
            (candle_nn::ops::sigmoid(&gate).unwrap() * out).unwrap()
        } else {
            out
        };
        out.reshape((b, s, h * d)).unwrap()
    }

    /// A causal mask `[b, 1, s, s]` whose row `i` has a bidirectional prefix of `blocks[i]`
    /// tokens and `padding[i]` hidden leading keys and queries, as `ForwardBatch` builds it.
    fn mask(s: usize, blocks: &[usize], padding: &[usize]) -> Tensor {
        let mut values = Vec::new();
        for (&block, &pad) in blocks.iter().zip(padding) {
            for q in 0..s {
                for k in 0..s {
                    let visible =
                        q >= pad && k >= pad && (k <= q || (k - pad < block && q - pad < block));
                    values.push(if visible { 0.0 } else { f32::MIN });
                }
            }
        }
        Tensor::from_vec(values, (blocks.len(), 1, s, s), &candle_core::Device::Cpu).unwrap()
    }

    #[test]
    fn values_and_gradient_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(11);
        let (b, s) = (2, 9);
        // HRM-Text's gated heads with a prefix block; Llama's grouped heads with padding.
        let cases = [
            (
                (3, 3, 8),
                true,
                RopeLayout::Halves,
                Some(mask(s, &[4, 0], &[0, 0])),
            ),
            (
                (4, 2, 6),
                false,
                RopeLayout::Interleaved,
                Some(mask(s, &[0, 0], &[0, 3])),
            ),
            ((2, 1, 4), false, RopeLayout::Halves, None),
        ];
        for (shape, gated, layout, mask) in cases {
            let flat = mask
                .as_ref()
                .map(|m| m.flatten_all().unwrap().to_vec1::<f32>().unwrap().into());
            let op = AttentionOp::new(shape, gated, layout, flat).unwrap();
            let (_, _, _, _, width) = op.columns();
            let proj = random_var(&mut rng, (b, s, width), -2.0..2.0);
            let angles = random(&mut rng, (b, s, shape.2 / 2), -3.0..3.0);
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let reference = composed(proj.as_tensor(), &cos, &sin, mask.as_ref(), &op);
            let fused = proj.as_tensor().apply_op3(&cos, &sin, op).unwrap();
            close(&fused, &reference, 1e-5);
            let weights = random(&mut rng, (b, s, shape.0 * shape.2), -1.0..1.0);
            let grad = |y: &Tensor| grads_of(y, &weights, &[&proj]).remove(0);
            close(&grad(&fused), &grad(&reference), 1e-4);
        }
    }

    /// Forward-only ops reuse each thread's buffers from unit to unit and call to call, here
    /// through shapes that grow, shrink and pass the size kept between calls: every output must
    /// still be the bits of the op that keeps its state.
    #[test]
    fn forward_only_gives_the_same_bits() {
        let mut rng = StdRng::seed_from_u64(12);
        let cases = [
            ((3, 3, 8), true, RopeLayout::Halves, 2, 17),
            ((4, 2, 6), false, RopeLayout::Interleaved, 3, 5),
            ((2, 1, 4), true, RopeLayout::Halves, 1, 1100),
            ((3, 3, 8), true, RopeLayout::Halves, 4, 9),
        ];
        for (shape, gated, layout, b, s) in cases {
            let blocks: Vec<usize> = (0..b).map(|i| i % 3 * s / 4).collect();
            let flat: Arc<[f32]> = mask(s, &blocks, &vec![0; b])
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into();
            let op = || AttentionOp::new(shape, gated, layout, Some(flat.clone())).unwrap();
            let (_, _, _, _, width) = op().columns();
            let proj = random(&mut rng, (b, s, width), -2.0..2.0);
            let angles = random(&mut rng, (b, s, shape.2 / 2), -3.0..3.0);
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let bits = |op: AttentionOp| {
                let out = proj.apply_op3(&cos, &sin, op).unwrap();
                let values = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                values.into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            let kept = bits(op());
            for _ in 0..2 {
                assert!(
                    bits(op().forward_only()) == kept,
                    "{shape:?}, {b} × {s}: forward-only output differs"
                );
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_compute() {
        assert!(AttentionOp::new((3, 2, 8), false, RopeLayout::Halves, None).is_err());
        assert!(AttentionOp::new((2, 2, 7), false, RopeLayout::Halves, None).is_err());
        let op = AttentionOp::new((2, 2, 4), true, RopeLayout::Halves, None).unwrap();
        let proj = Var::zeros(
            (1, 3, 10),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let angles = Tensor::zeros(
            (1, 3, 2),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let err = proj
            .as_tensor()
            .apply_op3(&angles, &angles, op)
            .unwrap_err()
            .to_string();
        assert!(err.contains("gate? + q + k + v"), "{err}");
    }
}
