//! The ops around conv2d and the convolutional layers: max / average / adaptive average
//! pooling and flatten, batch norm (training and eval, the running statistics against torch's
//! update rule with the values written out) and group norm, against f64 plain loops in f32 and
//! f16 and finite differences; bitwise repeatability; errors; `nn::Conv2d`, `BatchNorm2d`
//! (buffers in checkpoints, no gradient, eval mode), `GroupNorm`, `MaxPool2d`, `AvgPool2d`.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::*;
use fitgrad::nn::{AvgPool2d, BatchNorm2d, Conv2d, GroupNorm, MaxPool2d, Module};
use fitgrad::{BatchNormOptions, Conv2dOptions, DType, Device, DeviceOptions, Error, Tensor};

device_tests!(
    pools_match_reference,
    norms_match_reference,
    cnn_is_bitwise_repeatable
);

const EPS: f32 = 1e-5;

/// A pooling: Max, Avg (count_include_pad) or Adaptive, on (planes, h, w).
#[derive(Clone, Copy, Debug)]
enum Kind {
    Max,
    Avg(bool),
    Adaptive,
}

#[derive(Clone, Copy, Debug)]
struct PoolCase {
    kind: Kind,
    dims: [usize; 4],
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    /// The adaptive output size.
    out: [usize; 2],
}

impl PoolCase {
    fn out(&self) -> [usize; 2] {
        match self.kind {
            Kind::Adaptive => self.out,
            _ => [0, 1].map(|i| (self.dims[2 + i] + 2 * self.p[i] - self.k[i]) / self.s[i] + 1),
        }
    }

    fn y_dims(&self) -> Vec<usize> {
        let [oh, ow] = self.out();
        vec![self.dims[0], self.dims[1], oh, ow]
    }

    /// Each output's window: (rows, columns, divisor), clipped to the input.
    fn window(&self, oy: usize, ox: usize) -> ([usize; 2], [usize; 2], f64) {
        let [h, w] = [self.dims[2], self.dims[3]];
        if let Kind::Adaptive = self.kind {
            let [oh, ow] = self.out;
            let ys = [oy * h / oh, ((oy + 1) * h).div_ceil(oh)];
            let xs = [ox * w / ow, ((ox + 1) * w).div_ceil(ow)];
            return (ys, xs, ((ys[1] - ys[0]) * (xs[1] - xs[0])) as f64);
        }
        let y0 = (oy * self.s[0]) as i64 - self.p[0] as i64;
        let x0 = (ox * self.s[1]) as i64 - self.p[1] as i64;
        let ys = [
            y0.max(0) as usize,
            ((y0 + self.k[0] as i64) as usize).min(h),
        ];
        let xs = [
            x0.max(0) as usize,
            ((x0 + self.k[1] as i64) as usize).min(w),
        ];
        let div = match self.kind {
            Kind::Avg(false) => ((ys[1] - ys[0]) * (xs[1] - xs[0])) as f64,
            _ => (self.k[0] * self.k[1]) as f64,
        };
        (ys, xs, div)
    }

    /// The forward in f64, and per output the input index its gradient goes to with its
    /// weight: [(input, weight)].
    fn reference(&self, x: &[f64]) -> (Vec<f64>, Vec<Vec<(usize, f64)>>) {
        let [oh, ow] = self.out();
        let (h, w) = (self.dims[2], self.dims[3]);
        let mut y = Vec::new();
        let mut route = Vec::new();
        for plane in 0..self.dims[0] * self.dims[1] {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (ys, xs, div) = self.window(oy, ox);
                    let idx: Vec<usize> = (ys[0]..ys[1])
                        .flat_map(|iy| (xs[0]..xs[1]).map(move |ix| (plane * h + iy) * w + ix))
                        .collect();
                    if let Kind::Max = self.kind {
                        // The first largest, rows then columns.
                        let best =
                            idx.iter()
                                .copied()
                                .fold(idx[0], |b, i| if x[i] > x[b] { i } else { b });
                        y.push(x[best]);
                        route.push(vec![(best, 1.0)]);
                    } else {
                        y.push(idx.iter().map(|&i| x[i]).sum::<f64>() / div);
                        route.push(idx.iter().map(|&i| (i, 1.0 / div)).collect());
                    }
                }
            }
        }
        (y, route)
    }

    fn run(&self, x: &Tensor) -> fitgrad::Result<Tensor> {
        match self.kind {
            Kind::Max => x.max_pool2d(self.k, self.s, self.p),
            Kind::Avg(inc) => x.avg_pool2d(self.k, self.s, self.p, inc),
            Kind::Adaptive => x.adaptive_avg_pool2d(self.out),
        }
    }
}

