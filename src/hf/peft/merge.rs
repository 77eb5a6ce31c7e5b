//! Merging an adapter into its base's folder: the merged weights on the host
//! ([`Adapter::merged_weights`]), the bases that merge ([`MergeBase`]), and [`merge_adapter`].

use super::Adapter;
use crate::checkpoint::HostTensor;
use crate::hf::gpt2::{save_host, PretrainedGpt};
use crate::hf::llama::{save_host as save_llama_host, PretrainedLlama};
use crate::{DType, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

impl Adapter {
    /// The base's weights with `scaling · B A` added to every target (f32 on the host, in
    /// f64 sums), by the model's names.
    pub fn merged_weights<B: MergeBase + ?Sized>(
        &self,
        base: &B,
    ) -> Result<BTreeMap<String, HostTensor>> {
        let mut w = base.base_weights();
        let s = self.spec.config.scaling() as f64;
        for (t, (a, b)) in self.targets.iter().zip(&self.factors) {
            let key = format!("{}.weight", t.ours);
            let h = w.get_mut(&key).ok_or_else(|| Error::InvalidArgument {
                op: "merge_adapter",
                reason: format!("the base has no '{key}'"),
            })?;
            let (a, b) = (a.to_f32(), b.to_f32());
            let mut v = h.to_f32();
            let (r, k) = (self.spec.config.r, t.in_features);
            for o in 0..t.out_features {
                for i in 0..k {
                    let d: f64 = (0..r)
                        .map(|j| b[o * r + j] as f64 * a[j * k + i] as f64)
                        .sum();
                    v[o * k + i] = (v[o * k + i] as f64 + s * d) as f32;
                }
            }
            let bytes = match h.dtype {
                DType::F32 => bytemuck::cast_slice(&v).to_vec(),
                DType::F16 => {
                    let halves: Vec<half::f16> =
                        v.iter().map(|&x| half::f16::from_f32(x)).collect();
                    bytemuck::cast_slice(&halves).to_vec()
                }
            };
            *h = HostTensor::new(h.dtype, &h.dims, bytes)?;
        }
        Ok(w)
    }
}

/// A model folder an adapter merges into: its weights on the host by the model's parameter
/// names, and a writer of a folder of its kind (a GPT-2's or a Llama's) that transformers
/// loads, with the base's tokenizer when it has one.
pub trait MergeBase {
    /// The base's weights on the host, by the model's parameter names.
    fn base_weights(&self) -> BTreeMap<String, HostTensor>;
    /// Writes `weights` (the base's names and shapes) to `dir` as a folder of the base's kind.
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()>;
}

impl MergeBase for PretrainedGpt {
    fn base_weights(&self) -> BTreeMap<String, HostTensor> {
        self.host_weights().clone()
    }
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()> {
        save_host(&self.config, weights, dir, tokenizer_bytes(&self.dir)?)
    }
}

impl MergeBase for PretrainedLlama {
    fn base_weights(&self) -> BTreeMap<String, HostTensor> {
        self.host_weights()
    }
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()> {
        save_llama_host(&self.config, weights, dir, tokenizer_bytes(&self.dir)?)
    }
}

/// The bytes of `dir`'s `tokenizer.json`, if it has one.
fn tokenizer_bytes(dir: &Path) -> Result<Option<Vec<u8>>> {
    let tok = dir.join(crate::hf::TOKENIZER_FILE);
    if !tok.is_file() {
        return Ok(None);
    }
    std::fs::read(&tok).map(Some).map_err(|source| Error::Io {
        path: tok.display().to_string(),
        source,
    })
}

/// Writes `base` with `adapter` merged into its weights to `dir` as a folder of the base's
/// kind that transformers loads (as [`save_gpt2`](crate::hf::save_gpt2) or
/// [`save_llama`](crate::hf::save_llama) writes one), with the base's tokenizer when it has one.
/// Host only: the merge is into the folder's weights as read, never into a quantized copy.
pub fn merge_adapter<B: MergeBase + ?Sized>(base: &B, adapter: &Adapter, dir: &Path) -> Result<()> {
    base.write_folder(&adapter.merged_weights(base)?, dir)
}
