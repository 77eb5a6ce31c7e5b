//! [`Unit`]: marks a sub-module as one unit of parameters that streaming materializes on the
//! device together (src/residency/), like a module FSDP wraps.

use super::Module;
use crate::{Result, Tensor};
use std::sync::Arc;

/// A module whose parameters form one unit ([`Module::units`]): with parameters streamed from
/// host memory, they are fetched before its forward and released after it, and in training
/// its forward runs under [`checkpoint`](crate::tensor::autograd::checkpoint) so backward
/// fetches them again for the recomputation. Without streaming it is `M` itself: the same
/// parameter names (no prefix), the same forward.
///
/// ```
/// use fitgrad::nn::{Linear, Module, Unit};
/// # fn f(dev: &fitgrad::Device) -> fitgrad::Result<()> {
/// let blocks: Vec<Unit<Linear>> = (0..4)
///     .map(|i| Ok(Unit::new(Linear::new(dev, 8, 8, i)?)))
///     .collect::<fitgrad::Result<_>>()?;
/// assert_eq!(blocks.units().len(), 4); // "0", "1", "2", "3"
/// # Ok(()) }
/// ```
pub struct Unit<M> {
    inner: Arc<M>,
}

impl<M> Unit<M> {
    /// Marks `module` as one unit (inside [`born_on_host`](crate::residency::born_on_host)
    /// its parameters go to host memory now).
    pub fn new(module: M) -> Unit<M>
    where
        M: Module,
    {
        crate::residency::born(&module.parameters());
        Unit {
            inner: Arc::new(module),
        }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.inner
    }
}

/// A block of two residual halves (`first`, then `second` on its output), each under
/// [`checkpoint`](crate::tensor::autograd::checkpoint) with `params` its parameters: only each
/// half's input is kept, and backward reruns one half at a time, inside the residency of the
/// unit `unit` belongs to (when streamed), so the recomputed activations at any moment are
/// half a block's. GPT's and Llama's blocks train this way.
pub(crate) fn checkpoint_halves<A, B>(
    x: &Tensor,
    unit: &Tensor,
    params: [Vec<Tensor>; 2],
    first: A,
    second: B,
) -> Result<Tensor>
where
    A: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
    B: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    use crate::tensor::autograd::checkpoint;
    let [first_params, second_params] = params;
    let (u, refs) = (unit.clone(), first_params.iter().collect::<Vec<_>>());
    let h = checkpoint(&[x], &refs, move |xs| {
        crate::residency::within(&u, || first(&xs[0]))
    })?;
    let (u, refs) = (unit.clone(), second_params.iter().collect::<Vec<_>>());
    checkpoint(&[&h], &refs, move |xs| {
        crate::residency::within(&u, || second(&xs[0]))
    })
}

/// `f(x)` as the forward of one unit whose parameters are `params`: inside the unit's
/// residency (fetched first when streamed), and in training under
/// [`checkpoint`](crate::tensor::autograd::checkpoint) when streamed, so backward fetches the
/// unit again for the recomputation. [`Unit`]'s forward, and that of modules that mark their
/// own layers as units (`Mlp::units`).
pub(crate) fn unit_forward<F>(params: Vec<Tensor>, x: &Tensor, f: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    let Some(first) = params.first().cloned() else {
        return f(x);
    };
    if first.is_streamed() && crate::is_grad_enabled() {
        let refs: Vec<&Tensor> = params.iter().collect();
        crate::tensor::autograd::checkpoint(&[x], &refs, move |xs| {
            crate::residency::within(&first, || f(&xs[0]))
        })
    } else {
        crate::residency::within(&first, || f(x))
    }
}

impl<M: Module + Send + Sync + 'static> Module for Unit<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let m = self.inner.clone();
        unit_forward(self.inner.parameters(), x, move |x| m.forward(x))
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.named_parameters()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner.named_buffers()
    }

    fn config(&self) -> Vec<(String, String)> {
        self.inner.config()
    }

    fn set_training(&self, training: bool) {
        self.inner.set_training(training)
    }

    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        vec![(String::new(), self.inner.parameters())]
    }
}

/// `m`'s units with `prefix.` before each name (containers use it).
pub fn prefixed_units(prefix: &str, m: &dyn Module) -> Vec<(String, Vec<Tensor>)> {
    m.units()
        .into_iter()
        .map(|(n, p)| {
            let name = if n.is_empty() {
                prefix.to_string()
            } else {
                format!("{prefix}.{n}")
            };
            (name, p)
        })
        .collect()
}
