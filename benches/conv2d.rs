//! conv2d (implicit GEMM) forward and forward + backward at ResNet shapes, f32 and f16, beside
//! the matmul of the same GEMM size (W (OC, C KH KW) times a column matrix (C KH KW, N OH OW),
//! which im2col would have to build), with throughput in FLOPs; before measuring, each shape's
//! peak bytes in use for one forward + backward are printed beside the im2col buffer's bytes.
//! The backward is also measured split: the forward and the input's gradient (`_fwd_dx`), and
//! the forward and the weight's gradient (`_fwd_dw`), each beside the matmul's forward and the
//! same operand's gradient; in f32 also the forward and the weight's gradient with batch-invariant
//! sums (`_fwd_dw_invariant`). `cargo bench --bench conv2d`; `CONV_BENCH_N` sets the batch
//! (default 32, as the ResNet shapes are usually quoted).

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fitgrad::tensor::invariant::set_batch_invariant;
use fitgrad::{Conv2dOptions, DType, Tensor};

/// (name, C, OC, H = W, kernel, stride, padding).
const SHAPES: [(&str, usize, usize, usize, usize, usize, usize); 3] = [
    ("64-64-56-3x3", 64, 64, 56, 3, 1, 1),
    ("128-256-28-3x3s2", 128, 256, 28, 3, 2, 1),
    ("256-256-14-1x1", 256, 256, 14, 1, 1, 0),
];

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    let n: usize = std::env::var("CONV_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let mut g = c.benchmark_group("conv2d");
    g.sample_size(10);
    for &(name, ci, oc, hw, k, s, p) in &SHAPES {
        let o = (hw + 2 * p - k) / s + 1;
        let (gm, gn, gk) = (oc, n * o * o, ci * k * k);
        let opts = Conv2dOptions::new().stride(s).padding(p);
        for dtype in [DType::F32, DType::F16] {
            let x = Tensor::randn(&dev, &[n, ci, hw, hw], 0.0, 1.0, 1, dtype).unwrap();
            let w = Tensor::randn(&dev, &[oc, ci, k, k], 0.0, 0.05, 2, dtype).unwrap();
            // The column matrix the same GEMM reads: im2col's buffer, for the reference only.
            let cols = Tensor::randn(&dev, &[gk, gn], 0.0, 1.0, 3, dtype).unwrap();
            let wm = w.reshape(&[gm, gk]).unwrap();
            let im2col = (gk * gn * dtype.size()) as u64;
            {
                let xg = x.clone().with_requires_grad();
                let wg = w.clone().with_requires_grad();
                dev.sync().unwrap();
                let before = dev.memory_stats().bytes_in_use;
                dev.reset_peak();
                let y = xg.conv2d(&wg, None, &opts).unwrap();
                y.to_dtype(DType::F32)
                    .unwrap()
                    .sum()
                    .unwrap()
                    .backward()
                    .unwrap();
                dev.sync().unwrap();
                let peak = dev.memory_stats().peak_bytes_in_use - before;
                eprintln!(
                    "{name} n={n} {dtype}: forward + backward peak {peak} bytes above the inputs, \
                     im2col buffer {im2col} bytes ({:.2}x the peak)",
                    im2col as f64 / peak as f64
                );
            }
            let id = format!("{name}/n{n}/{dtype}");
            g.throughput(Throughput::Elements((2 * gm * gn * gk) as u64));
            g.bench_function(BenchmarkId::new("conv2d_fwd", &id), |b| {
                b.iter(|| {
                    let y = x.conv2d(&w, None, &opts).unwrap();
                    dev.sync().unwrap();
                    y
                })
            });
            g.bench_function(BenchmarkId::new("matmul_fwd", &id), |b| {
                b.iter(|| {
                    let y = wm.matmul(&cols).unwrap();
                    dev.sync().unwrap();
                    y
                })
            });
            g.throughput(Throughput::Elements((6 * gm * gn * gk) as u64));
            g.bench_function(BenchmarkId::new("conv2d_fwd_bwd", &id), |b| {
                b.iter(|| {
                    let xg = x.clone().with_requires_grad();
                    let wg = w.clone().with_requires_grad();
                    let y = xg.conv2d(&wg, None, &opts).unwrap();
                    y.to_dtype(DType::F32)
                        .unwrap()
                        .sum()
                        .unwrap()
                        .backward()
                        .unwrap();
                    dev.sync().unwrap();
                })
            });
            g.bench_function(BenchmarkId::new("matmul_fwd_bwd", &id), |b| {
                b.iter(|| {
                    let a = wm.clone().with_requires_grad();
                    let bm = cols.clone().with_requires_grad();
                    let y = a.matmul(&bm).unwrap();
                    y.to_dtype(DType::F32)
                        .unwrap()
                        .sum()
                        .unwrap()
                        .backward()
                        .unwrap();
                    dev.sync().unwrap();
                })
            });
            // The backward split: forward + the input's gradient only, forward + the weight's
            // gradient only, each beside the matmul's forward + the matching operand's gradient
            // (dX = W^T dY is B's gradient, dW = dY X^T is A's).
            g.throughput(Throughput::Elements((4 * gm * gn * gk) as u64));
            for (what, grad_x, grad_w) in [("dx", true, false), ("dw", false, true)] {
                g.bench_function(BenchmarkId::new(format!("conv2d_fwd_{what}"), &id), |b| {
                    b.iter(|| {
                        let xg = if grad_x {
                            x.clone().with_requires_grad()
                        } else {
                            x.clone()
                        };
                        let wg = if grad_w {
                            w.clone().with_requires_grad()
                        } else {
                            w.clone()
                        };
                        let y = xg.conv2d(&wg, None, &opts).unwrap();
                        y.to_dtype(DType::F32)
                            .unwrap()
                            .sum()
                            .unwrap()
                            .backward()
                            .unwrap();
                        dev.sync().unwrap();
                    })
                });
                g.bench_function(BenchmarkId::new(format!("matmul_fwd_{what}"), &id), |b| {
                    b.iter(|| {
                        let a = if grad_w {
                            wm.clone().with_requires_grad()
                        } else {
                            wm.clone()
                        };
                        let bm = if grad_x {
                            cols.clone().with_requires_grad()
                        } else {
                            cols.clone()
                        };
                        let y = a.matmul(&bm).unwrap();
                        y.to_dtype(DType::F32)
                            .unwrap()
                            .sum()
                            .unwrap()
                            .backward()
                            .unwrap();
                        dev.sync().unwrap();
                    })
                });
            }
            if dtype == DType::F32 {
                // Batch-invariant sums: the weight's gradient one in-order sum per element.
                set_batch_invariant(&dev, true);
                g.bench_function(BenchmarkId::new("conv2d_fwd_dw_invariant", &id), |b| {
                    b.iter(|| {
                        let wg = w.clone().with_requires_grad();
                        let y = x.conv2d(&wg, None, &opts).unwrap();
                        y.sum().unwrap().backward().unwrap();
                        dev.sync().unwrap();
                    })
                });
                set_batch_invariant(&dev, false);
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
