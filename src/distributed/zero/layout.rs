//! Where each rank's shard of the parameters lies: the parameters laid end to end in one flat
//! buffer, each starting on a [`GRANULE`] boundary, cut into `ranks` equal shards (the last
//! padded with zeros). Fixed by the parameter list and the rank count alone, so every rank
//! computes the same boundaries; a shard may start and end inside a tensor.

use crate::{Error, Result};
use std::ops::Range;

/// Elements every parameter's offset and every shard boundary are a multiple of: 512 bytes of
/// f32, 256 of f16, so a piece of a parameter inside a shard starts on an arena block boundary
/// and the optimizer updates it in place through a view.
pub const GRANULE: usize = 128;

/// One parameter's part of one rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in the list the layout was made from.
    pub param: usize,
    /// The piece's elements within the parameter.
    pub within: Range<usize>,
    /// Where the piece starts within the shard.
    pub at: usize,
}

/// The flat, padded layout of a parameter list over `ranks` shards (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    numels: Vec<usize>,
    offsets: Vec<usize>,
    shard_len: usize,
    ranks: usize,
}

impl ShardLayout {
    /// The layout of parameters of `numels` elements over `ranks` (at least 1) shards.
    pub fn new(numels: &[usize], ranks: usize) -> Result<ShardLayout> {
        let invalid = |reason: String| Error::InvalidArgument {
            op: "ShardLayout::new",
            reason,
        };
        if ranks == 0 {
            return Err(invalid("a layout needs at least one rank".into()));
        }
        let mut offsets = Vec::with_capacity(numels.len());
        let mut end = 0usize;
        for &n in numels {
            let at = end
                .checked_next_multiple_of(GRANULE)
                .ok_or_else(|| invalid("the parameters' elements overflow".into()))?;
            offsets.push(at);
            end = at
                .checked_add(n)
                .ok_or_else(|| invalid("the parameters' elements overflow".into()))?;
        }
        let shard_len = end.div_ceil(ranks).next_multiple_of(GRANULE).max(GRANULE);
        Ok(ShardLayout {
            numels: numels.to_vec(),
            offsets,
            shard_len,
            ranks,
        })
    }

    /// Ranks (shards).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Elements of every shard (equal on every rank).
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Elements of the whole flat buffer: `ranks * shard_len`.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.ranks
    }

    /// Where each parameter starts in the flat buffer.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Each parameter's element count.
    pub fn numels(&self) -> &[usize] {
        &self.numels
    }

    /// Rank `rank`'s range of the flat buffer.
    pub fn shard(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The parameters' parts in rank `rank`'s shard, in parameter order (empty parameters and
    /// padding have none).
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let s = self.shard(rank);
        let mut out = Vec::new();
        for (param, (&o, &n)) in self.offsets.iter().zip(&self.numels).enumerate() {
            let (lo, hi) = (o.max(s.start), (o + n).min(s.end));
            if lo < hi {
                out.push(Piece {
                    param,
                    within: lo - o..hi - o,
                    at: lo - s.start,
                });
            }
        }
        out
    }

    /// The ranks whose shards hold part of parameter `param`.
    pub fn owners(&self, param: usize) -> Range<usize> {
        let (o, n) = (self.offsets[param], self.numels[param]);
        if n == 0 {
            return 0..0;
        }
        o / self.shard_len..(o + n - 1) / self.shard_len + 1
    }
}