fn pool(kind: Kind, dims: [usize; 4], k: usize, s: usize, p: usize) -> PoolCase {
    PoolCase {
        kind,
        dims,
        k: [k, k],
        s: [s, s],
        p: [p, p],
        out: [1, 1],
    }
}

fn adaptive(dims: [usize; 4], out: [usize; 2]) -> PoolCase {
    PoolCase {
        kind: Kind::Adaptive,
        dims,
        k: [1, 1],
        s: [1, 1],
        p: [0, 0],
        out,
    }
}

fn pool_cases() -> Vec<PoolCase> {
    let mut rect = pool(Kind::Max, [1, 2, 7, 6], 3, 2, 1);
    rect.k = [3, 2];
    rect.s = [1, 2];
    rect.p = [1, 0];
    vec![
        pool(Kind::Max, [2, 3, 8, 8], 2, 2, 0),
        pool(Kind::Max, [1, 2, 7, 9], 3, 2, 1),
        pool(Kind::Max, [2, 1, 5, 5], 3, 1, 1),
        rect,
        pool(Kind::Avg(true), [2, 3, 7, 7], 3, 2, 1),
        pool(Kind::Avg(false), [1, 2, 6, 5], 3, 2, 1),
        pool(Kind::Avg(true), [1, 1, 4, 4], 2, 2, 0),
        adaptive([2, 3, 7, 5], [1, 1]),
        adaptive([1, 2, 7, 5], [3, 2]),
        adaptive([1, 1, 3, 3], [5, 4]),
        pool(Kind::Max, [0, 3, 4, 4], 2, 2, 0),
    ]
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn tol(dtype: DType, want: f32) -> f32 {
    match dtype {
        DType::F32 => 1e-6 + 2e-6 * want.abs(),
        DType::F16 => 1e-5 + 2.0 * f16_ulp(want),
    }
}

fn check_pool(dev: &Device, dtype: DType, case: &PoolCase, seed: u64) -> Result<(), String> {
    let what = format!("{case:?} {dtype} on {}", label(dev));
    let yd = case.y_dims();
    let x_host = as_dtype(&host_data(seed, numel(&case.dims), -2.0, 2.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 1, numel(&yd), -1.0, 1.0), dtype);
    let x = upload(dev, &x_host, &case.dims, dtype).with_requires_grad();
    let y = case.run(&x).map_err(|e| format!("{what}: {e}"))?;
    let (want, route) = case.reference(&f64s(&x_host));
    let got = download(&y, &yd, dtype)?;
    let want = expect_in(f32s(&want), dtype);
    check_close_by(&format!("{what}: y"), &got, &want, |i| tol(dtype, want[i]))?;
    y.backward_with(upload(dev, &g_host, &yd, dtype))
        .map_err(|e| format!("{what}: {e}"))?;
    let mut dx = vec![0.0f64; x_host.len()];
    for (o, r) in route.iter().enumerate() {
        for &(i, wt) in r {
            dx[i] += g_host[o] as f64 * wt;
        }
    }
    let want = expect_in(f32s(&dx), dtype);
    let got = download(&x.grad().ok_or("no gradient")?, &case.dims, dtype)?;
    check_close_by(&format!("{what}: dx"), &got, &want, |i| tol(dtype, want[i]))
}

fn pools_match_reference(dev: &Device) {
    for &dtype in dtypes(dev) {
        for (k, case) in pool_cases().iter().enumerate() {
            check_pool(dev, dtype, case, 40 + k as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    // flatten: (N, C, H, W) from dim 1 is (N, C H W), the same elements.
    let x = upload(dev, &host_data(1, 60, -1.0, 1.0), &[2, 3, 2, 5], DType::F32);
    let f = x.flatten(1).unwrap();
    assert_eq!(f.dims(), [2, 30]);
    assert_eq!(f.to_vec_f32().unwrap(), x.to_vec_f32().unwrap());
    assert_eq!(x.flatten(0).unwrap().dims(), [60]);
    assert_eq!(x.flatten(3).unwrap().dims(), [2, 3, 2, 5]);
}

/// Per channel of x (N, C, HW): mean and biased variance.
fn channel_stats(x: &[f64], [n, c, hw]: [usize; 3]) -> Vec<(f64, f64)> {
    (0..c)
        .map(|ch| {
            let v: Vec<f64> = (0..n)
                .flat_map(|s| (0..hw).map(move |i| (s * c + ch) * hw + i))
                .map(|i| x[i])
                .collect();
            let m = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / v.len() as f64;
            (m, var)
        })
        .collect()
}

/// Batch norm in training, f64: y = (x - mean) / sqrt(var + eps) w + b per channel.
fn ref_batch_norm(x: &[f64], w: &[f64], b: &[f64], dims: [usize; 3]) -> Vec<f64> {
    let st = channel_stats(x, dims);
    let [_, c, hw] = dims;
    x.iter()
        .enumerate()
        .map(|(i, v)| {
            let ch = (i / hw) % c;
            let (m, var) = st[ch];
            (v - m) / (var + EPS as f64).sqrt() * w[ch] + b[ch]
        })
        .collect()
}

/// Group norm, f64: each sample's groups of C / g channels normalized together.
fn ref_group_norm(x: &[f64], w: &[f64], b: &[f64], [n, c, hw]: [usize; 3], g: usize) -> Vec<f64> {
    let len = c / g * hw;
    let mut y = vec![0.0; x.len()];
    for row in 0..n * g {
        let r = &x[row * len..(row + 1) * len];
        let m = r.iter().sum::<f64>() / len as f64;
        let var = r.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / len as f64;
        for (j, v) in r.iter().enumerate() {
            let ch = (row % g) * (c / g) + j / hw;
            y[row * len + j] = (v - m) / (var + EPS as f64).sqrt() * w[ch] + b[ch];
        }
    }
    y
}

/// Batch norm and group norm forward and backward against the references: the forward
/// directly, the gradients through an f64 central difference of sum(y g) (a smooth function,
/// computed here in the test on the same f64 references).
fn norms_match_reference(dev: &Device) {
    let cases: &[&[usize]] = &[
        &[2, 3, 4, 5],
        &[4, 6, 3, 3],
        &[3, 4],
        &[1, 2, 7, 9],
        &[16, 2, 20, 20],
    ];
    for &dtype in dtypes(dev) {
        for (k, dims) in cases.iter().enumerate() {
            let [n, c] = [dims[0], dims[1]];
            let hw: usize = dims[2..].iter().product();
            let d3 = [n, c, hw];
            let seed = 60 + k as u64;
            let x_host = as_dtype(&host_data(seed, numel(dims), -2.0, 3.0), dtype);
            let w_host = as_dtype(&host_data(seed ^ 1, c, 0.5, 2.0), dtype);
            let b_host = as_dtype(&host_data(seed ^ 2, c, -1.0, 1.0), dtype);
            let (x64, w64, b64) = (f64s(&x_host), f64s(&w_host), f64s(&b_host));
            let what = format!("{dims:?} {dtype} on {}", label(dev));
            let w = upload(dev, &w_host, &[c], dtype);
            let b = upload(dev, &b_host, &[c], dtype);
            let x = upload(dev, &x_host, dims, dtype);
            let y = x
                .batch_norm(&BatchNormOptions {
                    weight: Some(&w),
                    bias: Some(&b),
                    ..Default::default()
                })
                .unwrap();
            let want = expect_in(f32s(&ref_batch_norm(&x64, &w64, &b64, d3)), dtype);
            let got = download(&y, dims, dtype).unwrap();
            check_close_by(&format!("batch_norm {what}"), &got, &want, |i| {
                tol(dtype, want[i]) + 1e-5 * (1.0 + want[i].abs())
            })
            .unwrap_or_else(|e| panic!("{e}"));
            let g = if c % 2 == 0 { 2 } else { 1 };
            let y = x.group_norm(g, Some(&w), Some(&b), EPS).unwrap();
            let want = expect_in(f32s(&ref_group_norm(&x64, &w64, &b64, d3, g)), dtype);
            let got = download(&y, dims, dtype).unwrap();
            // Composed in f16, group norm rounds three times (the normalized value, times the
            // weight, plus the bias): the roundings are those of |xhat w| <= |y| + |b|.
            check_close_by(&format!("group_norm {what}"), &got, &want, |i| {
                let mag = want[i].abs() + 2.0 * b_host[(i / hw) % c].abs();
                let rounding = if dtype == DType::F16 {
                    3.0 * f16_ulp(mag)
                } else {
                    0.0
                };
                tol(dtype, want[i]) + 1e-5 * (1.0 + want[i].abs()) + rounding
            })
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Every backward rule against central differences of the f64 references (f32).
#[test]
fn cnn_gradients_match_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for (k, case) in [
        pool(Kind::Max, [1, 2, 5, 6], 3, 2, 1),
        pool(Kind::Avg(false), [2, 1, 5, 5], 3, 2, 1),
        pool(Kind::Avg(true), [1, 2, 4, 5], 2, 1, 1),
        adaptive([1, 2, 5, 7], [2, 3]),
    ]
    .iter()
    .enumerate()
    {
        let c = *case;
        check_grads(
            &dev,
            &format!("{c:?}"),
            &[input(
                host_data(70 + k as u64, numel(&c.dims), -1.0, 1.0),
                &c.dims,
                true,
            )],
            70 + k as u64,
            &|t| c.run(&t[0]),
            &|v| c.reference(&v[0]).0,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    for (k, dims) in [[3usize, 2, 2, 3], [2, 4, 3, 1]].iter().enumerate() {
        let d3 = [dims[0], dims[1], dims[2] * dims[3]];
        let c = dims[1];
        let seed = 80 + k as u64;
        let inputs = [
            input(host_data(seed, numel(dims), -1.0, 1.0), dims, true),
            input(host_data(seed ^ 1, c, 0.5, 2.0), &[c], true),
            input(host_data(seed ^ 2, c, -1.0, 1.0), &[c], true),
        ];
        check_grads(
            &dev,
            &format!("batch_norm {dims:?}"),
            &inputs,
            seed,
            &|t| {
                t[0].batch_norm(&BatchNormOptions {
                    weight: Some(&t[1]),
                    bias: Some(&t[2]),
                    ..Default::default()
                })
            },
            &|v| ref_batch_norm(&v[0], &v[1], &v[2], d3),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        check_grads(
            &dev,
            &format!("group_norm {dims:?}"),
            &inputs,
            seed,
            &|t| t[0].group_norm(2, Some(&t[1]), Some(&t[2]), EPS),
            &|v| ref_group_norm(&v[0], &v[1], &v[2], d3, 2),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The running statistics after three training steps equal torch's rule, written out:
/// mean <- 0.9 mean + 0.1 batch mean, var <- 0.9 var + 0.1 unbiased batch variance, from 0 and
/// 1; eval mode then normalizes with them.
#[test]
fn batch_norm_running_statistics_follow_torch() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    // x (2, 2, 1, 2): channel 0 holds 1, 3, 5, 7 (mean 4, unbiased variance 20 / 3), channel 1
    // holds 0, 4, 2, 2 (mean 2, unbiased variance 8 / 3).
    let x_host = [1.0f32, 3.0, 0.0, 4.0, 5.0, 7.0, 2.0, 2.0];
    let x = Tensor::from_slice(&dev, &x_host, &[2, 2, 1, 2]).unwrap();
    let x1 = x.add_scalar(1.0).unwrap();
    let bn = BatchNorm2d::new(&dev, 2).unwrap();
    for batch in [&x, &x, &x1] {
        bn.forward(batch).unwrap();
    }
    // Step 1: 0.1 * 4 = 0.4, 0.9 + 0.1 * 20/3 = 1.566667; step 2 the same batch again;
    // step 3 with the means one higher (5 and 3), the variances unchanged.
    let mean: [f64; 2] = [0.9 * (0.9 * 0.4 + 0.4) + 0.5, 0.9 * (0.9 * 0.2 + 0.2) + 0.3];
    let var = [
        0.9 * (0.9 * (0.9 + 2.0 / 3.0) + 2.0 / 3.0) + 2.0 / 3.0,
        0.9 * (0.9 * (0.9 + 0.8 / 3.0) + 0.8 / 3.0) + 0.8 / 3.0,
    ];
    assert!((mean[0] - 1.184).abs() < 1e-12 && (mean[1] - 0.642).abs() < 1e-12);
    let got_m = bn.running_mean.to_vec_f32().unwrap();
    let got_v = bn.running_var.to_vec_f32().unwrap();
    for ch in 0..2 {
        assert!(
            (got_m[ch] as f64 - mean[ch]).abs() < 1e-6,
            "{got_m:?} vs {mean:?}"
        );
        assert!(
            (got_v[ch] as f64 - var[ch]).abs() < 1e-6,
            "{got_v:?} vs {var:?}"
        );
    }
    assert!((var[0] - 2.535667).abs() < 1e-6 && (var[1] - 1.451667).abs() < 1e-6);
    // Eval: (x - running mean) / sqrt(running var + eps) (weight 1, bias 0); no update.
    bn.set_training(false);
    let y = bn.forward(&x).unwrap().to_vec_f32().unwrap();
    for (i, &v) in x_host.iter().enumerate() {
        let ch = (i / 2) % 2;
        let want = (v as f64 - mean[ch]) / (var[ch] + EPS as f64).sqrt();
        assert!(
            (y[i] as f64 - want).abs() < 1e-5,
            "eval {i}: {} vs {want}",
            y[i]
        );
    }
    assert_eq!(bn.running_mean.to_vec_f32().unwrap(), got_m);
    // Buffers are named, saved beside the parameters, and get no gradient.
    let names: Vec<String> = bn.named_buffers().into_iter().map(|b| b.0).collect();
    assert_eq!(names, ["running_mean", "running_var"]);
    assert!(!bn.running_mean.requires_grad());
    bn.set_training(true);
    bn.forward(&x).unwrap().sum().unwrap().backward().unwrap();
    assert!(bn.running_mean.grad().is_none() && bn.weight.grad().is_some());
}

/// The same forward and backward twice give the same bits (pools, batch norm, group norm).
fn cnn_is_bitwise_repeatable(dev: &Device) {
    let dims = [4, 6, 9, 11];
    for &dtype in dtypes(dev) {
        let x_host = host_data(5, numel(&dims), -2.0, 2.0);
        let run = || {
            let x = upload(dev, &x_host, &dims, dtype).with_requires_grad();
            let bn = x.batch_norm(&BatchNormOptions::default()).unwrap();
            let gn = bn.group_norm(3, None, None, EPS).unwrap();
            let y = gn
                .max_pool2d([3, 3], [2, 2], [1, 1])
                .unwrap()
                .avg_pool2d([2, 2], [1, 1], [0, 0], true)
                .unwrap()
                .global_avg_pool2d()
                .unwrap();
            y.to_dtype(DType::F32)
                .unwrap()
                .sum()
                .unwrap()
                .backward()
                .unwrap();
            [y.to_vec_f32(), x.grad().unwrap().to_vec_f32()]
                .map(|v| v.unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        assert_eq!(run(), run(), "{dtype} on {}", label(dev));
    }
}

/// Bad shapes and arguments are typed errors, raised before anything is allocated.
#[test]
fn cnn_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let t = |dims: &[usize]| Tensor::zeros(&dev, dims, DType::F32).unwrap();
    let (x, x3, one) = (t(&[2, 4, 5, 5]), t(&[4, 5, 5]), t(&[1, 4, 1, 1]));
    let (c3, c4) = (t(&[3]), t(&[4]));
    let h4 = Tensor::zeros(&dev, &[4], DType::F16).unwrap();
    let before = dev.memory_stats().allocations;
    let shape = |r: fitgrad::Result<Tensor>| matches!(r, Err(Error::Shape { .. }));
    let invalid = |r: fitgrad::Result<Tensor>| matches!(r, Err(Error::InvalidArgument { .. }));
    assert!(shape(x3.max_pool2d([2, 2], [2, 2], [0, 0])));
    assert!(shape(x.max_pool2d([7, 7], [1, 1], [0, 0])));
    assert!(invalid(x.max_pool2d([0, 2], [1, 1], [0, 0])));
    assert!(invalid(x.avg_pool2d([2, 2], [0, 1], [0, 0], true)));
    assert!(invalid(x.avg_pool2d([3, 3], [1, 1], [2, 2], true)));
    assert!(invalid(x.adaptive_avg_pool2d([0, 1])));
    assert!(invalid(x.flatten(4)));
    let bn = |o: BatchNormOptions| x.batch_norm(&o);
    assert!(shape(bn(BatchNormOptions {
        weight: Some(&c3),
        ..Default::default()
    })));
    assert!(matches!(
        bn(BatchNormOptions {
            bias: Some(&h4),
            ..Default::default()
        }),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        bn(BatchNormOptions {
            running: Some((&c4, &h4)),
            ..Default::default()
        }),
        Err(Error::DType { .. })
    ));
    assert!(invalid(bn(BatchNormOptions {
        training: false,
        ..Default::default()
    })));
    assert!(invalid(bn(BatchNormOptions {
        momentum: 1.5,
        ..Default::default()
    })));
    assert!(shape(one.batch_norm(&BatchNormOptions::default())));
    assert!(shape(x.group_norm(3, None, None, EPS)));
    assert!(shape(x.group_norm(0, None, None, EPS)));
    assert!(shape(x.group_norm(2, Some(&c3), None, EPS)));
    assert!(invalid(x.group_norm(2, None, None, -1.0)));
    assert_eq!(dev.memory_stats().allocations, before);
    assert!(Conv2d::new(&dev, 4, 6, 3, Conv2dOptions::new().groups(4), true, 0).is_err());
    assert!(GroupNorm::new(&dev, 3, 4).is_err());
    assert!(BatchNorm2d::new(&dev, 0).is_err());
}

/// The layers: the functional ops' bits, parameter names, mixed precision (f32 parameters,
/// f16 input), BatchNorm2d's buffers through a checkpoint.
#[test]
fn cnn_layers() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let conv = Conv2d::new(&dev, 3, 4, 3, Conv2dOptions::new().padding(1), true, 7).unwrap();
    let names: Vec<String> = conv.named_parameters().into_iter().map(|p| p.0).collect();
    assert_eq!(names, ["weight", "bias"]);
    assert_eq!(conv.weight.dims(), [4, 3, 3, 3]);
    let x = upload(
        &dev,
        &host_data(1, 2 * 3 * 6 * 6, -1.0, 1.0),
        &[2, 3, 6, 6],
        DType::F32,
    );
    let y = conv.forward(&x).unwrap();
    let f = x
        .conv2d(&conv.weight, conv.bias.as_ref(), &conv.options)
        .unwrap();
    assert_eq!(y.to_vec_f32().unwrap(), f.to_vec_f32().unwrap());
    let gn = GroupNorm::new(&dev, 2, 4).unwrap();
    let bn = BatchNorm2d::new(&dev, 4).unwrap();
    let y = MaxPool2d {
        kernel: 2,
        stride: 2,
        padding: 0,
    }
    .forward(&bn.forward(&gn.forward(&y).unwrap()).unwrap())
    .unwrap();
    assert_eq!(y.dims(), [2, 4, 3, 3]);
    let y = AvgPool2d::global().forward(&y).unwrap();
    assert_eq!(y.dims(), [2, 4, 1, 1]);
    // Mixed precision: an f16 input through f32 parameters gives f16, gradients in f32.
    let xh = x.to_dtype(DType::F16).unwrap();
    let yh = bn.forward(&conv.forward(&xh).unwrap()).unwrap();
    assert_eq!(yh.dtype(), DType::F16);
    yh.to_dtype(DType::F32)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(conv.weight.grad().unwrap().dtype(), DType::F32);
    assert_eq!(bn.weight.grad().unwrap().dtype(), DType::F32);
    // The running statistics go through a checkpoint with the parameters.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bn.safetensors");
    let state = fitgrad::checkpoint::TrainingState::default();
    fitgrad::checkpoint::save(&path, &bn, None, &state).unwrap();
    let fresh = BatchNorm2d::new(&dev, 4).unwrap();
    assert_ne!(
        fresh.running_mean.to_vec_f32().unwrap(),
        bn.running_mean.to_vec_f32().unwrap()
    );
    fitgrad::checkpoint::load(&path)
        .unwrap()
        .apply_model(&fresh)
        .unwrap();
    assert_eq!(
        fresh.running_mean.to_vec_f32().unwrap(),
        bn.running_mean.to_vec_f32().unwrap()
    );
    assert_eq!(
        fresh.running_var.to_vec_f32().unwrap(),
        bn.running_var.to_vec_f32().unwrap()
    );
}

/// Group norm does not mix samples: the gradients of two micro-batches added up equal the
/// whole batch's up to rounding (conv -> group norm -> relu -> global pool).
#[test]
fn group_norm_micro_batches_match_the_whole_batch() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let x_host = host_data(3, 4 * 2 * 6 * 6, -1.0, 1.0);
    let g_host = host_data(4, 4 * 4, -1.0, 1.0);
    let conv = Conv2d::new(&dev, 2, 4, 3, Conv2dOptions::new().padding(1), true, 9).unwrap();
    let gn = GroupNorm::new(&dev, 2, 4).unwrap();
    let grads = |parts: &[(usize, usize)]| {
        conv.zero_grad();
        gn.zero_grad();
        for &(a, b) in parts {
            let x = upload(&dev, &x_host[a * 72..b * 72], &[b - a, 2, 6, 6], DType::F32);
            let g = upload(&dev, &g_host[a * 4..b * 4], &[b - a, 4, 1, 1], DType::F32);
            let y = gn
                .forward(&conv.forward(&x).unwrap())
                .unwrap()
                .relu()
                .unwrap();
            let y = y.global_avg_pool2d().unwrap();
            y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        }
        [
            &conv.weight,
            conv.bias.as_ref().unwrap(),
            &gn.weight,
            &gn.bias,
        ]
        .map(|t| t.grad().unwrap().to_vec_f32().unwrap())
    };
    let whole = grads(&[(0, 4)]);
    let split = grads(&[(0, 1), (1, 4)]);
    for (k, (a, b)) in whole.iter().zip(&split).enumerate() {
        let m = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d / m < 1e-5, "gradient {k}: {d} of {m}\n{a:?}\n{b:?}");
    }
}
