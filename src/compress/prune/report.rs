//! What pruning achieved: [`SparsityReport`] ([`Pruner::report`](super::Pruner::report)), one
//! [`LayerSparsity`] per pruned weight, and its table.

use std::fmt;

/// The sparsity of one pruned weight.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSparsity {
    /// The parameter's name (`layers.0.weight`).
    pub name: String,
    /// Its dims.
    pub dims: Vec<usize>,
    /// Elements the mask prunes.
    pub pruned: usize,
    /// Elements exactly zero (at least `pruned` once the masks are applied).
    pub zeros: usize,
    /// Pruned elements that are not zero: 0 once the masks are applied (nonzero only between
    /// an optimizer step and [`Pruner::step`](super::Pruner::step)).
    pub pruned_nonzero: usize,
    /// Elements in all.
    pub numel: usize,
}

impl LayerSparsity {
    /// The fraction of the weight that is zero.
    pub fn sparsity(&self) -> f64 {
        self.zeros as f64 / self.numel.max(1) as f64
    }
}

/// The sparsity of every pruned weight, and in all ([`Pruner::report`](super::Pruner::report)).
#[derive(Clone, Debug, PartialEq)]
pub struct SparsityReport {
    /// One entry per pruned parameter, in model order.
    pub layers: Vec<LayerSparsity>,
}

impl SparsityReport {
    /// Elements pruned by the masks, in all.
    pub fn pruned(&self) -> usize {
        self.layers.iter().map(|l| l.pruned).sum()
    }

    /// Elements exactly zero, in all.
    pub fn zeros(&self) -> usize {
        self.layers.iter().map(|l| l.zeros).sum()
    }

    /// Pruned elements that are not zero, in all (0 once the masks are applied).
    pub fn pruned_nonzero(&self) -> usize {
        self.layers.iter().map(|l| l.pruned_nonzero).sum()
    }

    /// Elements of the pruned parameters, in all.
    pub fn numel(&self) -> usize {
        self.layers.iter().map(|l| l.numel).sum()
    }

    /// The fraction of the pruned parameters that is zero.
    pub fn sparsity(&self) -> f64 {
        self.zeros() as f64 / self.numel().max(1) as f64
    }
}

impl fmt::Display for SparsityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self
            .layers
            .iter()
            .map(|l| l.name.len())
            .chain([5])
            .max()
            .unwrap_or(5);
        writeln!(
            f,
            "{:<w$}  {:>12}  {:>10}  {:>10}  {:>8}",
            "weight", "dims", "pruned", "zeros", "sparsity"
        )?;
        for l in &self.layers {
            let dims: Vec<String> = l.dims.iter().map(usize::to_string).collect();
            writeln!(
                f,
                "{:<w$}  {:>12}  {:>10}  {:>10}  {:>7.2}%",
                l.name,
                dims.join("x"),
                l.pruned,
                l.zeros,
                100.0 * l.sparsity()
            )?;
        }
        writeln!(
            f,
            "{:<w$}  {:>12}  {:>10}  {:>10}  {:>7.2}%",
            "total",
            self.numel(),
            self.pruned(),
            self.zeros(),
            100.0 * self.sparsity()
        )?;
        writeln!(
            f,
            "pruned weights that are not exactly 0: {}",
            self.pruned_nonzero()
        )
    }
}
