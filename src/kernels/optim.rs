//! Dispatch for the fused optimizer updates (shaders/optim.wgsl): one kernel per parameter per
//! step, updating the parameter and its state in place. Nothing is allocated here.

use super::Operand;
use super::{assemble, pair_groups, specialize, Binding, Splits, Storage, OPTIM, WG};
use crate::Result;

/// One SGD update (torch.optim.SGD).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdHyper {
    pub lr: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
    /// The momentum buffer is new: it becomes the gradient instead of being decayed (torch's
    /// `buf = clone(grad)`).
    pub first_step: bool,
}

/// One AdamW update (torch.optim.AdamW).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWHyper {
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// This parameter's update count including this update (t >= 1 in the bias corrections).
    pub step: u64,
}

/// What shaders/include/adamw.wgsl reads of one AdamW update, computed in f64 as torch does on
/// the host; the 8-bit kernel and the host update take the same numbers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWCoefficients {
    /// 1 - lr * weight_decay.
    pub decay: f32,
    /// lr / (1 - beta1^t).
    pub step_size: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    /// sqrt(1 - beta2^t).
    pub bc2_sqrt: f32,
}

impl AdamWHyper {
    pub(crate) fn coefficients(&self) -> AdamWCoefficients {
        assert!(self.step >= 1, "AdamW steps count from 1");
        let (lr, b1, b2) = (self.lr as f64, self.beta1 as f64, self.beta2 as f64);
        let t = self.step as f64;
        let bc1 = 1.0 - b1.powf(t);
        let bc2 = 1.0 - b2.powf(t);
        AdamWCoefficients {
            decay: (1.0 - lr * self.weight_decay as f64) as f32,
            step_size: (lr / bc1) as f32,
            beta1: self.beta1,
            beta2: self.beta2,
            one_minus_beta1: (1.0 - b1) as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            eps: self.eps,
            bc2_sqrt: bc2.sqrt() as f32,
        }
    }
}

/// `KIND` of shaders/optim.wgsl: each gets a pipeline of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Sgd = 0,
    AdamW = 1,
    SgdMomentum = 2,
}

/// The shader's `Params`, in declaration order.
#[derive(Default)]
struct Params {
    flags: u32,
    lr: f32,
    weight_decay: f32,
    momentum: f32,
    one_minus_damp: f32,
    decay: f32,
    step_size: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    eps: f32,
    bc2_sqrt: f32,
}

impl Params {
    fn words(&self, n: usize) -> [u32; 16] {
        [
            n as u32,
            self.flags,
            self.lr.to_bits(),
            self.weight_decay.to_bits(),
            self.momentum.to_bits(),
            self.one_minus_damp.to_bits(),
            self.decay.to_bits(),
            self.step_size.to_bits(),
            self.beta1.to_bits(),
            self.beta2.to_bits(),
            self.one_minus_beta1.to_bits(),
            self.one_minus_beta2.to_bits(),
            self.eps.to_bits(),
            self.bc2_sqrt.to_bits(),
            0,
            0,
        ]
    }
}

/// p -= lr * (SGD direction of g), with `buf` the momentum buffer (required when momentum != 0;
/// same element count as `p`). `g` and the state may have any dtype; all math is f32.
pub(crate) fn sgd_step<T: Operand>(p: &T, g: &T, buf: Option<&T>, hp: &SgdHyper) -> Result<()> {
    let params = Params {
        flags: hp.nesterov as u32 | (hp.first_step as u32) << 1,
        lr: hp.lr,
        weight_decay: hp.weight_decay,
        momentum: hp.momentum,
        one_minus_damp: (1.0 - hp.dampening as f64) as f32,
        ..Default::default()
    };
    match buf {
        // Unused state bindings alias a bound tensor (the shader never touches them).
        Some(b) => dispatch(Kind::SgdMomentum, p, g, b, b, &params),
        None => {
            assert!(hp.momentum == 0.0, "SGD with momentum needs a buffer");
            dispatch(Kind::Sgd, p, g, p, p, &params)
        }
    }
}

/// One AdamW update of `p` with first and second moments `m`, `v` (same element count as `p`).
/// The bias corrections are computed in f64, as torch does on the host.
pub(crate) fn adamw_step<T: Operand>(p: &T, g: &T, m: &T, v: &T, hp: &AdamWHyper) -> Result<()> {
    let c = hp.coefficients();
    let params = Params {
        decay: c.decay,
        step_size: c.step_size,
        beta1: c.beta1,
        beta2: c.beta2,
        one_minus_beta1: c.one_minus_beta1,
        one_minus_beta2: c.one_minus_beta2,
        eps: c.eps,
        bc2_sqrt: c.bc2_sqrt,
        ..Default::default()
    };
    dispatch(Kind::AdamW, p, g, m, v, &params)
}

