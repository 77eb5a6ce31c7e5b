//! The finite-difference gradient check for ops' backward rules: for an op f, inputs x and a
//! random upstream weight w of f's output shape, L(x) = sum(f(x) * w) is computed on the CPU in
//! f64; the oracle for dL/dx_i is the central difference (L(x + h e_i) - L(x - h e_i)) / 2h with
//! h = 1e-3 max(1, |x_i|). The GPU gradient is `x.grad()` after
//! `out.mul(&w)?.sum()?.backward()?`, in f32. The forward values are checked against the same
//! reference first, so a wrong reference cannot pass.

use super::{download, host_data, label, numel, upload};
use fitgrad::{DType, Device, Tensor};

/// An op's forward on device tensors.
pub type Forward<'a> = dyn Fn(&[Tensor]) -> fitgrad::Result<Tensor> + 'a;
/// The same op on the host, in f64.
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
fn tol(want: f64) -> f64 {
    1e-4 + 1e-3 * want.abs()
}

fn compare(what: &str, got: &[f32], want: &[f64]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: got {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !(g.is_finite() && ((g as f64) - w).abs() <= tol(w)) {
            return Err(format!(
                "{what}: first mismatch at index {i}: got {g:e}, expected {w:e} \
                 (tolerance {:e})\n  got:      {got:?}\n  expected: {want:?}",
                tol(w)
            ));
        }
    }
    Ok(())
}

fn loss_f64(reference: &Reference, xs: &[Vec<f64>], w: &[f64]) -> f64 {
    let y = reference(xs);
    assert_eq!(y.len(), w.len(), "test bug: reference output size");
    y.iter().zip(w).map(|(y, w)| y * w).sum()
}

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

/// Runs `forward` on `inputs` (f32), checks it against `reference`, backpropagates
/// `sum(out * w)` for a `w` drawn from `seed`, and compares every requested gradient with the
/// finite differences of the reference; inputs that do not require grad must get none.
pub fn check_grads(
    dev: &Device,
    what: &str,
    inputs: &[Input],
    seed: u64,
    forward: &Forward,
    reference: &Reference,
) -> Result<(), String> {
    let what = format!("{what} on {}", label(dev));
    let err = |stage: &str, e: fitgrad::Error| format!("{what}: {stage}: {e}");
    let xs: Vec<Vec<f64>> = inputs
        .iter()
        .map(|i| i.data.iter().map(|&v| v as f64).collect())
        .collect();
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
    let out_dims = out.dims().to_vec();
    let got = out.to_vec_f32().map_err(|e| err("forward readback", e))?;
    compare(&format!("{what}: forward"), &got, &reference(&xs))?;
    let w_host = host_data(seed ^ 0xA5A5, numel(&out_dims), -1.0, 1.0);
    let w64: Vec<f64> = w_host.iter().map(|&v| v as f64).collect();
    let w = upload(dev, &w_host, &out_dims, DType::F32);
    out.mul(&w)
        .and_then(|p| p.sum())
        .and_then(|l| l.backward())
        .map_err(|e| err("backward", e))?;
    for (k, (inp, t)) in inputs.iter().zip(&ts).enumerate() {
        match (inp.grad, t.grad()) {
            (false, None) => {}
            (false, Some(_)) => return Err(format!("{what}: input {k} got an unwanted gradient")),
            (true, None) => return Err(format!("{what}: input {k} got no gradient")),
            (true, Some(g)) => {
                let got = download(&g, &inp.dims, DType::F32)
                    .map_err(|e| format!("{what}: gradient {k}: {e}"))?;
                let want = finite_diff(reference, &xs, k, &w64);
                compare(
                    &format!("{what}: d/d input {k} {:?}", inp.dims),
                    &got,
                    &want,
                )?;
            }
        }
    }
    Ok(())
}
