//! Autograd: every backward rule against central finite differences computed in f64 on a
//! plain-loop CPU reference, on small random shapes (dims of 1 and odd sizes, rank 0 where the op
//! allows it), in f32; and the behaviour of the graph: accumulation across `backward()` calls
//! (in place, without a new buffer), `zero_grad`, tensors used twice, `no_grad`, `detach`, a
//! freed graph, non-scalar roots, ops without a backward rule, and saved activations being freed.
//!
//! Method: for an op f, inputs x and a random upstream weight w of f's output shape, the scalar
//! L(x) = sum(f(x) * w) is computed on the CPU in f64; the oracle for dL/dx_i is the central
//! difference (L(x + h e_i) - L(x - h e_i)) / 2h with h = 1e-3 max(1, |x_i|). The GPU gradient is
//! `x.grad()` after `out.mul(&w)?.sum()?.backward()?`. Inputs stay away from kinks (relu, a
//! fused relu's pre-activation) and from the edges of domains (log, sqrt, divisors). The forward
//! values are checked against the same reference first, so a wrong reference cannot pass.
//!
//! Most properties run on the first device of `devices()`; a composed network and the broadcast
//! binary ops run on every device.

use crate::common;

use common::gradcheck::{check_grads, compare, input, Res};
use common::strategies::cap;
use common::*;
use fitgrad::{Activation, DType, Device, DeviceOptions, Error, MatmulOptions, Tensor};
use proptest::prelude::*;

device_tests!(binary_broadcast_every_device, mlp_every_device);

/// Cases per property (lavapipe and GL run on the CPU, and every case reads gradients back).
const CASES: u32 = 12;
/// Cases of the properties that run on every device.
const CASES_ALL_DEVICES: u32 = 6;
/// The most elements a generated input may have (the finite differences cost O(n^2)).
const MAX_ELEMS: usize = 120;

/// The first device, or `None` (after the loud SKIPPED of `devices()`).
fn first_device() -> Option<Device> {
    devices().into_iter().next()
}

/// Which of `n` inputs require grad, from `bits` (never none).
fn grad_mask(bits: u64, n: usize) -> Vec<bool> {
    let m = (bits % ((1 << n) - 1)) + 1;
    (0..n).map(|i| (m >> i) & 1 == 1).collect()
}

// ---------------------------------------------------------------------------------------------
// f64 references (plain loops)
// ---------------------------------------------------------------------------------------------

/// Multi-index of linear index `lin` in `dims`.
fn unravel(mut lin: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        idx[i] = lin % dims[i];
        lin /= dims[i];
    }
    idx
}

/// Linear index into `dims` of output multi-index `idx`, broadcast dims pinned to 0.
fn bcast_index(idx: &[usize], dims: &[usize]) -> usize {
    let st = strides(dims);
    let shift = idx.len() - dims.len();
    (0..dims.len())
        .map(|i| {
            if dims[i] == 1 {
                0
            } else {
                idx[i + shift] * st[i]
            }
        })
        .sum()
}

fn ref_bin(a: &[f64], ad: &[usize], b: &[f64], bd: &[usize], f: fn(f64, f64) -> f64) -> Vec<f64> {
    let od = broadcast_dims(ad, bd).expect("test bug: shapes do not broadcast");
    (0..numel(&od))
        .map(|lin| {
            let idx = unravel(lin, &od);
            f(a[bcast_index(&idx, ad)], b[bcast_index(&idx, bd)])
        })
        .collect()
}

fn gelu64(x: f64) -> f64 {
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Sum (or mean) along `axis` (the output's layout does not depend on keepdim).
fn reduce64(x: &[f64], dims: &[usize], axis: usize, mean: bool) -> Vec<f64> {
    let outer: usize = dims[..axis].iter().product();
    let len = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let s: f64 = (0..len).map(|k| x[(o * len + k) * inner + i]).sum();
            out.push(if mean { s / len as f64 } else { s });
        }
    }
    out
}

fn transpose64(x: &[f64], dims: &[usize]) -> Vec<f64> {
    let k = dims.len();
    let (r, c) = (dims[k - 2], dims[k - 1]);
    let mut out = vec![0.0; x.len()];
    for b in 0..x.len() / (r * c).max(1) {
        for i in 0..r {
            for j in 0..c {
                out[b * r * c + j * r + i] = x[b * r * c + i * c + j];
            }
        }
    }
    out
}

/// Softmax or log-softmax of every row of length `c`.
fn softmax64(x: &[f64], c: usize, log: bool) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(c) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for v in row {
            out.push(if log {
                v - m - s.ln()
            } else {
                (v - m).exp() / s
            });
        }
    }
    out
}

/// Mean cross-entropy of logits (b, c) against `targets`.
fn cross_entropy64(x: &[f64], c: usize, targets: &[u32]) -> f64 {
    let ls = softmax64(x, c, true);
    let b = targets.len();
    -(0..b).map(|r| ls[r * c + targets[r] as usize]).sum::<f64>() / b as f64
}

/// A matmul problem: dims of A and B as stored, and the options.
#[derive(Clone, Debug)]
struct Mm {
    ad: Vec<usize>,
    bd: Vec<usize>,
    ta: bool,
    tb: bool,
    act: Activation,
}

impl Mm {
    /// (lead dims, m, k, n).
    fn sizes(&self) -> (Vec<usize>, usize, usize, usize) {
        let (ra, rb) = (self.ad.len(), self.bd.len());
        let (m, k) = if self.ta {
            (self.ad[ra - 1], self.ad[ra - 2])
        } else {
            (self.ad[ra - 2], self.ad[ra - 1])
        };
        let n = if self.tb {
            self.bd[rb - 2]
        } else {
            self.bd[rb - 1]
        };
        let lead = if ra > 2 {
            self.ad[..ra - 2].to_vec()
        } else {
            self.bd[..rb - 2].to_vec()
        };
        (lead, m, k, n)
    }

    fn out_dims(&self) -> Vec<usize> {
        let (mut lead, m, _, n) = self.sizes();
        lead.extend([m, n]);
        lead
    }

    /// act(op(A) op(B) + bias) in f64 (`act` None gives the pre-activation).
    fn reference(&self, a: &[f64], b: &[f64], bias: Option<&[f64]>, act: Activation) -> Vec<f64> {
        let (lead, m, k, n) = self.sizes();
        let batch: usize = lead.iter().product();
        let a_batched = self.ad.len() > 2;
        let b_batched = self.bd.len() > 2;
        let mut out = Vec::with_capacity(batch * m * n);
        for bi in 0..batch {
            let ao = if a_batched { bi * m * k } else { 0 };
            let bo = if b_batched { bi * k * n } else { 0 };
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for p in 0..k {
                        let av = if self.ta {
                            a[ao + p * m + i]
                        } else {
                            a[ao + i * k + p]
                        };
                        let bv = if self.tb {
                            b[bo + j * k + p]
                        } else {
                            b[bo + p * n + j]
                        };
                        s += av * bv;
                    }
                    if let Some(bias) = bias {
                        s += bias[j];
                    }
                    out.push(match act {
                        Activation::None => s,
                        Activation::Relu => s.max(0.0),
                        Activation::Gelu => gelu64(s),
                        Activation::Tanh => s.tanh(),
                        Activation::Sigmoid => 1.0 / (1.0 + (-s).exp()),
                        Activation::Silu => s / (1.0 + (-s).exp()),
                    });
                }
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

/// A small dim: often 1, odd sizes, never 0.
fn small_dim() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(1usize), 4 => 2usize..=5, 2 => Just(7usize)]
}

