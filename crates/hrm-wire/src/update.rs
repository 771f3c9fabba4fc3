//! The two safetensors files of the network: checkpoints (every parameter in f32) and update
//! files (the worker's pseudo-gradient, dense or top-k sparse), with every check the hub applies
//! to an upload.
//!
//! Parameters are handled as one flat `f32` vector in the order of a [`Schema`] (names sorted),
//! which is what the aggregation rules work on.

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};

/// The SHA-256 of a file as lowercase hex: how checkpoints are named and checked on both ends.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Metadata key and value that mark an update file.
pub const FORMAT_KEY: &str = "format";
pub const UPDATE_FORMAT: &str = "hrm-update-v1";
/// `dense` or `topk`.
pub const ENCODING_KEY: &str = "encoding";
/// The version the update was computed on.
pub const BASE_VERSION_KEY: &str = "base_version";

const INDICES_SUFFIX: &str = ":indices";
const VALUES_SUFFIX: &str = ":values";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum UpdateError {
    #[error("not a safetensors file: {0}")]
    Parse(String),
    #[error("metadata `format` must be `{UPDATE_FORMAT}`")]
    Format,
    #[error("metadata `encoding` must be `dense` or `topk`, found {0:?}")]
    Encoding(Option<String>),
    #[error("update was computed on {found:?} but is uploaded for {expected}")]
    BaseVersion {
        expected: String,
        found: Option<String>,
    },
    #[error("tensor `{0}` is missing")]
    Missing(String),
    #[error("tensor `{0}` is not a parameter of this model")]
    Unexpected(String),
    #[error("tensor `{name}` has shape {found:?}, the model's is {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {found}; allowed: {allowed}")]
    Dtype {
        name: String,
        found: String,
        allowed: &'static str,
    },
    #[error("tensor `{0}` holds NaN or infinite values")]
    NonFinite(String),
    #[error("sparse tensor `{0}`: indices must be strictly increasing and inside the parameter")]
    Indices(String),
    #[error("sparse tensor `{0}`: indices and values differ in length")]
    SparseLength(String),
}

/// One parameter: name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parameters of a model in flattening order (sorted by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    pub params: Vec<ParamSpec>,
}

impl Schema {
    pub fn new(mut params: Vec<ParamSpec>) -> Self {
        params.sort_by(|a, b| a.name.cmp(&b.name));
        Self { params }
    }

    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }

    /// Each parameter with its range in the flat vector.
    pub fn offsets(&self) -> impl Iterator<Item = (&ParamSpec, std::ops::Range<usize>)> {
        let mut start = 0;
        self.params.iter().map(move |p| {
            let range = start..start + p.numel();
            start = range.end;
            (p, range)
        })
    }
}

/// Reads a checkpoint: its schema and all its values, converted to f32.
pub fn read_checkpoint(bytes: &[u8]) -> Result<(Schema, Vec<f32>), UpdateError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| UpdateError::Parse(e.to_string()))?;
    let schema = Schema::new(
        file.iter()
            .map(|(name, view)| ParamSpec {
                name: name.to_string(),
                shape: view.shape().to_vec(),
            })
            .collect(),
    );
    let mut flat = Vec::with_capacity(schema.num_parameters());
    for spec in &schema.params {
        let view = file
            .tensor(&spec.name)
            .map_err(|e| UpdateError::Parse(e.to_string()))?;
        push_floats(&spec.name, &view, &mut flat)?;
    }
    Ok((schema, flat))
}

/// The `__metadata__` of a safetensors file.
pub fn read_metadata(bytes: &[u8]) -> Result<HashMap<String, String>, UpdateError> {
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| UpdateError::Parse(e.to_string()))?;
    Ok(header.metadata().clone().unwrap_or_default())
}

/// Writes a checkpoint in f32 with the given metadata.
pub fn write_checkpoint(
    schema: &Schema,
    flat: &[f32],
    metadata: HashMap<String, String>,
) -> Vec<u8> {
    let encoded: Vec<Tensor> = schema
        .offsets()
        .map(|(spec, range)| {
            (
                spec.name.clone(),
                Dtype::F32,
                f32_bytes(&flat[range]),
                spec.shape.clone(),
            )
        })
        .collect();
    serialize(&encoded, metadata)
}

/// How an update file stores its values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Encoding {
    /// Every value, f32.
    Dense,
    /// Per parameter, the `ceil(ratio * numel)` values of largest magnitude with their indices.
    TopK { ratio: f32 },
}

