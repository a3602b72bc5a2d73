//! Small helpers over the `safetensors` crate: owned views, deterministic encoding, and strict
//! typed reads.

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors, View};

use crate::error::{ModelError, Result};

/// Key of the single metadata entry we write. safetensors stores metadata in a `HashMap`, whose
/// serialisation order is random when there are several keys; one key keeps bytes (and their
/// BLAKE3) reproducible.
pub(crate) const META_KEY: &str = "iota";

pub(crate) struct OwnedView {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for OwnedView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

pub(crate) fn f32_view(shape: Vec<usize>, values: &[f32]) -> OwnedView {
    OwnedView {
        dtype: Dtype::F32,
        shape,
        data: f32_to_le(values),
    }
}

pub(crate) fn f32_to_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(crate) fn le_to_f32(bytes: &[u8]) -> Result<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(ModelError::Wire(format!(
            "{} bytes is not a whole number of f32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Serialise named tensors with one JSON metadata string.
pub(crate) fn encode(tensors: Vec<(String, OwnedView)>, meta: &str) -> Result<Vec<u8>> {
    let mut info = HashMap::new();
    info.insert(META_KEY.to_string(), meta.to_string());
    Ok(safetensors::serialize(tensors, Some(info))?)
}

/// Parsed buffer plus its metadata string.
pub(crate) fn decode(bytes: &[u8]) -> Result<(SafeTensors<'_>, String)> {
    let (_, metadata) = SafeTensors::read_metadata(bytes)?;
    let meta = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .cloned()
        .ok_or_else(|| ModelError::Wire(format!("missing {META_KEY:?} metadata entry")))?;
    Ok((SafeTensors::deserialize(bytes)?, meta))
}

/// Read tensor `name` as f32, checking dtype and (when given) shape.
pub(crate) fn read_f32(
    st: &SafeTensors<'_>,
    name: &str,
    shape: Option<&[usize]>,
) -> Result<(Vec<usize>, Vec<f32>)> {
    let view = st
        .tensor(name)
        .map_err(|_| ModelError::Wire(format!("missing tensor {name:?}")))?;
    if view.dtype() != Dtype::F32 {
        return Err(ModelError::Wire(format!(
            "tensor {name:?} has dtype {:?}, expected F32",
            view.dtype()
        )));
    }
    if let Some(s) = shape
        && view.shape() != s
    {
        return Err(ModelError::shape(name, s, view.shape()));
    }
    Ok((view.shape().to_vec(), le_to_f32(view.data())?))
}
