//! How a [`ModelSpec`] is trained: its model built over a `VarMap`, and its seeded
//! initialisation.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::config::ModelSpec;
use crate::hrm_text::HrmText;
use crate::llama::Llama;
use crate::{CausalLm, Error, Result};

impl ModelSpec {
    pub(super) fn aux_loss_coef(&self) -> f64 {
        match self {
            Self::HrmText(c) if c.is_moe() => c.router_aux_loss_coef.unwrap_or(0.01),
            _ => 0.0,
        }
    }

    fn initializer_range(&self) -> f64 {
        match self {
            Self::HrmText(c) => c.initializer_range,
            Self::Llama(_) => 0.02,
        }
    }

    /// Builds the model over `varmap` (creating its variables on first use).
    pub fn build(
        &self,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
    ) -> Result<Box<dyn CausalLm>> {
        let vb = VarBuilder::from_varmap(varmap, dtype, device);
        Ok(match self {
            Self::HrmText(c) => Box::new(HrmText::new(c.clone(), vb)?),
            Self::Llama(c) => Box::new(Llama::new(c, vb)?),
        })
    }

    /// Seeded initialisation as transformers does it: every matrix and embedding from
    /// N(0, initializer_range), norm weights 1, `z_L_init` 0.
    pub fn initialise(&self, varmap: &VarMap, seed: u64) -> Result<()> {
        let normal = Normal::new(0.0, self.initializer_range())
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let mut rng = StdRng::seed_from_u64(seed);
        for (name, var) in sorted_vars(varmap) {
            let t = var.as_tensor();
            let values: Vec<f64> = if name.ends_with("z_L_init") {
                vec![0.0; t.elem_count()]
            } else if name.contains("norm") && t.rank() == 1 {
                vec![1.0; t.elem_count()]
            } else {
                (0..t.elem_count())
                    .map(|_| normal.sample(&mut rng))
                    .collect()
            };
            let init = Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(t.dtype())?;
            var.set(&init)?;
        }
        Ok(())
    }
}

/// The model's variables by name, in name order (so every walk over them is deterministic).
pub fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Variables the optimiser updates: all but the frozen `z_L_init`.
pub fn trainable_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    sorted_vars(varmap)
        .into_iter()
        .filter(|(name, _)| !name.ends_with("z_L_init"))
        .collect()
}

/// Builds `spec` in f32 with its variables set from `weights` (name to tensor), which must
/// hold every variable with its shape.
pub fn build_with_weights(
    spec: &ModelSpec,
    weights: &HashMap<String, Tensor>,
    device: &Device,
) -> Result<(VarMap, Box<dyn CausalLm>)> {
    let varmap = VarMap::new();
    let model = spec.build(&varmap, DType::F32, device)?;
    for (name, var) in sorted_vars(&varmap) {
        let value = weights
            .get(&name)
            .ok_or_else(|| Error::InvalidInput(format!("weights lack `{name}`")))?;
        if value.dims() != var.as_tensor().dims() {
            return Err(Error::InvalidInput(format!(
                "`{name}` has shape {:?}, the model's is {:?}",
                value.dims(),
                var.as_tensor().dims()
            )));
        }
        var.set(&value.to_dtype(DType::F32)?.to_device(device)?)?;
    }
    Ok((varmap, model))
}