/// Encodes a flat update computed on `base_version`.
pub fn encode_update(
    schema: &Schema,
    flat: &[f32],
    base_version: &str,
    encoding: Encoding,
) -> Vec<u8> {
    assert_eq!(
        flat.len(),
        schema.num_parameters(),
        "update length must match the schema"
    );
    let mut metadata = HashMap::from([
        (FORMAT_KEY.to_string(), UPDATE_FORMAT.to_string()),
        (BASE_VERSION_KEY.to_string(), base_version.to_string()),
    ]);
    match encoding {
        Encoding::Dense => {
            metadata.insert(ENCODING_KEY.into(), "dense".into());
            write_checkpoint(schema, flat, metadata)
        }
        Encoding::TopK { ratio } => {
            metadata.insert(ENCODING_KEY.into(), "topk".into());
            let mut tensors = Vec::new();
            for (spec, range) in schema.offsets() {
                let part = &flat[range];
                let k = ((part.len() as f32 * ratio).ceil() as usize).clamp(1, part.len());
                let mut order: Vec<u32> = (0..part.len() as u32).collect();
                order.select_nth_unstable_by(k - 1, |&a, &b| {
                    part[b as usize].abs().total_cmp(&part[a as usize].abs())
                });
                order.truncate(k);
                order.sort_unstable();
                let kept: Vec<f32> = order.iter().map(|&i| part[i as usize]).collect();
                let index_bytes: Vec<u8> = order.iter().flat_map(|i| i.to_le_bytes()).collect();
                tensors.push((
                    format!("{}{INDICES_SUFFIX}", spec.name),
                    Dtype::U32,
                    index_bytes,
                    vec![k],
                ));
                tensors.push((
                    format!("{}{VALUES_SUFFIX}", spec.name),
                    Dtype::F32,
                    f32_bytes(&kept),
                    vec![k],
                ));
            }
            serialize(&tensors, metadata)
        }
    }
}

/// Whether an update file holds top-k values with their indices rather than every value.
pub fn is_top_k(bytes: &[u8]) -> Result<bool, UpdateError> {
    is_sparse(&read_metadata(bytes)?)
}

fn is_sparse(metadata: &HashMap<String, String>) -> Result<bool, UpdateError> {
    match metadata.get(ENCODING_KEY).map(String::as_str) {
        Some("dense") => Ok(false),
        Some("topk") => Ok(true),
        other => Err(UpdateError::Encoding(other.map(str::to_string))),
    }
}

/// Decodes and checks an uploaded update against the model's schema: the format marker, the
/// base version, every tensor's name, shape and dtype, no NaN or Inf, and for sparse files the
/// indices. Returns the dense flat update.
pub fn decode_update(
    bytes: &[u8],
    schema: &Schema,
    expected_base_version: &str,
) -> Result<Vec<f32>, UpdateError> {
    let metadata = read_metadata(bytes)?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| UpdateError::Parse(e.to_string()))?;
    if metadata.get(FORMAT_KEY).map(String::as_str) != Some(UPDATE_FORMAT) {
        return Err(UpdateError::Format);
    }
    let base = metadata.get(BASE_VERSION_KEY).cloned();
    if base.as_deref() != Some(expected_base_version) {
        return Err(UpdateError::BaseVersion {
            expected: expected_base_version.to_string(),
            found: base,
        });
    }
    let sparse = is_sparse(&metadata)?;
    let expected_names: BTreeSet<String> = schema
        .params
        .iter()
        .flat_map(|p| {
            if sparse {
                vec![
                    format!("{}{INDICES_SUFFIX}", p.name),
                    format!("{}{VALUES_SUFFIX}", p.name),
                ]
            } else {
                vec![p.name.clone()]
            }
        })
        .collect();
    if let Some(extra) = file
        .names()
        .into_iter()
        .find(|n| !expected_names.contains(*n))
    {
        return Err(UpdateError::Unexpected(extra.to_string()));
    }
    let tensor = |name: &str| {
        file.tensor(name)
            .map_err(|_| UpdateError::Missing(name.to_string()))
    };
    let mut flat = Vec::with_capacity(schema.num_parameters());
    for spec in &schema.params {
        if sparse {
            let idx_name = format!("{}{INDICES_SUFFIX}", spec.name);
            let val_name = format!("{}{VALUES_SUFFIX}", spec.name);
            let (idx, val) = (tensor(&idx_name)?, tensor(&val_name)?);
            if idx.dtype() != Dtype::U32 {
                return Err(dtype_error(&idx_name, idx.dtype(), "U32"));
            }
            let mut values = Vec::new();
            push_floats(&val_name, &val, &mut values)?;
            let indices: Vec<u32> = idx
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if idx.shape().len() != 1 || val.shape() != idx.shape() {
                return Err(UpdateError::SparseLength(spec.name.clone()));
            }
            let numel = spec.numel();
            let increasing = indices.windows(2).all(|w| w[0] < w[1]);
            if !increasing || indices.last().is_some_and(|&i| i as usize >= numel) {
                return Err(UpdateError::Indices(spec.name.clone()));
            }
            let start = flat.len();
            flat.resize(start + numel, 0.0);
            for (&i, &v) in indices.iter().zip(&values) {
                flat[start + i as usize] = v;
            }
        } else {
            let view = tensor(&spec.name)?;
            if view.shape() != spec.shape.as_slice() {
                return Err(UpdateError::Shape {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    found: view.shape().to_vec(),
                });
            }
            push_floats(&spec.name, &view, &mut flat)?;
        }
    }
    Ok(flat)
}

