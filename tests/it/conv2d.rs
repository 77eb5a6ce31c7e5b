//! conv2d and its backward (input, weight and bias gradients) against an f64 plain-loop
//! reference on every device in f32 and f16: fixed shapes for every edge (1x1 through the
//! matmul and strided through the kernel, 7x7, stride 2, dilation 2, depthwise, groups, odd
//! sizes, padding past half the kernel, asymmetric options, batch 1, an empty batch, several
//! weight-gradient chunks) and random ones; finite differences for every backward rule; bitwise
//! repeatability; the peak in use against inputs + outputs + weights + gradients (no column
//! buffer); the errors, before any device work.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::*;
use fitgrad::{Conv2dOptions, DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    conv2d_fixed_shapes,
    conv2d_matches_reference,
    conv2d_is_bitwise_repeatable
);

/// One convolution's sizes: x (n, c, h, w), weight (oc, c / g, kh, kw).
#[derive(Clone, Copy, Debug)]
struct Conv {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    oc: usize,
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    d: [usize; 2],
    g: usize,
    bias: bool,
}

#[allow(clippy::too_many_arguments)]
fn conv(
    n: usize,
    c: usize,
    hw: [usize; 2],
    oc: usize,
    k: [usize; 2],
    s: usize,
    p: usize,
    d: usize,
    g: usize,
    bias: bool,
) -> Conv {
    Conv {
        n,
        c,
        h: hw[0],
        w: hw[1],
        oc,
        k,
        s: [s, s],
        p: [p, p],
        d: [d, d],
        g,
        bias,
    }
}

impl Conv {
    fn out(&self) -> [usize; 2] {
        let o = |i: usize, size: usize| {
            (size + 2 * self.p[i] - self.d[i] * (self.k[i] - 1) - 1) / self.s[i] + 1
        };
        [o(0, self.h), o(1, self.w)]
    }
    fn x_dims(&self) -> Vec<usize> {
        vec![self.n, self.c, self.h, self.w]
    }
    fn w_dims(&self) -> Vec<usize> {
        vec![self.oc, self.c / self.g, self.k[0], self.k[1]]
    }
    fn y_dims(&self) -> Vec<usize> {
        let [oh, ow] = self.out();
        vec![self.n, self.oc, oh, ow]
    }
    fn opts(&self) -> Conv2dOptions {
        Conv2dOptions {
            stride: self.s,
            padding: self.p,
            dilation: self.d,
            groups: self.g,
        }
    }

