//! Weight gradients summed in place over a training step's backward passes.
//!
//! candle's backward pass gives each variable a zeroed buffer and adds every use's gradient into
//! it, each add making a new tensor, and the trainer then adds the micro-batches' sums together.
//! HRM-Text applies each layer's weights once per cycle, so every micro-batch zeroed each weight's
//! buffer and made a new one per application. While [`summing_weight_grads`] runs, the fused
//! products whose weight is a variable add that weight's gradient straight into one buffer per
//! weight with the GEMM (`dw += gᵀ · x`), and hand candle no gradient for it.
//!
//! Invariants:
//! - A sink belongs to the thread that installed it. candle runs a backward pass's ops on the
//!   thread that called `backward`, so every use of a weight in that pass reaches the sink.
//! - A buffer holds the sum of every gradient of its weight since the sink was installed, added
//!   in the order the backward passes produced them.
//! - Only a variable (a leaf that the trainer owns) is summed here. A weight made from variables
//!   (a stacked or cast copy) hands its gradient to candle, which carries it back to them.
//! - The sink is removed when the work returns or unwinds, so a failed step leaves none behind.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;

use candle_core::{Tensor, TensorId};

type Sums = HashMap<TensorId, Vec<f32>>;

thread_local! {
    static SINK: RefCell<Option<Sums>> = const { RefCell::new(None) };
}

/// The weight gradients that one [`summing_weight_grads`] summed, by variable.
pub struct WeightGrads(Sums);

impl WeightGrads {
    /// `w`'s summed gradient, as a tensor of `w`'s shape, taken out; `None` if no fused product
    /// summed one for it.
    pub fn take(&mut self, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.0
            .remove(&w.id())
            .map(|sum| shaped_as(w, sum))
            .transpose()
    }
}

/// A gradient's values as a tensor of its weight's shape, on its device.
fn shaped_as(w: &Tensor, grad: Vec<f32>) -> candle_core::Result<Tensor> {
    Tensor::from_vec(grad, w.shape(), w.device())
}

/// Runs `work` with a sink installed on this thread, and returns what it summed. An enclosing
/// sink is set aside meanwhile and put back afterwards.
pub fn summing_weight_grads<T>(work: impl FnOnce() -> T) -> (T, WeightGrads) {
    /// Puts the enclosing sink back, also when `work` unwinds.
    struct Installed(Option<Sums>);
    impl Drop for Installed {
        fn drop(&mut self) {
            SINK.set(self.0.take());
        }
    }
    let installed = Installed(SINK.replace(Some(Sums::new())));
    let out = work();
    let sums = SINK.take().unwrap_or_default();
    drop(installed);
    (out, WeightGrads(sums))
}

/// `w`'s gradient: added into this thread's sink when one is installed and `w` is a variable
/// (`new()` makes it for the first use of `w`, `add(sum)` adds it to the uses before), and then
/// `None`, nothing for candle to add; otherwise `new()` as a tensor of `w`'s shape, for candle.
pub(super) fn into_sink_or_tensor(
    w: &Tensor,
    new: impl FnOnce() -> Vec<f32>,
    add: impl FnOnce(&mut [f32]),
) -> candle_core::Result<Option<Tensor>> {
    let for_candle = if w.is_variable() {
        SINK.with_borrow_mut(|sink| match sink {
            Some(sums) => {
                match sums.entry(w.id()) {
                    Entry::Occupied(sum) => add(sum.into_mut()),
                    Entry::Vacant(slot) => {
                        slot.insert(new());
                    }
                }
                None
            }
            None => Some(new()),
        })
    } else {
        Some(new())
    };
    for_candle.map(|grad| shaped_as(w, grad)).transpose()
}

#[cfg(test)]
mod tests {
    use candle_core::{Tensor, Var};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::super::tests::{close, random, random_var};
    use super::super::{grouped_swiglu_mlp, head_cross_entropy, linear, swiglu_mlp};
    use super::*;

    /// The weights of a small stack that uses each of them more than once, as HRM-Text's cycles
    /// do: a linear layer applied twice, a SwiGLU MLP, a mixture of three experts (one of them
    /// given no rows in some passes) and the head inside the loss.
    struct Stack {
        proj: Var,
        gate_up: Var,
        down: Var,
        experts_gate_up: Var,
        experts_down: Var,
        head: Var,
    }

    impl Stack {
        fn new(rng: &mut StdRng) -> Self {
            let (hidden, inter, vocab) = (24, 40, 56);
            Self {
                proj: random_var(rng, (hidden, hidden), -0.3..0.3),
                gate_up: random_var(rng, (2 * inter, hidden), -0.3..0.3),
                down: random_var(rng, (hidden, inter), -0.3..0.3),
                experts_gate_up: random_var(rng, (3, 2 * inter, hidden), -0.3..0.3),
                experts_down: random_var(rng, (3, hidden, inter), -0.3..0.3),
                head: random_var(rng, (vocab, hidden), -0.3..0.3),
            }
        }

        fn vars(&self) -> [&Var; 6] {
            [
                &self.proj,
                &self.gate_up,
                &self.down,
                &self.experts_gate_up,
                &self.experts_down,
                &self.head,
            ]
        }

