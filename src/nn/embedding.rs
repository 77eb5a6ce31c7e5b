//! `Embedding`: a (V, D) table whose rows are looked up by host ids, as torch's `nn.Embedding`.
//! The lookup is one gather kernel; its gradient a deterministic scatter-add (see
//! [`Tensor::index_select`]).

use super::Module;
use crate::{DType, Device, Error, Result, Tensor};

/// A lookup table of learned rows, like torch's `nn.Embedding`.
#[derive(Clone)]
pub struct Embedding {
    /// (num_embeddings, dim)
    pub weight: Tensor,
    /// Rows in the table (ids must be below it).
    pub num_embeddings: usize,
    /// Width of each row.
    pub dim: usize,
}

impl Embedding {
    /// A (num_embeddings, dim) f32 table drawn from N(0, 1) with `seed`, as torch initializes
    /// `nn.Embedding`.
    pub fn new(device: &Device, num_embeddings: usize, dim: usize, seed: u64) -> Result<Embedding> {
        Embedding::with_dtype(device, num_embeddings, dim, DType::F32, seed)
    }

    /// [`Embedding::new`] stored in `dtype`.
    pub fn with_dtype(
        device: &Device,
        num_embeddings: usize,
        dim: usize,
        dtype: DType,
        seed: u64,
    ) -> Result<Embedding> {
        if num_embeddings == 0 || dim == 0 {
            return Err(Error::InvalidArgument {
                op: "Embedding::new",
                reason: format!(
                    "sizes must be positive, got {num_embeddings} embeddings of dim {dim}"
                ),
            });
        }
        let weight = Tensor::randn(device, &[num_embeddings, dim], 0.0, 1.0, seed, dtype)?
            .with_requires_grad();
        Ok(Embedding {
            weight,
            num_embeddings,
            dim,
        })
    }

    /// The rows of `ids`, shaped `(dims_of_ids.., dim)`: ids (B, T) give (B, T, D). The
    /// product of `dims_of_ids` must be `ids.len()` and the result's rank at most 4
    /// ([`Error::Shape`]); an id of `num_embeddings` or more is an [`Error::InvalidArgument`].
    /// Both are checked before any device work.
    pub fn forward_ids(&self, ids: &[u32], dims_of_ids: &[usize]) -> Result<Tensor> {
        let mut out_dims = dims_of_ids.to_vec();
        out_dims.push(self.dim);
        if dims_of_ids.iter().product::<usize>() != ids.len()
            || out_dims.len() > crate::tensor::MAX_RANK
        {
            return Err(Error::Shape {
                op: "Embedding::forward_ids",
                lhs: vec![ids.len()],
                rhs: dims_of_ids.to_vec(),
                reason: format!(
                    "{} ids cannot be seen as {dims_of_ids:?} followed by the embedding dim (rank <= 4)",
                    ids.len()
                ),
            });
        }
        self.weight.index_select(ids)?.reshape(&out_dims)
    }
}

impl Module for Embedding {
    /// Always an [`Error::InvalidArgument`]: ids are host integers (fitgrad has no integer
    /// dtype), and reading a tensor of ids back would be a hidden sync. Use
    /// [`Embedding::forward_ids`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::InvalidArgument {
            op: "Embedding::forward",
            reason: "an embedding looks up host ids; call forward_ids(ids, dims_of_ids)".into(),
        })
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}