    /// Every (output index, input index, weight index) product of the convolution, in a plain
    /// loop: the forward, both gradients and their tolerances are sums over these.
    fn taps(&self, mut f: impl FnMut(usize, usize, usize)) {
        let [oh, ow] = self.out();
        let (cg, ocg) = (self.c / self.g, self.oc / self.g);
        for n in 0..self.n {
            for o in 0..self.oc {
                let grp = o / ocg;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let yi = ((n * self.oc + o) * oh + oy) * ow + ox;
                        for ci in 0..cg {
                            for ky in 0..self.k[0] {
                                for kx in 0..self.k[1] {
                                    let iy =
                                        (oy * self.s[0] + ky * self.d[0]) as i64 - self.p[0] as i64;
                                    let ix =
                                        (ox * self.s[1] + kx * self.d[1]) as i64 - self.p[1] as i64;
                                    if iy < 0
                                        || ix < 0
                                        || iy >= self.h as i64
                                        || ix >= self.w as i64
                                    {
                                        continue;
                                    }
                                    let c = grp * cg + ci;
                                    let xi = ((n * self.c + c) * self.h + iy as usize) * self.w
                                        + ix as usize;
                                    let wi = ((o * cg + ci) * self.k[0] + ky) * self.k[1] + kx;
                                    f(yi, xi, wi);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// y = conv(x, w) + b in f64.
    fn forward(&self, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
        let plane = self.y_dims()[2] * self.y_dims()[3];
        let mut y: Vec<f64> = (0..numel(&self.y_dims()))
            .map(|i| b.map_or(0.0, |b| b[(i / plane) % self.oc]))
            .collect();
        self.taps(|yi, xi, wi| y[yi] += x[xi] * w[wi]);
        y
    }
}

/// The reference's values and, per element, the sum of its terms' magnitudes (the scale of
/// the f32 accumulation's rounding).
struct Ref {
    y: Vec<f64>,
    y_abs: Vec<f64>,
    dx: Vec<f64>,
    dx_abs: Vec<f64>,
    dw: Vec<f64>,
    dw_abs: Vec<f64>,
    db: Vec<f64>,
    db_abs: Vec<f64>,
}

fn reference(cv: &Conv, x: &[f64], w: &[f64], b: &[f64], g: &[f64]) -> Ref {
    let ny = numel(&cv.y_dims());
    let plane = cv.y_dims()[2] * cv.y_dims()[3];
    let mut r = Ref {
        y: cv.forward(x, w, cv.bias.then_some(b)),
        y_abs: (0..ny)
            .map(|i| {
                if cv.bias {
                    b[(i / plane) % cv.oc].abs()
                } else {
                    0.0
                }
            })
            .collect(),
        dx: vec![0.0; x.len()],
        dx_abs: vec![0.0; x.len()],
        dw: vec![0.0; w.len()],
        dw_abs: vec![0.0; w.len()],
        db: vec![0.0; cv.oc],
        db_abs: vec![0.0; cv.oc],
    };
    cv.taps(|yi, xi, wi| {
        r.y_abs[yi] += (x[xi] * w[wi]).abs();
        r.dx[xi] += g[yi] * w[wi];
        r.dx_abs[xi] += (g[yi] * w[wi]).abs();
        r.dw[wi] += g[yi] * x[xi];
        r.dw_abs[wi] += (g[yi] * x[xi]).abs();
    });
    for (i, &gv) in g.iter().enumerate() {
        r.db[(i / plane.max(1)) % cv.oc] += gv;
        r.db_abs[(i / plane.max(1)) % cv.oc] += gv.abs();
    }
    r
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Tolerance of a sum `want` in `dtype` whose terms' magnitudes add to `abs`: the f32
/// accumulation's rounding, and for f16 two ulps of the stored result.
fn tol(dtype: DType, want: f32, abs: f64) -> f32 {
    let acc = 1e-6 + 2e-6 * abs as f32;
    match dtype {
        DType::F32 => acc,
        DType::F16 => acc + 2.0 * f16_ulp(want),
    }
}

/// Forward and every gradient of one case against the reference.
fn check(dev: &Device, dtype: DType, cv: &Conv, seed: u64) -> Result<(), String> {
    let what = format!("conv2d {cv:?} {dtype} on {}", label(dev));
    let (xd, wd, yd) = (cv.x_dims(), cv.w_dims(), cv.y_dims());
    let x_host = as_dtype(&host_data(seed, numel(&xd), -2.0, 2.0), dtype);
    let w_host = as_dtype(&host_data(seed ^ 1, numel(&wd), -1.0, 1.0), dtype);
    let b_host = as_dtype(&host_data(seed ^ 2, cv.oc, -1.0, 1.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 3, numel(&yd), -1.0, 1.0), dtype);
    let x = upload(dev, &x_host, &xd, dtype).with_requires_grad();
    let w = upload(dev, &w_host, &wd, dtype).with_requires_grad();
    let b = cv
        .bias
        .then(|| upload(dev, &b_host, &[cv.oc], dtype).with_requires_grad());
    let y = x
        .conv2d(&w, b.as_ref(), &cv.opts())
        .map_err(|e| format!("{what}: {e}"))?;
    if y.dims() != yd {
        return Err(format!(
            "{what}: output dims {:?}, expected {yd:?}",
            y.dims()
        ));
    }
    let r = reference(
        cv,
        &f64s(&x_host),
        &f64s(&w_host),
        &f64s(&b_host),
        &f64s(&g_host),
    );
    let compare = |name: &str, t: &Tensor, dims: &[usize], want: &[f64], abs: &[f64]| {
        let got = download(t, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
        let want = expect_in(f32s(want), dtype);
        check_close_by(&format!("{what}: {name}"), &got, &want, |i| {
            tol(dtype, want[i], abs[i])
        })
    };
    compare("y", &y, &yd, &r.y, &r.y_abs)?;
    y.backward_with(upload(dev, &g_host, &yd, dtype))
        .map_err(|e| format!("{what}: backward: {e}"))?;
    let grad = |t: &Tensor| t.grad().ok_or(format!("{what}: no gradient"));
    compare("dx", &grad(&x)?, &xd, &r.dx, &r.dx_abs)?;
    compare("dw", &grad(&w)?, &wd, &r.dw, &r.dw_abs)?;
    if let Some(b) = &b {
        compare("db", &grad(b)?, &[cv.oc], &r.db, &r.db_abs)?;
    }
    Ok(())
}

/// The shapes every kernel path must get right.
fn fixed_cases() -> Vec<Conv> {
    let mut asym = conv(2, 2, [5, 7], 3, [3, 2], 1, 0, 1, 1, true);
    asym.s = [2, 1];
    asym.p = [0, 1];
    asym.d = [1, 2];
    vec![
        // 3x3, odd sizes, output channels not a multiple of the tile.
        conv(2, 3, [7, 6], 5, [3, 3], 1, 1, 1, 1, true),
        // 7x7, batch 1, an odd output plane (packed f16 goes through f32).
        conv(1, 2, [9, 9], 3, [7, 7], 1, 3, 1, 1, false),
        // Stride 2.
        conv(2, 4, [8, 7], 6, [3, 3], 2, 1, 1, 1, true),
        // Dilation 2.
        conv(1, 3, [9, 8], 4, [3, 3], 1, 2, 2, 1, true),
        // Depthwise (groups = channels).
        conv(2, 6, [5, 5], 6, [3, 3], 1, 1, 1, 6, true),
        // Padding past half the kernel, two groups.
        conv(1, 4, [5, 6], 8, [3, 3], 1, 3, 1, 2, false),
        // 1x1 as a matmul, and strided 1x1 through the kernel.
        conv(3, 5, [4, 4], 7, [1, 1], 1, 0, 1, 1, true),
        conv(2, 3, [6, 5], 4, [1, 1], 2, 0, 1, 1, false),
        // One of everything, asymmetric options.
        conv(1, 1, [1, 1], 1, [1, 1], 1, 0, 1, 1, true),
        asym,
        // An empty batch.
        conv(0, 3, [4, 4], 2, [3, 3], 1, 1, 1, 1, true),
        // 288 positions: the weight gradient in several chunks.
        conv(2, 3, [12, 12], 8, [3, 3], 1, 1, 1, 1, true),
        // The weight gradient's lanes spanning chunks: one input channel (3 blocks of weight
        // columns, each lane its own chunk, 8 chunks); 32 channels 1x1 stride 2 and 16 channels
        // 3x3 (8 lanes of columns per chunk, fewer chunks than a workgroup has room for).
        conv(2, 1, [16, 16], 4, [3, 3], 1, 1, 1, 1, false),
        conv(4, 32, [12, 12], 4, [1, 1], 2, 0, 1, 1, false),
        conv(2, 16, [10, 10], 8, [3, 3], 1, 1, 1, 1, true),
        // 32-row tiles: 62 output channels (the forward's and the weight gradient's second
        // block two rows short), stride 2; 64 input channels (the input gradient's).
        conv(2, 34, [6, 5], 62, [3, 3], 2, 1, 1, 1, true),
        conv(1, 64, [5, 5], 8, [3, 3], 1, 1, 1, 1, false),
    ]
}

fn conv2d_fixed_shapes(dev: &Device) {
    for &dtype in dtypes(dev) {
        for (k, cv) in fixed_cases().iter().enumerate() {
            check(dev, dtype, cv, 10 + k as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn conv2d_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(4), |(
        n in 1usize..3,
        cg in 1usize..4,
        ocg in 1usize..6,
        g in prop::sample::select(vec![1usize, 1, 2, 3]),
        h in 1usize..10,
        w in 1usize..10,
        k in prop::sample::select(vec![[1usize, 1], [3, 3], [2, 3], [5, 5]]),
        s in 1usize..3,
        p in 0usize..4,
        d in 1usize..3,
        bias in any::<bool>(),
        f16 in any::<bool>(),
        seed in any::<u64>(),
    )| {
        let cv = conv(n, cg * g, [h, w], ocg * g, k, s, p, d, g, bias);
        // Kernels larger than the padded input have no output: an error, tested apart.
        prop_assume!(h + 2 * p > d * (k[0] - 1) && w + 2 * p > d * (k[1] - 1));
        check(dev, dtype_for(dev, f16), &cv, seed).map_err(TestCaseError::fail)?;
    });
}

/// The same forward and backward twice give the same bits (several weight-gradient chunks).
fn conv2d_is_bitwise_repeatable(dev: &Device) {
    let cv = conv(4, 4, [13, 11], 6, [3, 3], 1, 1, 1, 2, true);
    for &dtype in dtypes(dev) {
        let x_host = host_data(1, numel(&cv.x_dims()), -2.0, 2.0);
        let w_host = host_data(2, numel(&cv.w_dims()), -1.0, 1.0);
        let g_host = host_data(3, numel(&cv.y_dims()), -1.0, 1.0);
        let run = || {
            let x = upload(dev, &x_host, &cv.x_dims(), dtype).with_requires_grad();
            let w = upload(dev, &w_host, &cv.w_dims(), dtype).with_requires_grad();
            let b = Tensor::full(dev, &[cv.oc], 0.25, dtype)
                .unwrap()
                .with_requires_grad();
            let y = x.conv2d(&w, Some(&b), &cv.opts()).unwrap();
            y.backward_with(upload(dev, &g_host, &cv.y_dims(), dtype))
                .unwrap();
            [
                y.to_vec_f32(),
                x.grad().unwrap().to_vec_f32(),
                w.grad().unwrap().to_vec_f32(),
                b.grad().unwrap().to_vec_f32(),
            ]
            .map(|v| v.unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        assert_eq!(run(), run(), "conv2d {dtype} on {}", label(dev));
    }
}

/// Every backward rule against central differences of the f64 reference (f32).
#[test]
fn conv2d_gradients_match_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let cases = [
        conv(2, 2, [5, 4], 3, [3, 3], 2, 1, 1, 1, true),
        conv(1, 4, [6, 5], 4, [3, 2], 1, 2, 2, 2, true),
        conv(2, 3, [4, 4], 3, [3, 3], 1, 1, 1, 3, true),
        conv(2, 3, [3, 3], 2, [1, 1], 1, 0, 1, 1, true),
    ];
    for (k, cv) in cases.iter().enumerate() {
        let seed = 30 + k as u64;
        let inputs = [
            input(
                host_data(seed, numel(&cv.x_dims()), -1.0, 1.0),
                &cv.x_dims(),
                true,
            ),
            input(
                host_data(seed ^ 1, numel(&cv.w_dims()), -1.0, 1.0),
                &cv.w_dims(),
                true,
            ),
            input(host_data(seed ^ 2, cv.oc, -1.0, 1.0), &[cv.oc], true),
        ];
        let opts = cv.opts();
        check_grads(
            &dev,
            &format!("conv2d {cv:?}"),
            &inputs,
            seed,
            &|t| t[0].conv2d(&t[1], Some(&t[2]), &opts),
            &|v| cv.forward(&v[0], &v[1], Some(&v[2])),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Forward + backward hold at most the inputs, the output, the weights, their gradients and
/// 1 MiB: no column buffer, whose 2.25 MiB alone would pass that.
#[test]
fn conv2d_peak_is_inputs_outputs_and_gradients() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    // x and y are (2, 32, 32, 32) f32, 256 KiB each; the weight 32 x 32 x 3 x 3, 36 KiB.
    let cv = conv(2, 32, [32, 32], 32, [3, 3], 1, 1, 1, 1, true);
    let x = upload(
        &dev,
        &host_data(1, numel(&cv.x_dims()), -1.0, 1.0),
        &cv.x_dims(),
        DType::F32,
    )
    .with_requires_grad();
    let w = upload(
        &dev,
        &host_data(2, numel(&cv.w_dims()), -1.0, 1.0),
        &cv.w_dims(),
        DType::F32,
    )
    .with_requires_grad();
    let b = Tensor::zeros(&dev, &[cv.oc], DType::F32)
        .unwrap()
        .with_requires_grad();
    let g = upload(
        &dev,
        &host_data(3, numel(&cv.y_dims()), -1.0, 1.0),
        &cv.y_dims(),
        DType::F32,
    );
    dev.sync().unwrap();
    let before = dev.memory_stats().bytes_in_use;
    dev.reset_peak();
    let y = x.conv2d(&w, Some(&b), &cv.opts()).unwrap();
    y.backward_with(g.clone()).unwrap();
    dev.sync().unwrap();
    let peak = dev.memory_stats().peak_bytes_in_use - before;
    let bytes = |dims: &[usize]| 4 * numel(dims) as u64;
    // y, and the gradients of x, w and b (the inputs and dy were in use before).
    let new = bytes(&cv.y_dims()) + bytes(&cv.x_dims()) + bytes(&cv.w_dims()) + 4 * 32;
    let [oh, ow] = cv.out();
    let im2col = 4 * (cv.n * oh * ow * cv.c * 9) as u64;
    eprintln!("conv2d peak above the inputs: {peak} bytes; y and gradients {new}; im2col {im2col}");
    assert!(
        peak <= new + (1 << 20),
        "peak {peak} above the inputs, more than y and the gradients ({new}) + 1 MiB"
    );
    assert!(
        im2col > 1 << 20,
        "the shape must make a column buffer visible"
    );
}

/// Bad shapes, groups and options are typed errors, raised before anything is allocated.
#[test]
fn conv2d_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let t = |dims: &[usize]| Tensor::zeros(&dev, dims, DType::F32).unwrap();
    let x = t(&[1, 4, 5, 5]);
    let w = t(&[6, 4, 3, 3]);
    let (x3, w3) = (t(&[4, 5, 5]), t(&[6, 4, 3]));
    let (w_c3, w_g3, w_g2) = (t(&[6, 3, 3, 3]), t(&[6, 1, 3, 3]), t(&[5, 2, 3, 3]));
    let (b5, w7, x2) = (t(&[5]), t(&[6, 4, 7, 7]), t(&[1, 4, 2, 2]));
    let h = Tensor::zeros(&dev, &[6, 4, 3, 3], DType::F16).unwrap();
    let before = dev.memory_stats().allocations;
    let o = Conv2dOptions::new();
    let shape = |r: fitgrad::Result<Tensor>| matches!(r, Err(Error::Shape { .. }));
    // Ranks.
    assert!(shape(x3.conv2d(&w, None, &o)));
    assert!(shape(x.conv2d(&w3, None, &o)));
    // Channels: the weight's second dim, groups not dividing, groups 0.
    assert!(shape(x.conv2d(&w_c3, None, &o)));
    assert!(shape(x.conv2d(&w_g3, None, &o.groups(3))));
    assert!(shape(x.conv2d(&w_g2, None, &o.groups(2))));
    assert!(shape(x.conv2d(&w, None, &o.groups(0))));
    // The bias.
    assert!(shape(x.conv2d(&w, Some(&b5), &o)));
    // An output of size 0: a 7x7 kernel on 5x5, a dilated 3x3 past it, a 2x2 input.
    assert!(shape(x.conv2d(&w7, None, &o)));
    assert!(shape(x.conv2d(&w, None, &o.dilation(3))));
    assert!(shape(x2.conv2d(&w, None, &o)));
    // Stride and dilation 0.
    for bad in [o.stride(0), o.dilation(0)] {
        assert!(matches!(
            x.conv2d(&w, None, &bad),
            Err(Error::InvalidArgument { .. })
        ));
    }
    // Dtypes.
    assert!(matches!(x.conv2d(&h, None, &o), Err(Error::DType { .. })));
    assert_eq!(dev.memory_stats().allocations, before);
    // A valid call right after still works: padding 1 keeps 5x5.
    assert_eq!(
        x.conv2d(&w, None, &o.padding(1)).unwrap().dims(),
        [1, 6, 5, 5]
    );
}
