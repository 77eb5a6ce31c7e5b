//! The finite-difference gradient check every test file uses (tests/autograd.rs included): for an
//! op f, inputs x and a random upstream weight w of f's output shape, L(x) = sum(f(x) * w) is
//! computed in f64 on a plain-loop reference, and dL/dx_i is the central difference
//! (L(x + h e_i) - L(x - h e_i)) / 2h with h = 1e-3 max(1, |x_i|). The GPU gradient is `x.grad()`
//! after `out.mul(&w)?.sum()?.backward()?`, in f32. The forward values are checked against the
//! same reference first, so a wrong reference cannot pass.
//!
//! At a kink the central difference is the mean of the one-sided slopes: 0 for |x| at 0 and 0.5
//! for max(x, y) at x == y, the values torch's rules (and fitgrad's) give.

use super::{host_data, label, numel, upload};
use fitgrad::{DType, Device, Tensor};

pub type Res<T> = std::result::Result<T, String>;
pub type Forward<'a> = dyn Fn(&[Tensor]) -> fitgrad::Result<Tensor> + 'a;
pub type Reference<'a> = dyn Fn(&[Vec<f64>]) -> Vec<f64> + 'a;

/// One input of an op: host values, dims, and whether it requires grad.
#[derive(Clone, Debug)]
pub struct Input {
    pub data: Vec<f32>,
    pub dims: Vec<usize>,
    pub grad: bool,
}

pub fn input(data: Vec<f32>, dims: &[usize], grad: bool) -> Input {
    assert_eq!(data.len(), numel(dims), "test bug: data for {dims:?}");
    Input {
        data,
        dims: dims.to_vec(),
        grad,
    }
}

/// Tolerance of an f32 GPU gradient (or forward value) against the f64 oracle.
fn grad_tol(want: f64) -> f64 {
    1e-4 + 1e-3 * want.abs()
}

/// Compares f32 GPU values with f64 expectations; the error names the first mismatch.
pub fn compare(what: &str, got: &[f32], want: &[f64]) -> Res<()> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: got {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let mut bad = 0;
    let mut first = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g.is_finite() && ((g as f64) - w).abs() <= grad_tol(w);
        if !ok {
            bad += 1;
            first.get_or_insert((i, g, w));
        }
    }
    match first {
        None => Ok(()),
        Some((i, g, w)) => Err(format!(
            "{what}: {bad} of {} values differ; first at index {i}: got {g:e}, expected {w:e} \
             (|diff| {:e}, tolerance {:e})\n  got:      {got:?}\n  expected: {want:?}",
            got.len(),
            ((g as f64) - w).abs(),
            grad_tol(w)
        )),
    }
}

/// L(xs) = sum(reference(xs) * w) in f64.
fn loss_f64(reference: &Reference, xs: &[Vec<f64>], w: &[f64]) -> f64 {
    let y = reference(xs);
    assert_eq!(y.len(), w.len(), "test bug: reference output size");
    y.iter().zip(w).map(|(y, w)| y * w).sum()
}

/// dL/d xs[i] by central differences in f64.
fn finite_diff(reference: &Reference, xs: &[Vec<f64>], i: usize, w: &[f64]) -> Vec<f64> {
    let mut xs = xs.to_vec();
    (0..xs[i].len())
        .map(|j| {
            let x0 = xs[i][j];
            let h = 1e-3 * x0.abs().max(1.0);
            xs[i][j] = x0 + h;
            let plus = loss_f64(reference, &xs, w);
            xs[i][j] = x0 - h;
            let minus = loss_f64(reference, &xs, w);
            xs[i][j] = x0;
            (plus - minus) / (2.0 * h)
        })
        .collect()
}

/// Builds `forward` on `inputs` (those with `grad` marked as requiring grad), checks its values
/// against `reference`, backpropagates `sum(out * w)` for a random `w` drawn from `seed`, and
/// compares every requested gradient with the finite differences of the reference. Inputs that
/// do not require grad must get no gradient.
pub fn check_grads(
    dev: &Device,
    what: &str,
    inputs: &[Input],
    seed: u64,
    forward: &Forward,
    reference: &Reference,
) -> Res<()> {
    let what = format!("{what} on {}", label(dev));
    let err = |stage: &str, e: fitgrad::Error| format!("{what}: {stage}: {e}");
    let xs: Vec<Vec<f64>> = inputs
        .iter()
        .map(|i| i.data.iter().map(|&v| v as f64).collect())
        .collect();
    let want_out = reference(&xs);

    let ts: Vec<Tensor> = inputs
        .iter()
        .map(|i| {
            let t = upload(dev, &i.data, &i.dims, DType::F32);
            if i.grad {
                t.with_requires_grad()
            } else {
                t
            }
        })
        .collect();
    let out = forward(&ts).map_err(|e| err("forward", e))?;
    let any_grad = inputs.iter().any(|i| i.grad);
    if out.requires_grad() != any_grad {
        return Err(format!(
            "{what}: output requires_grad() is {}, inputs requiring grad: {any_grad}",
            out.requires_grad()
        ));
    }
    let out_dims = out.dims().to_vec();
    let got_out = out.to_vec_f32().map_err(|e| err("forward readback", e))?;
    compare(
        &format!("{what}: forward {out_dims:?}"),
        &got_out,
        &want_out,
    )?;

    let w_host = host_data(seed ^ 0xA5A5, numel(&out_dims), -1.0, 1.0);
    let w64: Vec<f64> = w_host.iter().map(|&v| v as f64).collect();
    let w = upload(dev, &w_host, &out_dims, DType::F32);
    let loss = out
        .mul(&w)
        .and_then(|p| p.sum())
        .map_err(|e| err("loss", e))?;
    loss.backward().map_err(|e| err("backward", e))?;

    for (k, (inp, t)) in inputs.iter().zip(&ts).enumerate() {
        let g = t.grad();
        if !inp.grad {
            if g.is_some() {
                return Err(format!(
                    "{what}: input {k} does not require grad but got one"
                ));
            }
            continue;
        }
        let g = g.ok_or_else(|| format!("{what}: input {k} {:?} got no gradient", inp.dims))?;
        if g.dims() != inp.dims.as_slice() || g.dtype() != DType::F32 {
            return Err(format!(
                "{what}: gradient of input {k} is {:?} {}, expected {:?} f32",
                g.dims(),
                g.dtype(),
                inp.dims
            ));
        }
        let got = g.to_vec_f32().map_err(|e| err("gradient readback", e))?;
        let want = finite_diff(reference, &xs, k, &w64);
        compare(
            &format!("{what}: d/d input {k} {:?}", inp.dims),
            &got,
            &want,
        )?;
    }
    Ok(())
}
