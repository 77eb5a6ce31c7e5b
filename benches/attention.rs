//! Fused self-attention against the same math composed from matmul, softmax_masked and matmul:
//! one causal forward plus backward (the gradients of q, k and v) per iteration, in f32 and f16,
//! on the default adapter. Before timing, each prints its peak memory above the inputs (what a
//! training step pays for attention) and the time of one step.
//! `cargo bench --bench attention`; set FITGRAD_BACKEND / FITGRAD_ADAPTER to pick another adapter.

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

fn bench(c: &mut Criterion) {
    let dev = match Device::new() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no adapter, nothing to measure: {e}");
            return;
        }
    };
    eprintln!("{}", dev.info());
    let shapes = [[4usize, 4, 256, 64], [1, 8, 512, 64], [8, 4, 128, 32]];
    for dims in shapes {
        let [b, h, t, d] = dims;
        for dtype in [DType::F32, DType::F16] {
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
            for (name, kind) in [
                ("fused", AttentionKind::Fused),
                ("composed", AttentionKind::Composed),
            ] {
                let opts = AttentionOptions::new().kind(kind);
                // Warm up (pipelines, autotuning), then one step's peak and time.
                step(&dev, &qkv, &opts).unwrap();
                dev.reset_peak();
                let before = dev.memory_stats().bytes_in_use;
                let start = Instant::now();
                step(&dev, &qkv, &opts).unwrap();
                let secs = start.elapsed().as_secs_f64();
                let peak = dev.memory_stats().peak_bytes_in_use - before;
                eprintln!(
                    "attention {dtype} (B, H, T, D) = {dims:?} {name}: peak {} above the inputs, \
                     one forward + backward {:.1} ms",
                    Bytes(peak),
                    secs * 1e3
                );
                g.bench_function(name, |bn| bn.iter(|| step(&dev, &qkv, &opts).unwrap()));
            }
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
