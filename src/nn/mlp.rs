//! `Mlp`: Linear layers with an activation between them (none after the last).

use super::{Linear, Module};
use crate::{Activation, DType, Device, Error, Result, Tensor};

/// A multi-layer perceptron: [`Linear`] layers with an activation between them.
pub struct Mlp {
    /// The layers, input first.
    pub layers: Vec<Linear>,
    /// The activation after every layer but the last.
    pub act: Activation,
    /// Recompute each gelu layer in backward instead of keeping its pre-activation (see
    /// [`crate::tensor::autograd::checkpoint`]). Relu, tanh and sigmoid layers keep only their output,
    /// which the next layer needs anyway, so recomputing them would save nothing and cost a
    /// forward: they run as usual (the planner shows the difference).
    pub checkpoint_activations: bool,
    /// Each layer one unit (`layers.{i}`, [`Module::units`]), materialized together when
    /// parameters are streamed or sharded by unit (ZeRO stage 3), as an [`nn::Unit`](super::Unit)
    /// is. Off by default, and then the MLP names no units; on for an MLP made inside
    /// [`born_on_host`](crate::residency::born_on_host), whose layers go to host memory as
    /// they are made. It changes no value, so it is not part of [`Module::config`].
    pub units: bool,
}

impl Mlp {
    /// Layers `widths[0] -> widths[1] -> ... -> widths[last]`, e.g. `[784, 512, 512, 10]`, f32,
    /// layer i seeded from `seed` and i.
    pub fn new(device: &Device, widths: &[usize], act: Activation, seed: u64) -> Result<Mlp> {
        Mlp::with_dtype(device, widths, act, DType::F32, seed)
    }

    /// [`Mlp::new`] with parameters stored in `dtype`.
    pub fn with_dtype(
        device: &Device,
        widths: &[usize],
        act: Activation,
        dtype: DType,
        seed: u64,
    ) -> Result<Mlp> {
        if widths.len() < 2 {
            return Err(Error::InvalidArgument {
                op: "Mlp::new",
                reason: format!("need at least an input and an output width, got {widths:?}"),
            });
        }
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let s = seed
                    .wrapping_mul(0x100_0000_01b3)
                    .wrapping_add(i as u64 + 1);
                let layer = Linear::with_options(device, w[0], w[1], true, dtype, s)?;
                // Inside residency::born_on_host each layer goes to host memory once made.
                crate::residency::born(&layer.parameters());
                Ok(layer)
            })
            .collect::<Result<Vec<_>>>()?;
        // Made in host memory, its layers are units (what streaming and ZeRO stage 3 move).
        let units = layers
            .iter()
            .any(|l| crate::residency::made_on_host(&l.parameters()));
        Ok(Mlp {
            layers,
            act,
            checkpoint_activations: false,
            units,
        })
    }

    /// Logits (B, out) from x (B, in) with every matmul in `dtype` (parameters cast on the fly,
    /// so f32 parameters can run an f16 forward); the logits are returned in f32.
    pub fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let last = self.layers.len() - 1;
        let mut h = if x.dtype() == dtype {
            x.clone()
        } else {
            x.to_dtype(dtype)?
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let act = if i == last {
                Activation::None
            } else {
                self.act
            };
            let ckpt = i != last && self.checkpoint_activations && self.act == Activation::Gelu;
            h = if self.units {
                // A streamed unit trains checkpointed whole: nothing to checkpoint inside it.
                let ckpt = ckpt && !layer.weight.is_streamed();
                let l = layer.clone();
                super::unit::unit_forward(layer.parameters(), &h, move |x| {
                    layer_forward(&l, act, x, dtype, ckpt)
                })?
            } else {
                layer_forward(layer, act, &h, dtype, ckpt)?
            };
        }
        if h.dtype() == DType::F32 {
            Ok(h)
        } else {
            h.to_dtype(DType::F32)
        }
    }

    /// Builds an untrained model from a configuration that [`Module::config`] wrote (what a
    /// checkpoint stores; see [`Checkpoint::rebuild`](crate::checkpoint::Checkpoint::rebuild),
    /// which also loads the weights). A missing or malformed key is an
    /// [`Error::InvalidArgument`] naming it.
    pub fn from_config(
        device: &Device,
        cfg: &std::collections::BTreeMap<String, String>,
    ) -> Result<Mlp> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "Mlp::from_config",
            reason,
        };
        let get = |k: &str| {
            cfg.get(k)
                .ok_or_else(|| bad(format!("no model configuration '{k}' (not an Mlp)")))
        };
        if get("kind")? != "mlp" {
            return Err(bad(format!(
                "the configuration is of a '{}' model, not an mlp",
                get("kind")?
            )));
        }
        let widths = get("widths")?
            .split(',')
            .map(|w| {
                w.parse::<usize>()
                    .map_err(|_| bad(format!("bad width '{w}'")))
            })
            .collect::<Result<Vec<_>>>()?;
        let act: Activation = get("activation")?.parse()?;
        let dtype = match get("dtype")?.as_str() {
            "f32" => DType::F32,
            "f16" => DType::F16,
            d => return Err(bad(format!("bad dtype '{d}'"))),
        };
        let mut m = Mlp::with_dtype(device, &widths, act, dtype, 0)?;
        m.checkpoint_activations = get("checkpoint_activations")? == "true";
        Ok(m)
    }

    /// The widths the model was built from.
    pub fn widths(&self) -> Vec<usize> {
        let mut w = vec![self.layers[0].in_features];
        w.extend(self.layers.iter().map(|l| l.out_features));
        w
    }
}

/// One layer: `act(h · Wᵀ + b)` in `dtype`, relu and gelu fused into the matmul; with
/// `checkpoint`, recomputed in backward instead of keeping its pre-activation.
fn layer_forward(
    layer: &Linear,
    act: Activation,
    h: &Tensor,
    dtype: DType,
    checkpoint: bool,
) -> Result<Tensor> {
    if !checkpoint {
        return layer.forward_in(h, act, dtype);
    }
    let l = layer.clone();
    let params: Vec<Tensor> = layer.named_parameters().into_iter().map(|p| p.1).collect();
    let refs: Vec<&Tensor> = params.iter().collect();
    crate::tensor::autograd::checkpoint(&[h], &refs, move |xs| l.forward_in(&xs[0], act, dtype))
}

impl Module for Mlp {
    /// x (B, in) -> logits (B, out), in the parameters' dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = self.layers[0].weight.dtype();
        let logits = self.forward_in(x, dtype)?;
        if logits.dtype() == dtype {
            Ok(logits)
        } else {
            logits.to_dtype(dtype)
        }
    }

    fn config(&self) -> Vec<(String, String)> {
        let widths: Vec<String> = self.widths().iter().map(usize::to_string).collect();
        vec![
            ("kind".into(), "mlp".into()),
            ("widths".into(), widths.join(",")),
            ("activation".into(), self.act.name().into()),
            ("dtype".into(), self.layers[0].weight.dtype().to_string()),
            (
                "checkpoint_activations".into(),
                self.checkpoint_activations.to_string(),
            ),
        ]
    }

    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        match self.units {
            true => self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| (format!("layers.{i}"), l.parameters()))
                .collect(),
            false => Vec::new(),
        }
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                l.named_parameters()
                    .into_iter()
                    .map(move |(n, t)| (format!("layers.{i}.{n}"), t))
            })
            .collect()
    }
}
