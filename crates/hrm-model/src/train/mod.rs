//! Training on candle's autograd, through the models' one forward pass.
//!
//! - [`ModelSpec`](crate::ModelSpec), an architecture's config, builds the model over a `VarMap` and
//!   initialises it from a seed (candle's CPU random generator cannot be seeded, so we draw the
//!   initial weights ourselves).
//! - [`lm_loss`] is next-token cross-entropy, plus `router_aux_loss_coef` times the load-balancing
//!   loss for `hrm_text_moe`. HRM's truncated backpropagation (`L_bp_cycles`) is part of the
//!   forward pass.
//! - [`AdamW`] is decoupled weight decay Adam. It is ours rather than candle-nn's because a run
//!   must checkpoint and resume its moments, which candle-nn's optimiser keeps private.
//! - [`Trainer::step`] accumulates gradients over micro-batches ([`batch_gradients`]), clips
//!   their global norm and applies one optimiser step at the scheduled learning rate
//!   ([`LrSchedule`]). The fused products add their weights' gradients in place over the whole
//!   step (`crate::fused::summing_weight_grads`); candle's backward pass gives the rest.
//!
//! Everything is deterministic for a given seed: initialisation, data order (see the trainer
//! binary) and the arithmetic, which runs in a fixed order on the CPU.
//!
//! The parts: [`spec`] (architectures and their initialisation), [`optim`] (AdamW and the
//! schedule), [`trainer`] (the step), [`data`] (corpora and windows), [`export`] (Hugging Face
//! checkpoints) and [`local`] (the volunteer network's one computation).

mod data;
mod export;
mod local;
mod optim;
mod spec;
mod trainer;

pub use data::*;
pub use export::*;
pub use local::*;
pub use optim::*;
pub use spec::*;
pub use trainer::*;