fn dispatch<T: Operand>(kind: Kind, p: &T, g: &T, m: &T, v: &T, params: &Params) -> Result<()> {
    let n = p.numel();
    for t in [g, m, v] {
        assert_eq!(t.numel(), n, "optimizer tensors must match the parameter");
    }
    if n == 0 {
        return Ok(());
    }
    let dev = p.device();
    let blocks = [p.block(), g.block(), m.block(), v.block()];
    let widest = [p, g, m, v]
        .iter()
        .map(|t| t.dtype().size() as u64)
        .max()
        .unwrap_or(4);
    if blocks.iter().any(|b| dev.binding_windows(b.size) > 1) {
        // The update is elementwise: it runs over ranges of CHUNK_ALIGN elements that each
        // fit one binding in every tensor, binding the same range of each (no windows, so
        // four large tensors never pass the adapter's count of bindings).
        // At least one aligned run (a binding smaller than one run binds it as windows).
        let chunk =
            (dev.window_bytes() / widest / CHUNK_ALIGN).max(1) as usize * CHUNK_ALIGN as usize;
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let sub = [p, g, m, v].map(|t| {
                // A streamed parameter's range is taken in the block it is resident in (one
                // not resident keeps its stand-in, which the dispatch refuses).
                let b = t
                    .block()
                    .resolved()
                    .map(std::borrow::Cow::into_owned)
                    .unwrap_or_else(|_| t.block().clone());
                let size = t.dtype().size() as u64;
                let at = start as u64 * size;
                let bytes = if start + len == n {
                    b.size - at
                } else {
                    len as u64 * size
                };
                crate::memory::Block {
                    offset: b.offset + at,
                    size: bytes,
                    ..b
                }
            });
            let dtypes = [p, g, m, v].map(|t| t.dtype());
            update(
                kind,
                dev,
                dtypes,
                [&sub[0], &sub[1], &sub[2], &sub[3]],
                len,
                params,
            )?;
            start += len;
        }
        return Ok(());
    }
    update(
        kind,
        dev,
        [p, g, m, v].map(|t| t.dtype()),
        blocks,
        n,
        params,
    )
}

/// Elements of a chunk of a split update are a multiple of this: every tensor's range then
/// starts 256-byte aligned (any dtype of 1 byte or more) and holds whole quads.
const CHUNK_ALIGN: u64 = 256;

/// One dispatch of the update over `n` elements of `blocks` (parameter, gradient, state).
fn update(
    kind: Kind,
    dev: &crate::Device,
    dtypes: [crate::DType; 4],
    blocks: [&crate::memory::Block; 4],
    n: usize,
    params: &Params,
) -> Result<()> {
    let storage = dtypes.map(|d| Storage::of(dev, d));
    // Whole quads where the element count allows (every block starts 256-byte aligned).
    let vec = n.is_multiple_of(4);
    let splits = Splits::of(dev, &blocks)?;
    let key = format!(
        "optim_k{}_{}_{}_{}_{}{}{}",
        kind as u32,
        storage[0].tag(),
        storage[1].tag(),
        storage[2].tag(),
        storage[3].tag(),
        if vec { "_x4" } else { "" },
        splits.key()
    );
    let k = dev.kernel(&key, &[], false, || {
        let body = specialize(
            OPTIM.body,
            &[("KIND", kind as u32), ("VEC", u32::from(vec))],
        );
        let bind: Vec<Binding> = OPTIM
            .with_storage(&storage)
            .into_iter()
            .map(|b| Binding { vec4: vec, ..b })
            .collect();
        assemble(&body, &splits.apply(bind))
    })?;
    let groups = if vec {
        (n.div_ceil(4) as u32).div_ceil(WG)
    } else {
        pair_groups(n)
    };
    dev.dispatch(&k, &params.words(n), &blocks, groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::validate_wgsl;
    use Storage::*;

    /// Every kind validates with every storage, and with f32 master weights and state beside an
    /// f16 gradient (mixed precision).
    #[test]
    fn every_kind_validates() {
        let mut combos: Vec<[Storage; 4]> = [F32, F16, F16Packed].map(|s| [s; 4]).to_vec();
        combos.push([F32, F16, F32, F32]);
        combos.push([F32, F16Packed, F32, F32]);
        for kind in [Kind::Sgd, Kind::AdamW, Kind::SgdMomentum] {
            for vec in [0, 1] {
                let body = specialize(OPTIM.body, &[("KIND", kind as u32), ("VEC", vec)]);
                assert!(body.contains(&format!("const KIND: u32 = {}u;", kind as u32)));
                for st in &combos {
                    let bind: Vec<Binding> = OPTIM
                        .with_storage(st)
                        .into_iter()
                        .map(|b| Binding {
                            vec4: vec == 1,
                            ..b
                        })
                        .collect();
                    if let Err(e) = validate_wgsl(&assemble(&body, &bind)) {
                        panic!("{kind:?} {st:?} VEC {vec}: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn params_fill_the_uniform_struct() {
        // 16 words = the shader's Params (a multiple of 16 bytes).
        let w = Params {
            bc2_sqrt: 2.0,
            ..Default::default()
        }
        .words(7);
        assert_eq!(w[0], 7);
        assert_eq!(f32::from_bits(w[13]), 2.0);
        let body = OPTIM.body;
        let start = body.find("struct Params").unwrap();
        let end = start + body[start..].find('}').unwrap();
        assert_eq!(
            body[start..end].matches(": u32").count() + body[start..end].matches(": f32").count(),
            w.len()
        );
    }
}