        /// The loss of `x` (`[rows, 24]`) whose labels are `labels`; the second expert gets no
        /// rows when `rows` is odd.
        fn loss(&self, x: &Tensor, labels: &[u32]) -> Tensor {
            let h = linear(x, self.proj.as_tensor()).unwrap();
            let h = (linear(&h, self.proj.as_tensor()).unwrap() + x).unwrap();
            let h = swiglu_mlp(&h, self.gate_up.as_tensor(), self.down.as_tensor()).unwrap();
            let rows = labels.len();
            let second = if rows % 2 == 1 { 0 } else { 6 };
            let sizes = [rows - 5 - second, second, 5];
            let experts = self.experts_gate_up.as_tensor();
            let h = grouped_swiglu_mlp(&h, experts, self.experts_down.as_tensor(), &sizes);
            head_cross_entropy(&h.unwrap(), self.head.as_tensor(), labels).unwrap()
        }
    }

    fn inputs(rng: &mut StdRng, passes: usize) -> Vec<(Tensor, Vec<u32>)> {
        (0..passes)
            .map(|pass| {
                let rows = 70 + 9 * pass;
                let labels = (0..rows).map(|i| (i * 7 + pass) as u32 % 56).collect();
                (random(rng, (rows, 24), -1.0..1.0), labels)
            })
            .collect()
    }

    /// Over two backward passes, the sums in place are candle's sums of the same passes, and
    /// candle is handed no gradient for a weight the sink took.
    #[test]
    fn sums_in_place_are_candles_sums() {
        let mut rng = StdRng::seed_from_u64(40);
        let stack = Stack::new(&mut rng);
        let passes = inputs(&mut rng, 2);
        let candles: Vec<Tensor> = stack
            .vars()
            .iter()
            .map(|var| {
                let per_pass = passes.iter().map(|(x, labels)| {
                    let store = stack.loss(x, labels).backward().unwrap();
                    store.get(var.as_tensor()).unwrap().clone()
                });
                per_pass.reduce(|a, b| (a + b).unwrap()).unwrap()
            })
            .collect();
        let (stores, mut sums) = summing_weight_grads(|| {
            passes
                .iter()
                .map(|(x, labels)| stack.loss(x, labels).backward().unwrap())
                .collect::<Vec<_>>()
        });
        for (var, candle) in stack.vars().into_iter().zip(&candles) {
            for store in &stores {
                assert!(store.get(var.as_tensor()).is_none(), "candle got it too");
            }
            let sum = sums
                .take(var.as_tensor())
                .unwrap()
                .expect("summed in place");
            assert_eq!(sum.dims(), var.dims());
            close(&sum, candle, 1e-5);
            assert!(sums.take(var.as_tensor()).unwrap().is_none(), "taken once");
        }
    }

    /// A weight made from a variable is not summed in place: its gradient goes back through
    /// candle to the variable.
    #[test]
    fn a_weight_made_from_a_variable_reaches_it_through_candle() {
        let mut rng = StdRng::seed_from_u64(41);
        let w = random_var(&mut rng, (16, 24), -0.3..0.3);
        let x = random(&mut rng, (30, 24), -1.0..1.0);
        let loss = |w: &Tensor| linear(&x, w).unwrap().sqr().unwrap().sum_all().unwrap();
        let direct = loss(w.as_tensor()).backward().unwrap();
        let (store, mut sums) =
            summing_weight_grads(|| loss(&(w.as_tensor() * 1.0).unwrap()).backward().unwrap());
        let through_candle = store.get(w.as_tensor()).expect("candle carried it back");
        close(through_candle, direct.get(w.as_tensor()).unwrap(), 1e-6);
        assert!(sums.take(w.as_tensor()).unwrap().is_none());
    }

    /// Outside [`summing_weight_grads`], after it returns or unwinds, candle gets every weight
    /// gradient; a sink inside another sums only its own passes, and the outer one carries on.
    #[test]
    fn the_sink_is_there_only_while_its_work_runs() {
        let mut rng = StdRng::seed_from_u64(42);
        let stack = Stack::new(&mut rng);
        let passes = inputs(&mut rng, 3);
        let candle_gets = |pass: usize| {
            let (x, labels) = &passes[pass];
            let store = stack.loss(x, labels).backward().unwrap();
            stack.vars().map(|v| store.get(v.as_tensor()).is_some())
        };
        assert_eq!(candle_gets(0), [true; 6], "no sink before");
        let unwound = std::panic::catch_unwind(|| {
            summing_weight_grads(|| panic!("a step that fails part-way"))
        });
        assert!(unwound.is_err());
        assert_eq!(candle_gets(0), [true; 6], "no sink after an unwind");

        let backward = |pass: usize| {
            let (x, labels) = &passes[pass];
            stack.loss(x, labels).backward().unwrap();
        };
        let ((), mut outer) = summing_weight_grads(|| {
            backward(0);
            let ((), mut inner) = summing_weight_grads(|| backward(1));
            let ((), mut alone) = summing_weight_grads(|| backward(1));
            let proj = stack.proj.as_tensor();
            close(
                &inner.take(proj).unwrap().unwrap(),
                &alone.take(proj).unwrap().unwrap(),
                0.0,
            );
            backward(2);
        });
        let ((), mut without_the_inner) = summing_weight_grads(|| {
            backward(0);
            backward(2);
        });
        let proj = stack.proj.as_tensor();
        let want = without_the_inner.take(proj).unwrap().unwrap();
        close(&outer.take(proj).unwrap().unwrap(), &want, 0.0);
        assert_eq!(candle_gets(2), [true; 6], "no sink after it returns");
    }
}