/// A small shape of rank `lo..=hi` with at most MAX_ELEMS elements.
fn small_shape(lo: usize, hi: usize) -> impl Strategy<Value = Vec<usize>> {
    (lo..=hi)
        .prop_flat_map(|r| prop::collection::vec(small_dim(), r))
        .prop_map(|d| cap(d, MAX_ELEMS))
}

/// Two shapes that broadcast together, derived from one output shape by dropping leading dims
/// and setting dims to 1 (either side, or both, may broadcast; either may be rank 0).
fn small_broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (small_shape(0, 3), any::<u64>()).prop_map(|(out, bits)| {
        let derive = |bits: u64| -> Vec<usize> {
            let drop = (bits % (out.len() as u64 + 1)) as usize;
            let drop = if bits & 16 == 0 { 0 } else { drop };
            out[drop..]
                .iter()
                .enumerate()
                .map(|(i, &d)| if (bits >> (8 + 2 * i)) & 3 == 0 { 1 } else { d })
                .collect()
        };
        (derive(bits), derive(bits >> 24))
    })
}

// ---------------------------------------------------------------------------------------------
// Binary ops with broadcasting
// ---------------------------------------------------------------------------------------------

type BinFn = fn(&Tensor, &Tensor) -> fitgrad::Result<Tensor>;
/// (name, op, f64 reference).
type BinCase = (&'static str, BinFn, fn(f64, f64) -> f64);

fn binary_ops() -> [BinCase; 4] {
    [
        ("add", Tensor::add, |x, y| x + y),
        ("sub", Tensor::sub, |x, y| x - y),
        ("mul", Tensor::mul, |x, y| x * y),
        ("div", Tensor::div, |x, y| x / y),
    ]
}

/// Every binary op on (ad, bd), with `mask` saying which side requires grad.
fn check_binary(dev: &Device, ad: &[usize], bd: &[usize], mask: &[bool], seed: u64) -> Res<()> {
    let a = host_data(seed, numel(ad), -2.0, 2.0);
    // b is a divisor too.
    let b = host_data_away_from_zero(seed ^ 1, numel(bd), 0.5, 2.0);
    for (name, op, f) in binary_ops() {
        let inputs = [input(a.clone(), ad, mask[0]), input(b.clone(), bd, mask[1])];
        let (ad2, bd2) = (ad.to_vec(), bd.to_vec());
        check_grads(
            dev,
            &format!("{name} {ad:?} {bd:?} (grad {mask:?})"),
            &inputs,
            seed,
            &|t| op(&t[0], &t[1]),
            &move |x| ref_bin(&x[0], &ad2, &x[1], &bd2, f),
        )?;
    }
    Ok(())
}

#[test]
fn binary_broadcast_fixed_shapes() {
    let Some(dev) = first_device() else { return };
    let cases: &[(&[usize], &[usize])] = &[
        (&[3, 4], &[3, 4]),
        (&[3, 4], &[4]),
        (&[3, 4], &[3, 1]),
        (&[3, 4], &[1, 4]),
        (&[3, 4], &[]),
        (&[], &[3, 4]),
        (&[3, 1], &[1, 4]),
        (&[4], &[3, 1]),
        (&[2, 3, 4], &[3, 1]),
        (&[1, 3, 1], &[2, 1, 5]),
        (&[], &[]),
    ];
    for (i, (ad, bd)) in cases.iter().enumerate() {
        if let Err(e) = check_binary(&dev, ad, bd, &[true, true], 100 + i as u64) {
            panic!("{e}");
        }
    }
}

/// Broadcast binary ops on every device.
fn binary_broadcast_every_device(dev: &Device) {
    proptest!(ProptestConfig::with_cases(CASES_ALL_DEVICES), |(
        (ad, bd) in small_broadcast_pair(),
        bits in any::<u64>(),
        seed in any::<u64>(),
    )| {
        let mask = grad_mask(bits, 2);
        check_binary(dev, &ad, &bd, &mask, seed).map_err(TestCaseError::fail)?;
    });
}

// ---------------------------------------------------------------------------------------------
// Unary ops, scalar ops, copy
// ---------------------------------------------------------------------------------------------

/// Where an op's input values come from.
#[derive(Clone, Copy, Debug)]
enum Domain {
    /// Uniform in [-2, 2).
    Any,
    /// Uniform in [-3, 3) (saturating activations).
    Wide,
    /// |x| in [0.05, 2), random sign (relu's kink, divisors with a negative side).
    AwayFromZero,
    /// [0.2, 3) (log, sqrt, fractional powers).
    Positive,
}

fn domain_data(d: Domain, seed: u64, n: usize) -> Vec<f32> {
    match d {
        Domain::Any => host_data(seed, n, -2.0, 2.0),
        Domain::Wide => host_data(seed, n, -3.0, 3.0),
        Domain::AwayFromZero => host_data_away_from_zero(seed, n, 0.05, 2.0),
        Domain::Positive => host_data(seed, n, 0.2, 3.0),
    }
}

type UnaryGpu = Box<dyn Fn(&Tensor) -> fitgrad::Result<Tensor>>;
type UnaryCpu = Box<dyn Fn(f64) -> f64>;
type UnaryCase = (String, Domain, UnaryGpu, UnaryCpu);

fn un(
    name: impl Into<String>,
    domain: Domain,
    gpu: impl Fn(&Tensor) -> fitgrad::Result<Tensor> + 'static,
    cpu: impl Fn(f64) -> f64 + 'static,
) -> UnaryCase {
    (name.into(), domain, Box::new(gpu), Box::new(cpu))
}

/// (name, input domain, GPU op, f64 reference) for every unary op; `s` is the scalar of the
/// scalar ops (|s| >= 0.25), `p` the exponent of pow_scalar.
fn unary_ops(s: f32, p: f32) -> Vec<UnaryCase> {
    let s64 = s as f64;
    let p64 = p as f64;
    // Fractional (or negative) powers need a positive base; integer powers take any sign.
    let pow_domain = if p.fract() == 0.0 && p >= 0.0 {
        Domain::Any
    } else if p.fract() == 0.0 {
        Domain::AwayFromZero
    } else {
        Domain::Positive
    };
    vec![
        un(
            format!("add_scalar({s})"),
            Domain::Any,
            move |t: &Tensor| t.add_scalar(s),
            move |x| x + s64,
        ),
        un(
            format!("sub_scalar({s})"),
            Domain::Any,
            move |t: &Tensor| t.sub_scalar(s),
            move |x| x - s64,
        ),
        un(
            format!("mul_scalar({s})"),
            Domain::Any,
            move |t: &Tensor| t.mul_scalar(s),
            move |x| x * s64,
        ),
        un(
            format!("div_scalar({s})"),
            Domain::Any,
            move |t: &Tensor| t.div_scalar(s),
            move |x| x / s64,
        ),
        un(
            format!("rsub_scalar({s})"),
            Domain::Any,
            move |t: &Tensor| t.rsub_scalar(s),
            move |x| s64 - x,
        ),
        un(
            format!("rdiv_scalar({s})"),
            Domain::AwayFromZero,
            move |t: &Tensor| t.rdiv_scalar(s),
            move |x| s64 / x,
        ),
        un("neg", Domain::Any, |t: &Tensor| t.neg(), |x| -x),
        un(
            "relu",
            Domain::AwayFromZero,
            |t: &Tensor| t.relu(),
            |x: f64| x.max(0.0),
        ),
        un("gelu", Domain::Wide, |t: &Tensor| t.gelu(), gelu64),
        un("tanh", Domain::Wide, |t: &Tensor| t.tanh(), f64::tanh),
        un("sigmoid", Domain::Wide, |t: &Tensor| t.sigmoid(), sigmoid64),
        un("exp", Domain::Any, |t: &Tensor| t.exp(), f64::exp),
        un("log", Domain::Positive, |t: &Tensor| t.log(), f64::ln),
        un("sqrt", Domain::Positive, |t: &Tensor| t.sqrt(), f64::sqrt),
        un(
            format!("pow_scalar({p})"),
            pow_domain,
            move |t: &Tensor| t.pow_scalar(p),
            move |x: f64| x.powf(p64),
        ),
        un("copy", Domain::Any, |t: &Tensor| t.copy(), |x| x),
        // Ops after a copy: the copy's gradient passes through to the leaf.
        un(
            "copy.exp",
            Domain::Any,
            |t: &Tensor| t.copy()?.exp(),
            f64::exp,
        ),
    ]
}

fn check_unary(dev: &Device, dims: &[usize], s: f32, p: f32, seed: u64) -> Res<()> {
    for (k, (name, domain, gpu, cpu)) in unary_ops(s, p).into_iter().enumerate() {
        let data = domain_data(domain, seed.wrapping_add(k as u64), numel(dims));
        check_grads(
            dev,
            &format!("{name} {dims:?}"),
            &[input(data, dims, true)],
            seed,
            &|t| gpu(&t[0]),
            &|x| x[0].iter().map(|&v| cpu(v)).collect(),
        )?;
    }
    Ok(())
}

/// A scalar operand with |s| in [0.25, 3).
fn scalar_operand() -> impl Strategy<Value = f32> {
    (0.25f32..3.0, any::<bool>()).prop_map(|(m, neg)| if neg { -m } else { m })
}

fn exponent() -> impl Strategy<Value = f32> {
    prop::sample::select(vec![0.0f32, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 1.5, -2.5])
}

// ---------------------------------------------------------------------------------------------
// Reductions, reshape, transpose
// ---------------------------------------------------------------------------------------------

fn check_reductions(dev: &Device, dims: &[usize], seed: u64) -> Res<()> {
    let data = host_data(seed, numel(dims), -2.0, 2.0);
    let inputs = [input(data, dims, true)];
    let n = numel(dims) as f64;
    check_grads(
        dev,
        &format!("sum {dims:?}"),
        &inputs,
        seed,
        &|t| t[0].sum(),
        &|x| vec![x[0].iter().sum()],
    )?;
    check_grads(
        dev,
        &format!("mean {dims:?}"),
        &inputs,
        seed,
        &|t| t[0].mean(),
        &|x| vec![x[0].iter().sum::<f64>() / n],
    )?;
    for axis in 0..dims.len() {
        for keepdim in [false, true] {
            for mean in [false, true] {
                let name = if mean { "mean_axis" } else { "sum_axis" };
                let d = dims.to_vec();
                check_grads(
                    dev,
                    &format!("{name}({axis}, keepdim {keepdim}) {dims:?}"),
                    &inputs,
                    seed,
                    &|t| {
                        if mean {
                            t[0].mean_axis(axis, keepdim)
                        } else {
                            t[0].sum_axis(axis, keepdim)
                        }
                    },
                    &move |x| reduce64(&x[0], &d, axis, mean),
                )?;
            }
        }
    }
    Ok(())
}

fn check_reshape_transpose(dev: &Device, dims: &[usize], seed: u64) -> Res<()> {
    let data = host_data(seed, numel(dims), -2.0, 2.0);
    let inputs = [input(data, dims, true)];
    let flat = [numel(dims)];
    let reversed: Vec<usize> = dims.iter().rev().cloned().collect();
    check_grads(
        dev,
        &format!("reshape {dims:?} -> {flat:?}"),
        &inputs,
        seed,
        &|t| t[0].reshape(&flat),
        &|x| x[0].clone(),
    )?;
    // Through an op after the reshape, and back.
    check_grads(
        dev,
        &format!("reshape {dims:?} -> {reversed:?} -> tanh -> reshape back"),
        &inputs,
        seed,
        &|t| t[0].reshape(&reversed)?.tanh()?.reshape(dims),
        &|x| x[0].iter().map(|v| v.tanh()).collect(),
    )?;
    if dims.len() >= 2 {
        let d = dims.to_vec();
        check_grads(
            dev,
            &format!("transpose {dims:?}"),
            &inputs,
            seed,
            &|t| t[0].transpose(),
            &move |x| transpose64(&x[0], &d),
        )?;
        let d = dims.to_vec();
        check_grads(
            dev,
            &format!("transpose.sigmoid.transpose {dims:?}"),
            &inputs,
            seed,
            &|t| t[0].transpose()?.sigmoid()?.transpose(),
            &move |x| {
                let mut td = d.clone();
                let k = td.len();
                td.swap(k - 2, k - 1);
                let y: Vec<f64> = transpose64(&x[0], &d)
                    .iter()
                    .map(|&v| sigmoid64(v))
                    .collect();
                transpose64(&y, &td)
            },
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Softmax family, cross-entropy, MSE
// ---------------------------------------------------------------------------------------------

fn check_softmax(dev: &Device, dims: &[usize], seed: u64) -> Res<()> {
    let data = host_data(seed, numel(dims), -3.0, 3.0);
    let c = dims.last().copied().unwrap_or(1);
    let inputs = [input(data, dims, true)];
    for log in [false, true] {
        let name = if log { "log_softmax" } else { "softmax" };
        check_grads(
            dev,
            &format!("{name} {dims:?}"),
            &inputs,
            seed,
            &|t| {
                if log {
                    t[0].log_softmax()
                } else {
                    t[0].softmax()
                }
            },
            &|x| softmax64(&x[0], c, log),
        )?;
    }
    Ok(())
}

fn targets_for(seed: u64, b: usize, c: usize) -> Vec<u32> {
    let mut r = HostRng::new(seed ^ 0x7A);
    (0..b).map(|_| (r.next_u64() % c as u64) as u32).collect()
}

fn check_cross_entropy(dev: &Device, b: usize, c: usize, seed: u64) -> Res<()> {
    let data = host_data(seed, b * c, -3.0, 3.0);
    let targets = targets_for(seed, b, c);
    let inputs = [input(data, &[b, c], true)];
    let t2 = targets.clone();
    check_grads(
        dev,
        &format!("cross_entropy_loss ({b}, {c}) targets {targets:?}"),
        &inputs,
        seed,
        &|t| t[0].cross_entropy_loss(&targets),
        &|x| vec![cross_entropy64(&x[0], c, &t2)],
    )?;
    check_grads(
        dev,
        &format!("cross_entropy(..).0 ({b}, {c}) targets {targets:?}"),
        &inputs,
        seed,
        &|t| Ok(t[0].cross_entropy(&targets)?.0),
        &|x| vec![cross_entropy64(&x[0], c, &t2)],
    )?;
    Ok(())
}

fn check_mse(dev: &Device, dims: &[usize], mask: &[bool], seed: u64) -> Res<()> {
    let p = host_data(seed, numel(dims), -2.0, 2.0);
    let t = host_data(seed ^ 3, numel(dims), -2.0, 2.0);
    let inputs = [input(p, dims, mask[0]), input(t, dims, mask[1])];
    let n = numel(dims) as f64;
    let mse = move |x: &[Vec<f64>]| {
        vec![
            x[0].iter()
                .zip(&x[1])
                .map(|(p, t)| (p - t) * (p - t))
                .sum::<f64>()
                / n,
        ]
    };
    check_grads(
        dev,
        &format!("mse pow_scalar(2) {dims:?} (grad {mask:?})"),
        &inputs,
        seed,
        &|t| t[0].sub(&t[1])?.pow_scalar(2.0)?.mean(),
        &mse,
    )?;
    check_grads(
        dev,
        &format!("mse d*d {dims:?} (grad {mask:?})"),
        &inputs,
        seed,
        &|t| {
            let d = t[0].sub(&t[1])?;
            d.mul(&d)?.mean()
        },
        &mse,
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Matmul
// ---------------------------------------------------------------------------------------------

/// How the operands carry batch dims.
#[derive(Clone, Copy, Debug)]
enum Batch {
    None,
    /// A batched, B a shared matrix.
    SharedB,
    /// A a shared matrix, B batched.
    SharedA,
    Both,
}

fn stored(rows: usize, cols: usize, trans: bool, lead: &[usize]) -> Vec<usize> {
    let mut d = lead.to_vec();
    if trans {
        d.extend([cols, rows]);
    } else {
        d.extend([rows, cols]);
    }
    d
}

#[allow(clippy::too_many_arguments)]
fn check_matmul(
    dev: &Device,
    (m, k, n): (usize, usize, usize),
    lead: &[usize],
    batch: Batch,
    (ta, tb): (bool, bool),
    bias: bool,
    act: Activation,
    mask: &[bool],
    seed: u64,
) -> Res<()> {
    let (a_lead, b_lead): (&[usize], &[usize]) = match batch {
        Batch::None => (&[], &[]),
        Batch::SharedB => (lead, &[]),
        Batch::SharedA => (&[], lead),
        Batch::Both => (lead, lead),
    };
    let mm = Mm {
        ad: stored(m, k, ta, a_lead),
        bd: stored(k, n, tb, b_lead),
        ta,
        tb,
        act,
    };
    // A fused relu needs pre-activations away from its kink, so that the finite differences
    // (which move a pre-activation by at most ~3e-3) do not cross it: redraw until they are.
    let mut draw = seed;
    let (a, b, bv) = loop {
        let a = host_data(draw, numel(&mm.ad), -1.5, 1.5);
        let b = host_data(draw ^ 1, numel(&mm.bd), -1.5, 1.5);
        let bv = host_data(draw ^ 2, n, -1.0, 1.0);
        if act != Activation::Relu {
            break (a, b, bv);
        }
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let pre = mm.reference(
            &f(&a),
            &f(&b),
            bias.then_some(&f(&bv)[..]),
            Activation::None,
        );
        if pre.iter().all(|p| p.abs() > 0.02) {
            break (a, b, bv);
        }
        draw = draw.wrapping_add(0x9E37_79B9);
        if draw.wrapping_sub(seed) > 0x9E37_79B9 * 200 {
            return Err(format!(
                "test bug: no data away from relu's kink for {mm:?}"
            ));
        }
    };
    let mut inputs = vec![input(a, &mm.ad, mask[0]), input(b, &mm.bd, mask[1])];
    if bias {
        inputs.push(input(bv, &[n], mask[2]));
    }
    let what = format!(
        "matmul_with A {:?} B {:?} trans ({ta}, {tb}) bias {bias} {act:?} (grad {mask:?})",
        mm.ad, mm.bd
    );
    let out_dims = mm.out_dims();
    let mm2 = mm.clone();
    check_grads(
        dev,
        &what,
        &inputs,
        seed,
        &|t| {
            let mut opts = MatmulOptions::new().trans_a(ta).trans_b(tb).activation(act);
            opts.bias = t.get(2);
            let out = t[0].matmul_with(&t[1], &opts)?;
            assert_eq!(out.dims(), out_dims.as_slice(), "{what}: output dims");
            Ok(out)
        },
        &move |x| mm2.reference(&x[0], &x[1], x.get(2).map(|v| &v[..]), mm2.act),
    )
}

fn activation() -> impl Strategy<Value = Activation> {
    prop::sample::select(vec![
        Activation::None,
        Activation::Relu,
        Activation::Gelu,
        Activation::Tanh,
        Activation::Sigmoid,
    ])
}

fn batch_mode() -> impl Strategy<Value = Batch> {
    prop::sample::select(vec![
        Batch::None,
        Batch::SharedB,
        Batch::SharedA,
        Batch::Both,
    ])
}

fn lead_dims() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        3 => (1usize..=3).prop_map(|b| vec![b]),
        1 => (1usize..=2, 1usize..=3).prop_map(|(a, b)| vec![a, b]),
    ]
}

#[test]
fn matmul_every_transpose_bias_activation() {
    let Some(dev) = first_device() else { return };
    let mut seed = 7;
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (bias, act) in [
            (false, Activation::None),
            (true, Activation::None),
            (true, Activation::Relu),
            (false, Activation::Gelu),
            (true, Activation::Gelu),
        ] {
            seed += 1;
            let mask: &[bool] = &[true, true, true];
            if let Err(e) = check_matmul(
                &dev,
                (3, 5, 4),
                &[],
                Batch::None,
                (ta, tb),
                bias,
                act,
                mask,
                seed,
            ) {
                panic!("{e}");
            }
        }
    }
}

#[test]
fn matmul_batched_fixed() {
    let Some(dev) = first_device() else { return };
    let mut seed = 50;
    for batch in [Batch::SharedB, Batch::SharedA, Batch::Both] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            seed += 1;
            if let Err(e) = check_matmul(
                &dev,
                (3, 2, 5),
                &[2],
                batch,
                (ta, tb),
                true,
                Activation::None,
                &[true, true, true],
                seed,
            ) {
                panic!("{e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Properties on the first device
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn binary_broadcast(
        (ad, bd) in small_broadcast_pair(),
        bits in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_binary(&dev, &ad, &bd, &grad_mask(bits, 2), seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn unary_and_scalar_ops(
        dims in small_shape(0, 4),
        s in scalar_operand(),
        p in exponent(),
        seed in any::<u64>(),
    ) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_unary(&dev, &dims, s, p, seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn reductions(dims in small_shape(0, 4), seed in any::<u64>()) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_reductions(&dev, &dims, seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn reshape_and_transpose(dims in small_shape(1, 4), seed in any::<u64>()) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_reshape_transpose(&dev, &dims, seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn softmax_and_log_softmax(dims in small_shape(0, 3), seed in any::<u64>()) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_softmax(&dev, &dims, seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn cross_entropy_logits(b in 1usize..=5, c in prop_oneof![Just(1usize), 2usize..=7], seed in any::<u64>()) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_cross_entropy(&dev, b, c, seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn mse(dims in small_shape(0, 3), bits in any::<u64>(), seed in any::<u64>()) {
        let Some(dev) = first_device() else { return Ok(()) };
        check_mse(&dev, &dims, &grad_mask(bits, 2), seed).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn matmul(
        m in small_dim(),
        k in small_dim(),
        n in small_dim(),
        lead in lead_dims(),
        batch in batch_mode(),
        ta in any::<bool>(),
        tb in any::<bool>(),
        bias in any::<bool>(),
        act in activation(),
        bits in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let Some(dev) = first_device() else { return Ok(()) };
        let mask = grad_mask(bits, if bias { 3 } else { 2 });
        check_matmul(&dev, (m, k, n), &lead, batch, (ta, tb), bias, act, &mask, seed)
            .map_err(TestCaseError::fail)?;
    }
}

// ---------------------------------------------------------------------------------------------
// A composed network on every device
// ---------------------------------------------------------------------------------------------

/// x (b, i) -> gelu(x W1 + b1) -> (h W2ᵀ + b2) -> cross-entropy, with gradients for W1, b1, W2,
/// b2 (x does not require grad).
fn check_mlp(dev: &Device, (b, i, h, c): (usize, usize, usize, usize), seed: u64) -> Res<()> {
    let targets = targets_for(seed, b, c);
    let inputs = [
        input(host_data(seed, b * i, -1.5, 1.5), &[b, i], false),
        input(host_data(seed ^ 1, i * h, -1.0, 1.0), &[i, h], true),
        input(host_data(seed ^ 2, h, -0.5, 0.5), &[h], true),
        input(host_data(seed ^ 3, c * h, -1.0, 1.0), &[c, h], true),
        input(host_data(seed ^ 4, c, -0.5, 0.5), &[c], true),
    ];
    let l1 = Mm {
        ad: vec![b, i],
        bd: vec![i, h],
        ta: false,
        tb: false,
        act: Activation::Gelu,
    };
    let l2 = Mm {
        ad: vec![b, h],
        bd: vec![c, h],
        ta: false,
        tb: true,
        act: Activation::None,
    };
    let t2 = targets.clone();
    check_grads(
        dev,
        &format!("mlp (b {b}, in {i}, hidden {h}, classes {c}) targets {targets:?}"),
        &inputs,
        seed,
        &|t| {
            let hid = t[0].matmul_with(
                &t[1],
                &MatmulOptions::new()
                    .bias(&t[2])
                    .activation(Activation::Gelu),
            )?;
            let logits = hid.matmul_with(&t[3], &MatmulOptions::new().trans_b(true).bias(&t[4]))?;
            logits.cross_entropy_loss(&targets)
        },
        &|x| {
            let hid = l1.reference(&x[0], &x[1], Some(&x[2]), Activation::Gelu);
            let logits = l2.reference(&hid, &x[3], Some(&x[4]), Activation::None);
            vec![cross_entropy64(&logits, c, &t2)]
        },
    )
}

fn mlp_every_device(dev: &Device) {
    proptest!(ProptestConfig::with_cases(CASES_ALL_DEVICES), |(
        b in 1usize..=5,
        i in small_dim(),
        h in small_dim(),
        c in 2usize..=5,
        seed in any::<u64>(),
    )| {
        check_mlp(dev, (b, i, h, c), seed).map_err(TestCaseError::fail)?;
    });
}

// ---------------------------------------------------------------------------------------------
// Behaviour of the graph
// ---------------------------------------------------------------------------------------------

fn t32(dev: &Device, data: &[f32], dims: &[usize]) -> Tensor {
    upload(dev, data, dims, DType::F32)
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec_f32().expect("readback")
}

fn grad_vals(t: &Tensor) -> Vec<f32> {
    vals(&t.grad().expect("a gradient"))
}

fn assert_autograd_err<T: std::fmt::Debug>(r: fitgrad::Result<T>, what: &str, needle: &str) {
    match r {
        Err(Error::Autograd(msg)) => assert!(
            msg.contains(needle),
            "{what}: Autograd error should mention '{needle}': {msg}"
        ),
        other => panic!("{what}: expected Err(Error::Autograd), got {other:?}"),
    }
}

fn approx(what: &str, got: &[f32], want: &[f32]) {
    let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    if let Err(e) = compare(what, got, &want) {
        panic!("{e}");
    }
}

/// `sum((x * x) * w)`: gradient 2 x w.
fn square_loss(x: &Tensor, w: &Tensor) -> Tensor {
    x.mul(x).unwrap().mul(w).unwrap().sum().unwrap()
}

#[test]
fn gradients_accumulate_in_place_without_new_buffers() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let dims = [5, 7];
    let xh = host_data(1, 35, -2.0, 2.0);
    let wh = host_data(2, 35, -1.0, 1.0);
    let x = t32(&dev, &xh, &dims).with_requires_grad();
    let w = t32(&dev, &wh, &dims);
    let want: Vec<f32> = xh.iter().zip(&wh).map(|(x, w)| 2.0 * x * w).collect();

    // Warm up: pipelines, arena segments, parameter ring.
    square_loss(&x, &w).backward().unwrap();
    x.zero_grad();
    assert!(x.grad().is_none(), "zero_grad leaves no gradient");

    square_loss(&x, &w).backward().unwrap();
    let held = x.grad().expect("a gradient");
    let single = vals(&held);
    approx("single backward", &single, &want);
    dev.sync().unwrap();
    let after_first = dev.memory_stats();

    let loss = square_loss(&x, &w);
    dev.sync().unwrap();
    let before = dev.memory_stats();
    loss.backward().unwrap();
    drop(loss);
    dev.sync().unwrap();
    let after = dev.memory_stats();
    let twice: Vec<f32> = single.iter().map(|v| 2.0 * v).collect();
    approx("two backward calls", &grad_vals(&x), &twice);
    assert_eq!(
        after.buffers_created, before.buffers_created,
        "the second backward (accumulation) created a wgpu buffer:\nbefore {before:?}\nafter {after:?}"
    );
    // In place: the gradient taken after the first backward is the accumulated one (as in
    // torch, where `x.grad` is updated in place), and no more memory is held than after the
    // first backward (the loss, the seed and the temporaries are gone).
    approx(
        "the first gradient's tensor after the second backward",
        &vals(&held),
        &twice,
    );
    assert_eq!(
        after.bytes_in_use, after_first.bytes_in_use,
        "memory held after the second backward differs from after the first"
    );
    drop(held);

    // zero_grad: None, and the next backward starts from zero.
    x.zero_grad();
    assert!(x.grad().is_none());
    square_loss(&x, &w).backward().unwrap();
    approx("backward after zero_grad", &grad_vals(&x), &want);
}

/// Allocations (arena blocks handed out) of `f`.
fn allocations_of(dev: &Device, f: impl FnOnce()) -> u64 {
    let before = dev.memory_stats().allocations;
    f();
    dev.memory_stats().allocations - before
}

/// A leaf's first gradient is kept as computed when nothing else shares its memory (the
/// documented intent of `Node::accumulate`), so a backward into an empty gradient allocates no
/// more than one that adds into a held gradient in place.
#[test]
fn first_gradient_is_kept_without_a_copy() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = t32(&dev, &host_data(1, 35, -2.0, 2.0), &[5, 7]).with_requires_grad();
    let w = t32(&dev, &host_data(2, 35, -1.0, 1.0), &[5, 7]);
    let loss = || x.exp().unwrap().mul(&w).unwrap().sum().unwrap();
    loss().backward().unwrap(); // warm up
    x.zero_grad();
    let l = loss();
    let into_none = allocations_of(&dev, || l.backward().unwrap());
    let l = loss();
    let into_held = allocations_of(&dev, || l.backward().unwrap());
    assert_eq!(
        into_none, into_held,
        "a backward with no gradient held allocated {into_none} blocks, one that accumulates \
         {into_held}: the fresh gradient was copied although nothing else shares it"
    );
}

#[test]
fn seed_of_backward_with_is_not_modified_by_accumulation() {
    let Some(dev) = first_device() else { return };
    let x = t32(&dev, &[1.0, 2.0, 3.0], &[3]).with_requires_grad();
    let seed = t32(&dev, &[0.5, -1.0, 2.0], &[3]);
    // x is its own root: the seed is the gradient.
    x.backward_with(seed.clone()).unwrap();
    x.backward_with(seed.clone()).unwrap();
    approx(
        "x.grad after two backward_with",
        &grad_vals(&x),
        &[1.0, -2.0, 4.0],
    );
    approx("the seed", &vals(&seed), &[0.5, -1.0, 2.0]);
    // Through an op whose backward passes the gradient through unchanged.
    let y = t32(&dev, &[1.0, 2.0, 3.0], &[3]).with_requires_grad();
    y.add_scalar(1.0)
        .unwrap()
        .backward_with(seed.clone())
        .unwrap();
    y.add_scalar(1.0)
        .unwrap()
        .backward_with(seed.clone())
        .unwrap();
    approx(
        "y.grad after two backward_with",
        &grad_vals(&y),
        &[1.0, -2.0, 4.0],
    );
    approx("the seed", &vals(&seed), &[0.5, -1.0, 2.0]);
}

#[test]
fn tensor_used_twice_gets_the_summed_gradient() {
    let Some(dev) = first_device() else { return };
    let xh = [0.5f32, -1.5, 2.0, 0.25, -0.75, 1.0];
    let wh = [1.0f32, -0.5, 0.25, 2.0, -1.0, 0.5];
    let w = t32(&dev, &wh, &[2, 3]);

    let x = t32(&dev, &xh, &[2, 3]).with_requires_grad();
    x.mul(&x)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f32> = xh.iter().zip(&wh).map(|(x, w)| 2.0 * x * w).collect();
    approx("x*x", &grad_vals(&x), &want);

    let x = t32(&dev, &xh, &[2, 3]).with_requires_grad();
    x.add(&x)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f32> = wh.iter().map(|w| 2.0 * w).collect();
    approx("x+x", &grad_vals(&x), &want);

    // A non-leaf used twice (and the leaf once more): y = 3x; sum((y*y + y + x) * w).
    let x = t32(&dev, &xh, &[2, 3]).with_requires_grad();
    let y = x.mul_scalar(3.0).unwrap();
    let z = y.mul(&y).unwrap().add(&y).unwrap().add(&x).unwrap();
    z.mul(&w).unwrap().sum().unwrap().backward().unwrap();
    let want: Vec<f32> = xh
        .iter()
        .zip(&wh)
        .map(|(x, w)| w * (18.0 * x + 3.0 + 1.0))
        .collect();
    approx("y*y + y + x with y = 3x", &grad_vals(&x), &want);

    // Two leaves sharing one upstream gradient (add passes the same tensor to both).
    let a = t32(&dev, &xh, &[2, 3]).with_requires_grad();
    let b = t32(&dev, &xh, &[2, 3]).with_requires_grad();
    a.add(&b)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    a.add(&b)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f32> = wh.iter().map(|w| 2.0 * w).collect();
    approx("a of a+b, twice", &grad_vals(&a), &want);
    approx("b of a+b, twice", &grad_vals(&b), &want);
}

/// One tensor as both operands of a matmul (x x, x xᵀ, xᵀ x): the two gradients add up.
#[test]
fn matmul_of_a_tensor_with_itself() {
    let Some(dev) = first_device() else { return };
    for (ta, tb) in [(false, false), (false, true), (true, false)] {
        let d = 4;
        let data = host_data(21, d * d, -1.5, 1.5);
        let mm = Mm {
            ad: vec![d, d],
            bd: vec![d, d],
            ta,
            tb,
            act: Activation::None,
        };
        let r = check_grads(
            &dev,
            &format!("x.matmul_with(x) trans ({ta}, {tb})"),
            &[input(data, &[d, d], true)],
            22,
            &|t| t[0].matmul_with(&t[0], &MatmulOptions::new().trans_a(ta).trans_b(tb)),
            &|x| mm.reference(&x[0], &x[0], None, Activation::None),
        );
        if let Err(e) = r {
            panic!("{e}");
        }
    }
}

/// Environment variable that makes `deep_graph_child` run (in a child process of this binary).
const DEEP_CHILD_ENV: &str = "FITGRAD_AUTOGRAD_DEEP_GRAPH_CHILD";
/// Recorded ops in the deep graph (a long loop accumulating a loss without `no_grad`).
const DEEP_GRAPH_OPS: usize = 50_000;

/// The body of `deep_graph_backward_and_drop`, run as its child process, since a stack overflow
/// aborts the whole process. Still a no-op without the variable, so that `--ignored` runs in
/// one process cannot take the other tests down with it.
#[test]
#[ignore = "child process of deep_graph_backward_and_drop: set FITGRAD_AUTOGRAD_DEEP_GRAPH_CHILD=1"]
fn deep_graph_child() {
    if std::env::var_os(DEEP_CHILD_ENV).is_none() {
        return;
    }
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = t32(&dev, &[1.0, 2.0], &[2]).with_requires_grad();
    let mut y = x.clone();
    for _ in 0..DEEP_GRAPH_OPS {
        y = y.add_scalar(0.0).unwrap();
    }
    let loss = y.sum().unwrap();
    drop(y);
    eprintln!("deep graph: recorded");
    loss.backward().unwrap();
    eprintln!("deep graph: backward done");
    approx("deep graph", &grad_vals(&x), &[1.0, 1.0]);
    drop(loss);
    eprintln!("deep graph: dropped");
    // A graph dropped without backward.
    let mut y = x.clone();
    for _ in 0..DEEP_GRAPH_OPS {
        y = y.add_scalar(0.0).unwrap();
    }
    drop(y);
    eprintln!("deep graph: dropped without backward");
}

/// backward() is iterative so that deep graphs work; dropping such a graph (after backward or
/// without it) must not recurse once per node either. Runs in a child process (on a 2 MiB test
/// thread, as every test), since a stack overflow aborts instead of panicking.
#[test]
fn deep_graph_backward_and_drop() {
    if std::env::var_os(DEEP_CHILD_ENV).is_some() || first_device().is_none() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "autograd::deep_graph_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DEEP_CHILD_ENV, "1")
        .env_remove("RUST_MIN_STACK")
        .output()
        .expect("run the test binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stages: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("deep graph") || l.contains("overflow") || l.contains("panicked"))
        .collect();
    assert!(
        out.status.success(),
        "a graph of {DEEP_GRAPH_OPS} recorded ops failed ({}): {stages:#?}",
        out.status
    );
    // The child is #[ignore]d: a missing `--ignored` would pass without running it.
    assert!(
        stages.contains(&"deep graph: dropped without backward"),
        "the child did not run the deep graph: {stages:#?}"
    );
}

#[test]
fn no_grad_records_nothing() {
    let Some(dev) = first_device() else { return };
    let x = t32(&dev, &[1.0, -2.0, 3.0, 0.5], &[2, 2]).with_requires_grad();
    assert!(fitgrad::is_grad_enabled());
    {
        let _g = fitgrad::no_grad();
        assert!(!fitgrad::is_grad_enabled());
        let outs = [
            x.mul(&x).unwrap(),
            x.exp().unwrap(),
            x.matmul(&x).unwrap(),
            x.softmax().unwrap(),
            x.sum().unwrap(),
            x.reshape(&[4]).unwrap(),
            x.transpose().unwrap(),
            x.copy().unwrap(),
            x.cross_entropy_loss(&[0, 1]).unwrap(),
            x.cross_entropy(&[0, 1]).unwrap().0,
            x.matmul_with(&x, &MatmulOptions::new().activation(Activation::Gelu))
                .unwrap(),
        ];
        for (i, o) in outs.iter().enumerate() {
            assert!(!o.requires_grad(), "output {i} under no_grad requires grad");
        }
        {
            let _inner = fitgrad::no_grad();
        }
        assert!(!fitgrad::is_grad_enabled(), "a nested guard restores 'off'");
        assert_autograd_err(x.sum().unwrap().backward(), "backward under no_grad", "");
    }
    assert!(fitgrad::is_grad_enabled(), "the guard restores recording");
    // The mode is per thread: another thread records while this one is in no_grad.
    {
        let _g = fitgrad::no_grad();
        let other = std::thread::spawn(fitgrad::is_grad_enabled).join().unwrap();
        assert!(
            other,
            "no_grad on one thread turned recording off on another"
        );
    }
    let y = x.mul(&x).unwrap();
    assert!(y.requires_grad());
    y.sum().unwrap().backward().unwrap();
    approx("after no_grad", &grad_vals(&x), &[2.0, -4.0, 6.0, 1.0]);
}

#[test]
fn detach_stops_the_gradient() {
    let Some(dev) = first_device() else { return };
    let xh = [1.0f32, -2.0, 3.0];
    let x = t32(&dev, &xh, &[3]).with_requires_grad();
    let d = x.detach();
    assert!(!d.requires_grad());
    assert!(d.is_leaf());
    // sum(detach(x) * x): only the second factor carries a gradient: x.
    let out = d.mul(&x).unwrap();
    assert!(out.requires_grad());
    out.sum().unwrap().backward().unwrap();
    approx("detach(x) * x", &grad_vals(&x), &xh);
    // Detaching an op's output cuts the graph: nothing requires grad after it.
    let e = x.exp().unwrap().detach();
    assert!(!e.mul_scalar(2.0).unwrap().requires_grad());
}

#[test]
fn backward_twice_through_one_graph_is_an_error() {
    let Some(dev) = first_device() else { return };
    let x = t32(&dev, &[1.0, 2.0], &[2]).with_requires_grad();
    let loss = x.exp().unwrap().sum().unwrap();
    loss.backward().unwrap();
    let g1 = grad_vals(&x);
    assert_autograd_err(loss.backward(), "second backward", "already freed");
    // The failed backward must not have changed the gradient.
    approx("gradient after the failed backward", &grad_vals(&x), &g1);
}

#[test]
fn backward_needs_a_scalar_and_backward_with_works() {
    let Some(dev) = first_device() else { return };
    let xh = host_data(9, 12, -2.0, 2.0);
    let wh = host_data(10, 12, -1.0, 1.0);
    let x = t32(&dev, &xh, &[3, 4]).with_requires_grad();
    let out = x.tanh().unwrap();
    assert_autograd_err(out.backward(), "backward on (3, 4)", "");
    // The failed call consumed nothing: backward_with works on the same graph.
    let w = t32(&dev, &wh, &[3, 4]);
    assert_autograd_err(
        out.backward_with(t32(&dev, &wh[..4], &[4])),
        "backward_with of the wrong shape",
        "",
    );
    out.backward_with(w).unwrap();
    let want: Vec<f32> = xh
        .iter()
        .zip(&wh)
        .map(|(&x, &w)| (w as f64 * (1.0 - (x as f64).tanh().powi(2))) as f32)
        .collect();
    approx("backward_with", &grad_vals(&x), &want);
    // A one-element tensor of rank > 0 is a loss too.
    let y = t32(&dev, &[0.5], &[1, 1]).with_requires_grad();
    y.mul_scalar(3.0).unwrap().backward().unwrap();
    approx("backward of (1, 1)", &grad_vals(&y), &[3.0]);
    // Nothing requires grad: an error.
    let z = t32(&dev, &[1.0], &[]);
    assert_autograd_err(z.exp().unwrap().backward(), "backward without grad", "");
}

#[test]
fn ops_without_backward_rule_fail_at_backward() {
    let Some(dev) = first_device() else { return };
    let x = t32(&dev, &[1.0, -2.0, 3.0, 0.5, 4.0, -1.0], &[2, 3]).with_requires_grad();
    let cases: Vec<(&str, Tensor)> = vec![
        ("clamp", x.clamp(-1.0, 1.0).unwrap().sum().unwrap()),
        ("max_axis", x.max_axis(1, false).unwrap().sum().unwrap()),
        ("max_axis", x.max().unwrap()),
        (
            "max_axis_with_indices",
            x.max_axis_with_indices(0, true).unwrap().0.sum().unwrap(),
        ),
        // Mixed with differentiable ops on both sides.
        (
            "clamp",
            x.exp()
                .unwrap()
                .clamp(0.0, 2.0)
                .unwrap()
                .mul(&x)
                .unwrap()
                .sum()
                .unwrap(),
        ),
    ];
    for (name, loss) in cases {
        assert!(loss.requires_grad(), "{name}: recorded");
        assert_autograd_err(loss.backward(), name, name);
    }
    // argmax has no gradient at all: its indices are not recorded.
    assert!(!x.argmax_axis(1, false).unwrap().requires_grad());
    assert!(!x.max_axis_with_indices(1, false).unwrap().1.requires_grad());
    // Detached, the same op is fine. (A failed backward may have accumulated part of the
    // gradient into leaves before reaching the op, as in torch: start from zero.)
    x.zero_grad();
    let loss = x
        .detach()
        .clamp(-1.0, 1.0)
        .unwrap()
        .mul(&x)
        .unwrap()
        .sum()
        .unwrap();
    loss.backward().unwrap();
    approx(
        "clamp(detach(x)) * x",
        &grad_vals(&x),
        &[1.0, -1.0, 1.0, 0.5, 1.0, -1.0],
    );
}

#[test]
fn ops_on_tensors_without_grad_are_not_recorded() {
    let Some(dev) = first_device() else { return };
    let a = t32(&dev, &host_data(3, 6, -1.0, 1.0), &[2, 3]);
    let b = t32(&dev, &host_data(4, 6, -1.0, 1.0), &[3, 2]);
    let bias = t32(&dev, &[0.1, 0.2], &[2]);
    assert!(!a.requires_grad() && a.is_leaf() && a.grad().is_none());
    let outs = [
        ("add", a.add(&a).unwrap()),
        ("div", a.div_scalar(2.0).unwrap()),
        ("relu", a.relu().unwrap()),
        ("sum_axis", a.sum_axis(1, true).unwrap()),
        ("mean", a.mean().unwrap()),
        ("transpose", a.transpose().unwrap()),
        ("reshape", a.reshape(&[6]).unwrap()),
        ("log_softmax", a.log_softmax().unwrap()),
        ("cross_entropy_loss", a.cross_entropy_loss(&[2, 0]).unwrap()),
        ("matmul", a.matmul(&b).unwrap()),
        (
            "matmul gelu",
            a.matmul_with(
                &b,
                &MatmulOptions::new()
                    .bias(&bias)
                    .activation(Activation::Gelu),
            )
            .unwrap(),
        ),
        ("copy", a.copy().unwrap()),
        ("clamp", a.clamp(0.0, 1.0).unwrap()),
    ];
    for (name, o) in &outs {
        assert!(
            !o.requires_grad(),
            "{name} of a tensor without grad requires grad"
        );
        assert!(o.is_leaf(), "{name}");
        assert!(o.grad().is_none(), "{name}");
    }
    // One input requiring grad is enough; the other still gets no gradient.
    let g = b.clone().with_requires_grad();
    assert!(
        !b.requires_grad(),
        "a clone made before set_requires_grad is separate"
    );
    let out = a.matmul(&g).unwrap();
    assert!(out.requires_grad() && !out.is_leaf());
    out.sum().unwrap().backward().unwrap();
    assert!(g.grad().is_some() && a.grad().is_none() && b.grad().is_none());
    // Only the bias requires grad: the fused-gelu path still records.
    let bg = bias.clone().with_requires_grad();
    let out = a
        .matmul_with(
            &b,
            &MatmulOptions::new().bias(&bg).activation(Activation::Gelu),
        )
        .unwrap();
    assert!(out.requires_grad());
}

/// Bytes held by a tensor and its gradient.
fn grad_bytes(t: &Tensor) -> u64 {
    t.grad().map_or(0, |g| g.allocated_bytes())
}

#[test]
fn saved_activations_are_freed_after_backward() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = t32(&dev, &host_data(11, 8 * 16, -1.0, 1.0), &[8, 16]).with_requires_grad();
    let w1 = t32(&dev, &host_data(12, 16 * 32, -0.5, 0.5), &[16, 32]).with_requires_grad();
    let b1 = t32(&dev, &host_data(13, 32, -0.5, 0.5), &[32]).with_requires_grad();
    let w2 = t32(&dev, &host_data(14, 32 * 5, -0.5, 0.5), &[32, 5]).with_requires_grad();
    let targets = [0u32, 1, 2, 3, 4, 0, 1, 2];
    let params = [&x, &w1, &b1, &w2];
    let forward = || {
        let h = x
            .matmul_with(
                &w1,
                &MatmulOptions::new().bias(&b1).activation(Activation::Relu),
            )
            .unwrap();
        let h = h.gelu().unwrap().tanh().unwrap().exp().unwrap();
        let h = h.div(&h.sum_axis(1, true).unwrap()).unwrap();
        let logits = h.matmul(&w2).unwrap().softmax().unwrap().log().unwrap();
        let ce = logits.cross_entropy_loss(&targets).unwrap();
        ce.add(&logits.mean().unwrap()).unwrap()
    };
    // Warm up (pipelines), then start from no gradients.
    forward().backward().unwrap();
    params.iter().for_each(|p| p.zero_grad());
    dev.sync().unwrap();
    let before = dev.memory_stats().bytes_in_use;

    // A graph dropped without backward frees everything it saved.
    let loss = forward();
    dev.sync().unwrap();
    let during = dev.memory_stats().bytes_in_use;
    assert!(
        during > before + loss.allocated_bytes(),
        "the graph should hold saved activations: {during} vs {before}"
    );
    drop(loss);
    dev.sync().unwrap();
    assert_eq!(
        dev.memory_stats().bytes_in_use,
        before,
        "a graph dropped without backward leaked memory"
    );

    // After backward, with the loss still alive: only the loss and the gradients are held.
    let loss = forward();
    loss.backward().unwrap();
    dev.sync().unwrap();
    let grads: u64 = params.iter().map(|p| grad_bytes(p)).sum();
    assert!(params.iter().all(|p| p.grad().is_some()));
    assert_eq!(
        dev.memory_stats().bytes_in_use,
        before + loss.allocated_bytes() + grads,
        "after backward, memory beyond the loss and the gradients is still held (saved \
         activations not freed?)"
    );
    drop(loss);
    params.iter().for_each(|p| p.zero_grad());
    dev.sync().unwrap();
    assert_eq!(
        dev.memory_stats().bytes_in_use,
        before,
        "memory did not return to the pre-forward level"
    );
}

#[test]
fn leaf_and_gradient_bookkeeping() {
    let Some(dev) = first_device() else { return };
    let mut x = t32(&dev, &[1.0, 2.0], &[2]);
    assert!(!x.requires_grad());
    x.set_requires_grad(true);
    assert!(x.requires_grad() && x.is_leaf() && x.grad().is_none());
    let y = x.mul_scalar(2.0).unwrap();
    assert!(!y.is_leaf());
    // Gradients of non-leaves are not kept.
    y.sum().unwrap().backward().unwrap();
    assert!(y.grad().is_none());
    approx("x.grad", &grad_vals(&x), &[2.0, 2.0]);
    // set_grad checks the shape and needs a leaf.
    assert_autograd_err(
        x.set_grad(Some(t32(&dev, &[1.0, 2.0, 3.0], &[3]))),
        "set_grad of the wrong shape",
        "",
    );
    assert_autograd_err(
        y.set_grad(Some(t32(&dev, &[1.0, 2.0], &[2]))),
        "set_grad on a non-leaf",
        "leaf",
    );
    x.set_grad(Some(t32(&dev, &[5.0, 6.0], &[2]))).unwrap();
    x.mul_scalar(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    approx("set_grad then backward", &grad_vals(&x), &[7.0, 8.0]);
    // Turning grad off drops the node (and its gradient).
    x.set_requires_grad(false);
    assert!(!x.requires_grad() && x.grad().is_none());
}