fn dtype_error(name: &str, found: Dtype, allowed: &'static str) -> UpdateError {
    UpdateError::Dtype {
        name: name.to_string(),
        found: format!("{found:?}"),
        allowed,
    }
}

/// Appends a float tensor's values as f32, refusing NaN and Inf.
fn push_floats(name: &str, view: &TensorView<'_>, out: &mut Vec<f32>) -> Result<(), UpdateError> {
    let start = out.len();
    let data = view.data();
    match view.dtype() {
        Dtype::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Dtype::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Dtype::F16 => out.extend(
            data.chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        other => return Err(dtype_error(name, other, "F32, BF16, F16")),
    }
    if out[start..].iter().any(|v| !v.is_finite()) {
        return Err(UpdateError::NonFinite(name.to_string()));
    }
    Ok(())
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A tensor to write: name, dtype, little-endian bytes, shape.
type Tensor = (String, Dtype, Vec<u8>, Vec<usize>);

fn serialize(tensors: &[Tensor], metadata: HashMap<String, String>) -> Vec<u8> {
    let views = tensors.iter().map(|(name, dtype, data, shape)| {
        (
            name.clone(),
            TensorView::new(*dtype, shape.clone(), data).expect("sized by the schema"),
        )
    });
    safetensors::tensor::serialize(views, Some(metadata)).expect("serialisable")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Schema {
        Schema::new(vec![
            ParamSpec {
                name: "w".into(),
                shape: vec![3, 4],
            },
            ParamSpec {
                name: "b".into(),
                shape: vec![5],
            },
        ])
    }

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 - 7.5) * 0.25).collect()
    }

    #[test]
    fn dense_round_trip_and_checks() {
        let s = schema();
        let flat = ramp(s.num_parameters());
        let bytes = encode_update(&s, &flat, "v0.1.0", Encoding::Dense);
        assert_eq!(decode_update(&bytes, &s, "v0.1.0").unwrap(), flat);
        assert!(matches!(
            decode_update(&bytes, &s, "v0.1.1"),
            Err(UpdateError::BaseVersion { .. })
        ));
        let other = Schema::new(vec![
            ParamSpec {
                name: "w".into(),
                shape: vec![4, 3],
            },
            s.params[0].clone(),
        ]);
        assert!(matches!(
            decode_update(&bytes, &other, "v0.1.0"),
            Err(UpdateError::Shape { .. })
        ));
        let renamed = Schema::new(vec![
            ParamSpec {
                name: "v".into(),
                shape: vec![3, 4],
            },
            s.params[0].clone(),
        ]);
        assert!(matches!(
            decode_update(&bytes, &renamed, "v0.1.0"),
            Err(UpdateError::Unexpected(_))
        ));
        let mut poisoned = flat.clone();
        poisoned[3] = f32::NAN;
        let bytes = encode_update(&s, &poisoned, "v0.1.0", Encoding::Dense);
        assert_eq!(
            decode_update(&bytes, &s, "v0.1.0"),
            Err(UpdateError::NonFinite("b".into()))
        );
        assert!(matches!(
            decode_update(b"not safetensors", &s, "v0.1.0"),
            Err(UpdateError::Parse(_))
        ));
    }

    #[test]
    fn a_checkpoint_is_not_an_update() {
        let s = schema();
        let bytes = write_checkpoint(&s, &ramp(s.num_parameters()), HashMap::new());
        assert_eq!(
            decode_update(&bytes, &s, "v0.1.0"),
            Err(UpdateError::Format)
        );
        let (read_schema, values) = read_checkpoint(&bytes).unwrap();
        assert_eq!((read_schema, values), (s.clone(), ramp(s.num_parameters())));
    }

    #[test]
    fn topk_keeps_the_largest_values_of_each_parameter() {
        let s = schema();
        let flat = ramp(s.num_parameters());
        let bytes = encode_update(&s, &flat, "v0.1.0", Encoding::TopK { ratio: 0.4 });
        let decoded = decode_update(&bytes, &s, "v0.1.0").unwrap();
        for (spec, range) in s.offsets() {
            let (orig, got) = (&flat[range.clone()], &decoded[range]);
            let k = (spec.numel() as f64 * 0.4).ceil() as usize;
            let kept: Vec<usize> = (0..orig.len()).filter(|&i| got[i] != 0.0).collect();
            assert_eq!(kept.len(), k, "{}", spec.name);
            let smallest_kept = kept
                .iter()
                .map(|&i| orig[i].abs())
                .fold(f32::INFINITY, f32::min);
            for i in 0..orig.len() {
                if got[i] == 0.0 {
                    assert!(orig[i].abs() <= smallest_kept);
                } else {
                    assert_eq!(got[i], orig[i]);
                }
            }
        }
    }
}
