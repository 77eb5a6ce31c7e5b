//! The matmuls of a frozen quantized base (shaders/dqmatmul.wgsl: W dequantized in the shader)
//! beside the f32 matmul of the same shape, on the default adapter: the forward
//! `x · dequant(W)ᵀ` against `x · Wᵀ`, and the forward with the input gradient
//! `dy · dequant(W)` (the backward of a frozen layer) against the f32 matmul's forward and
//! input gradient, for NF4 with double quantization and int8 bases. The shapes are GPT-2
//! 124M's adapted layers (c_attn, c_fc, c_proj) at 256 tokens, and a small layer.
//! `cargo bench --bench dqmatmul`; `DQ_BENCH_M` sets the tokens (default 256).

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fitgrad::compress::{quantize_weight, BaseQuant};
use fitgrad::{Activation, DType, MatmulOptions, Tensor};
use std::sync::Arc;

/// (name, in features K, out features R).
const SHAPES: [(&str, usize, usize); 4] = [
    ("c_attn", 768, 2304),
    ("c_fc", 768, 3072),
    ("c_proj", 3072, 768),
    ("small", 128, 384),
];

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    let m: usize = std::env::var("DQ_BENCH_M")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let mut g = c.benchmark_group("dqmatmul");
    g.sample_size(10);
    for &(name, k, r) in &SHAPES {
        let x = Tensor::randn(&dev, &[m, k], 0.0, 1.0, 1, DType::F32).unwrap();
        let w = Tensor::randn(&dev, &[r, k], 0.0, 0.05, 2, DType::F32).unwrap();
        let dy = Tensor::randn(&dev, &[m, r], 0.0, 1.0, 3, DType::F32).unwrap();
        let host = w.to_vec_f32().unwrap();
        let mut opts = MatmulOptions::default();
        opts.trans_b = true;
        let id = format!("{name}-{m}x{r}x{k}");
        g.throughput(Throughput::Elements((2 * m * r * k) as u64));
        g.bench_function(BenchmarkId::new("f32_fwd", &id), |b| {
            b.iter(|| {
                let y = x.matmul_with(&w, &opts).unwrap();
                dev.sync().unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("f32_fwd_dx", &id), |b| {
            b.iter(|| {
                let xg = x.detach().with_requires_grad();
                xg.matmul_with(&w, &opts)
                    .unwrap()
                    .backward_with(dy.clone())
                    .unwrap();
                let dx = xg.grad().unwrap();
                dev.sync().unwrap();
                dx
            })
        });
        for (label, quant) in [
            ("nf4", BaseQuant::Nf4 { double_quant: true }),
            ("int8", BaseQuant::Int8),
        ] {
            let q = Arc::new(quantize_weight(&dev, &host, r, k, quant).unwrap());
            g.bench_function(BenchmarkId::new(format!("{label}_fwd"), &id), |b| {
                b.iter(|| {
                    let y = q.linear(&x, None, Activation::None).unwrap();
                    dev.sync().unwrap();
                    y
                })
            });
            g.bench_function(BenchmarkId::new(format!("{label}_fwd_dx"), &id), |b| {
                b.iter(|| {
                    let xg = x.detach().with_requires_grad();
                    let y = q.linear(&xg, None, Activation::None).unwrap();
                    y.backward_with(dy.clone()).unwrap();
                    let dx = xg.grad().unwrap();
                    dev.sync().unwrap();
                    dx
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
