//! Row selection by host ids (the embedding lookup) and its backward, a deterministic
//! scatter-add: validation and autograd here, kernels in src/kernels/index_select.rs.

use super::{DType, Shape, Tensor};
use crate::kernels::index_select;
use crate::tensor::autograd::record;
use crate::{Device, Error, Result};

impl Tensor {
    /// Rows `ids` of `self` along axis 0: `self` is (V, ..) of rank >= 1, the result is
    /// (ids.len(), ..) in `self`'s dtype, `out[i] = self[ids[i]]`. Ids may repeat and come in
    /// any order.
    ///
    /// fitgrad has no integer dtype, so ids are host data (they come from host batches anyway)
    /// and are checked here before any device work: an id of V or more is an
    /// [`Error::InvalidArgument`] naming the id, its position and V. A rank-0 `self` is an
    /// [`Error::Shape`].
    ///
    /// Backward: the gradient of row v of `self` is the sum of the output gradient's rows i with
    /// `ids[i] == v`, added in increasing i by one invocation per element (no atomics), so it is
    /// bitwise reproducible; rows never selected get 0.
    pub fn index_select(&self, ids: &[u32]) -> Result<Tensor> {
        const OP: &str = "index_select";
        let dims = self.dims();
        if dims.is_empty() {
            return Err(Error::Shape {
                op: OP,
                lhs: vec![],
                rhs: vec![ids.len()],
                reason: "rows are selected along axis 0, which a rank-0 tensor lacks".into(),
            });
        }
        let v = dims[0];
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("id {id} at position {i} is out of range for {v} rows"),
            });
        }
        let mut out_dims = dims.to_vec();
        out_dims[0] = ids.len();
        let shape = Shape::new(&out_dims).map_err(|_| Error::Limit {
            op: OP,
            what: "output element count",
            value: ids.len() as u64 * dims[1..].iter().product::<usize>() as u64,
            limit: u32::MAX as u64,
        })?;
        let d: usize = dims[1..].iter().product();
        let dev = self.device();
        // out is (n, d..)
        let out = Tensor::uninit(dev, shape, self.dtype())?;
        if out.numel() > 0 {
            let words = u32_words(dev, ids)?;
            index_select::gather(&words, self, d, &out)?;
        }
        let table_dims = dims.to_vec();
        Ok(record(OP, out, &[self], || {
            let ids = ids.to_vec();
            Box::new(move |g, _| Ok(vec![Some(scatter_rows(g, &ids, &table_dims)?)]))
        }))
    }
}

/// The gradient of a row gather: (V, d..) from `g` (n, d..) and the gathered ids.
fn scatter_rows(g: &Tensor, ids: &[u32], table_dims: &[usize]) -> Result<Tensor> {
    let dev = g.device();
    // out is (V, d..)
    let out = Tensor::uninit(dev, Shape::new(table_dims)?, g.dtype())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let v = table_dims[0];
    let d: usize = table_dims[1..].iter().product();
    let words = u32_words(dev, &row_lists(ids, v))?;
    index_select::scatter_add(&words, g, v, d, &out)?;
    Ok(out)
}

/// The positions of each row's ids, CSR-style: `v + 1` offsets (row r's positions are at
/// `offsets[r]..offsets[r + 1]` of the list), then the list, each row's positions increasing.
fn row_lists(ids: &[u32], v: usize) -> Vec<u32> {
    let mut out = vec![0u32; v + 1 + ids.len()];
    for &id in ids {
        out[id as usize + 1] += 1;
    }
    for r in 0..v {
        out[r + 1] += out[r];
    }
    let mut next: Vec<u32> = out[..v].to_vec();
    for (i, &id) in ids.iter().enumerate() {
        let slot = &mut next[id as usize];
        out[v + 1 + *slot as usize] = i as u32;
        *slot += 1;
    }
    out
}

/// A device block holding `words` as raw u32 (bound as `array<u32>` by kernels that take
/// indices). Typed f32 only to live in a tensor; it never reaches users.
fn u32_words(dev: &Device, words: &[u32]) -> Result<Tensor> {
    let t = Tensor::uninit(dev, Shape::new(&[words.len()])?, DType::F32)?;
    if !words.is_empty() {
        dev.upload(t.block(), bytemuck::cast_slice(words))?;
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::row_lists;

    #[test]
    fn row_lists_are_csr_in_increasing_position() {
        // ids 2, 0, 2, 2 over 4 rows: row 0 at position 1; row 2 at 0, 2, 3; rows 1 and 3 unused.
        assert_eq!(row_lists(&[2, 0, 2, 2], 4), vec![0, 1, 1, 4, 4, 1, 0, 2, 3]);
        assert_eq!(row_lists(&[], 2), vec![0, 0, 0]);
    }
}
