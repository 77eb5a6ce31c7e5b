//! [`AdamW`]'s state as checkpoints see it: the named tensors, the saved state, and its load
//! with every check (each parameter's f32 or 8-bit moments, complete and of its size).

use super::{AdamW, Moments, NAMES, OP};
use crate::optim::offload;
use crate::optim::quant8::{self, Moments8, NAMES8};
use crate::optim::{take_state, CodeTensor, OptimizerState};
use crate::{Error, Result, Tensor};

/// Every state tensor by its name (`{i}.exp_avg`, `{i}.exp_avg_sq`, or the four 8-bit ones).
pub(super) fn tensors(opt: &AdamW) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (i, mv) in opt.moments.iter().enumerate() {
        match mv {
            Some(Moments::F32(m, v)) => {
                out.push((format!("{i}.{}", NAMES[0]), m.clone()));
                out.push((format!("{i}.{}", NAMES[1]), v.clone()));
            }
            Some(Moments::Q8(q)) => {
                for (name, t) in NAMES8.iter().zip([&q.m, &q.am, &q.v, &q.av]) {
                    out.push((format!("{i}.{name}"), t.clone()));
                }
            }
            None => {}
        }
    }
    out
}

/// The state a checkpoint saves: f32 moments as tensors, 8-bit ones as codes and absmax
/// tensors, or the host state of an offloaded optimizer.
pub(super) fn of(opt: &AdamW) -> OptimizerState {
    let mut s = OptimizerState {
        step_count: opt.steps,
        param_steps: opt.param_steps.clone(),
        ..Default::default()
    };
    if let Some(host) = &opt.host {
        s.host = offload::host_state(&opt.groups.params, host, &NAMES);
        return s;
    }
    for (i, mv) in opt.moments.iter().enumerate() {
        match mv {
            Some(Moments::F32(m, v)) => {
                s.tensors.push((format!("{i}.{}", NAMES[0]), m.clone()));
                s.tensors.push((format!("{i}.{}", NAMES[1]), v.clone()));
            }
            Some(Moments::Q8(q)) => {
                let len = opt.groups.params[i].numel();
                for (name, words) in [(NAMES8[0], &q.m), (NAMES8[2], &q.v)] {
                    s.codes.push(CodeTensor {
                        name: format!("{i}.{name}"),
                        words: words.clone(),
                        len,
                    });
                }
                for (name, t) in [(NAMES8[1], &q.am), (NAMES8[3], &q.av)] {
                    s.tensors.push((format!("{i}.{name}"), t.clone()));
                }
            }
            None => {}
        }
    }
    s
}

/// The moments of a loaded state, checked against the optimizer's parameters: f32 state for
/// the parameters that keep it, all four 8-bit tensors for the others (codes of the
/// parameter's element count, one absmax per block), or nothing.
pub(super) fn load_moments(opt: &AdamW, mut state: OptimizerState) -> Result<Vec<Option<Moments>>> {
    let params = &opt.groups.params;
    let invalid = |reason: String| Error::InvalidArgument { op: OP, reason };
    let parse = |key: &str| -> Option<(usize, usize)> {
        let (i, name) = key.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let j = NAMES8.iter().position(|n| *n == name)?;
        (i < params.len()).then_some((i, j))
    };
    // Per parameter, its 8-bit tensors by NAMES8 index (codes with their lengths).
    let mut q8: Vec<[Option<(Tensor, usize)>; 4]> = vec![Default::default(); params.len()];
    let mut put = |key: &str, t: Tensor, len: usize| -> Result<()> {
        let Some((i, j)) = parse(key) else {
            return Err(invalid(format!("unknown state tensor '{key}'")));
        };
        if t.device() != params[i].device() {
            return Err(Error::DeviceMismatch { op: OP });
        }
        if q8[i][j].replace((t, len)).is_some() {
            return Err(invalid(format!("state tensor '{key}' given twice")));
        }
        Ok(())
    };
    for c in std::mem::take(&mut state.codes) {
        let short = c.name.split_once('.').map_or("", |x| x.1);
        if short == NAMES8[1] || short == NAMES8[3] {
            return Err(invalid(format!("'{}' holds codes, not f32 values", c.name)));
        }
        put(&c.name, c.words, c.len)?;
    }
    let (absmax, f32_state): (Vec<_>, Vec<_>) = std::mem::take(&mut state.tensors)
        .into_iter()
        .partition(|(k, _)| parse(k).is_some());
    for (key, t) in absmax {
        let len = t.numel();
        put(&key, t, len)?;
    }
    state.tensors = f32_state;
    let f32_slots = take_state(OP, params, &NAMES, state)?;
    let mut out = Vec::with_capacity(params.len());
    for (i, (f, q)) in f32_slots.into_iter().zip(q8).enumerate() {
        let p = &params[i];
        let n = p.numel();
        let have = q.iter().filter(|t| t.is_some()).count();
        let quantized = opt.quantized(p);
        let kind = |q: bool| if q { "8-bit" } else { "f32" };
        if (f.is_some() && quantized) || (have > 0 && !quantized) {
            return Err(invalid(format!(
                "parameter {i} ({n} elements) has {} state, this optimizer keeps {} state for it",
                kind(have > 0),
                kind(quantized)
            )));
        }
        if let Some(mut f) = f {
            let v = f.pop().expect("two moments");
            let m = f.pop().expect("two moments");
            out.push(Some(Moments::F32(m, v)));
            continue;
        }
        if have == 0 {
            out.push(None);
            continue;
        }
        if have < 4 {
            return Err(invalid(format!(
                "parameter {i} has only part of its 8-bit state"
            )));
        }
        let [Some((m, lm)), Some((am, _)), Some((v, lv)), Some((av, _))] = q else {
            unreachable!("all four counted");
        };
        let words = quant8::code_words(n);
        if lm != n || lv != n || m.numel() != words || v.numel() != words {
            return Err(invalid(format!(
                "parameter {i} has {n} elements, its 8-bit state holds {lm} and {lv} codes"
            )));
        }
        let blocks = n.div_ceil(quant8::BLOCK);
        for (name, a) in [(NAMES8[1], &am), (NAMES8[3], &av)] {
            if a.dims() != [blocks] {
                return Err(invalid(format!(
                    "parameter {i}'s {name} has shape {:?}; {n} elements in blocks of {} need [{blocks}]",
                    a.dims(),
                    quant8::BLOCK
                )));
            }
        }
        out.push(Some(Moments::Q8(Moments8 {
            m: m.detach(),
            am: am.detach(),
            v: v.detach(),
            av: av.detach(),
        })));
    }
    Ok(out)
}
