//! Fused self-attention against the same math composed from matmul, softmax_masked and matmul:
//! one causal forward plus backward (the gradients of q, k and v) per iteration, on the default
//! adapter, at T = 256 to 2048 (D = 64 and 32, f32, and f16 at two shapes). Before timing, each
//! prints its peak memory above the inputs (what a training step pays for attention), the time
//! of one step and, for fused, the ratios of both to composed.
//! `cargo bench --bench attention`; set FITGRAD_BACKEND / FITGRAD_ADAPTER to pick another adapter
//! and `FITGRAD_ATTENTION_SHAPES="f32:1x8x512x64,f16:1x4x1024x64"` to run only those shapes.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fitgrad::{AttentionKind, AttentionOptions, Bytes, DType, Device, Tensor};
use std::time::Instant;

/// Forward, backward from sum(o), and the gradients dropped again.
fn step(dev: &Device, qkv: &[Tensor; 3], opts: &AttentionOptions) -> fitgrad::Result<()> {
    let [q, k, v] = qkv;
    let o = q.attention_with(k, v, opts)?;
    o.sum()?.backward()?;
    for t in qkv {
        t.zero_grad();
    }
    dev.sync()
}

/// The T = 256 .. 2048 at (B, H) = (1, 4), D = 64; then wider and narrower heads.
const SHAPES: &[(DType, [usize; 4])] = &[
    (DType::F32, [1, 4, 256, 64]),
    (DType::F32, [1, 8, 512, 64]),
    (DType::F32, [1, 4, 1024, 64]),
    (DType::F32, [1, 2, 2048, 64]),
    (DType::F32, [1, 4, 2048, 64]),
    (DType::F32, [1, 8, 512, 32]),
    (DType::F32, [1, 4, 1024, 32]),
    (DType::F32, [1, 2, 2048, 32]),
    (DType::F16, [1, 8, 512, 64]),
    (DType::F16, [1, 4, 1024, 64]),
];

/// `FITGRAD_ATTENTION_SHAPES` (`f32:1x8x512x64,...`), or [`SHAPES`].
fn shapes() -> Vec<(DType, [usize; 4])> {
    let Ok(list) = std::env::var("FITGRAD_ATTENTION_SHAPES") else {
        return SHAPES.to_vec();
    };
    list.split(',')
        .map(|s| {
            let (dt, dims) = s.split_once(':').expect("dtype:BxHxTxD");
            let dtype = if dt == "f16" { DType::F16 } else { DType::F32 };
            let d: Vec<usize> = dims
                .split('x')
                .map(|n| n.parse().expect("a number"))
                .collect();
            (dtype, [d[0], d[1], d[2], d[3]])
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    for (dtype, dims) in shapes() {
        let [b, h, t, d] = dims;
        let qkv = [1, 2, 3].map(|seed| {
            Tensor::randn(&dev, &dims, 0.0, 1.0, seed, dtype)
                .unwrap()
                .with_requires_grad()
        });
        let mut g = c.benchmark_group(format!("attention_{dtype}_b{b}_h{h}_t{t}_d{d}"));
        g.sample_size(10);
        // Causal score elements per step (each one is computed in the forward and twice in
        // the fused backward).
        g.throughput(Throughput::Elements((b * h * t * (t + 1) / 2) as u64));
        let mut first: Option<(u64, f64)> = None;
        for (name, kind) in [
            ("composed", AttentionKind::Composed),
            ("fused", AttentionKind::Fused),
        ] {
            let opts = AttentionOptions::new().kind(kind);
            // Warm up (pipelines, autotuning), then one step's peak and the best of three times.
            step(&dev, &qkv, &opts).unwrap();
            dev.reset_peak();
            let before = dev.memory_stats().bytes_in_use;
            let mut secs = f64::INFINITY;
            for _ in 0..3 {
                let start = Instant::now();
                step(&dev, &qkv, &opts).unwrap();
                secs = secs.min(start.elapsed().as_secs_f64());
            }
            let peak = dev.memory_stats().peak_bytes_in_use - before;
            let ratios = match first {
                Some((p, s)) => format!(
                    " (x{:.3} composed's peak, x{:.2} its time)",
                    peak as f64 / p as f64,
                    secs / s
                ),
                None => String::new(),
            };
            eprintln!(
                "attention {dtype} (B, H, T, D) = {dims:?} {name}: peak {} above the inputs, \
                 one forward + backward {:.1} ms{ratios}",
                Bytes(peak),
                secs * 1e3
            );
            first.get_or_insert((peak, secs));
            g.bench_function(name, |bn| bn.iter(|| step(&dev, &qkv, &opts).unwrap()));
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
