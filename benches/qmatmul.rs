//! The int8 quantized matmul (`QuantizedLinear::forward`, weights dequantized in registers)
//! against the f32 matmul of the same shape (`x · Wᵀ + b`, the f32 Linear's forward), on the
//! default adapter: the digits MLP's layers at an evaluation batch of 1024, a wide layer at
//! batch 256, and matrix-vector products where reading the weights dominates.
//! `cargo bench --bench qmatmul`.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fitgrad::compress::QuantizedLinear;
use fitgrad::{DType, MatmulOptions, Tensor};

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    // (m, n, k): x is (m, k), W is (n, k).
    let shapes = [
        (1024, 256, 64),
        (1024, 256, 256),
        (1024, 10, 256),
        (256, 1024, 1024),
        (1, 4096, 1024),
        (8, 4096, 1024),
    ];
    let mut g = c.benchmark_group("qmatmul");
    g.sample_size(10);
    for &(m, n, k) in &shapes {
        let x = Tensor::randn(&dev, &[m, k], 0.0, 1.0, 1, DType::F32).unwrap();
        let w = Tensor::randn(&dev, &[n, k], 0.0, 0.1, 2, DType::F32).unwrap();
        let b = Tensor::randn(&dev, &[n], 0.0, 0.1, 3, DType::F32).unwrap();
        let q = QuantizedLinear::quantize(&w, Some(&b)).unwrap();
        let mut opts = MatmulOptions::default();
        opts.trans_b = true;
        opts.bias = Some(&b);
        let shape = format!("{m}x{n}x{k}");
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_function(BenchmarkId::new("f32", &shape), |bch| {
            bch.iter(|| {
                let y = x.matmul_with(&w, &opts).unwrap();
                dev.sync().unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("int8", &shape), |bch| {
            bch.iter(|| {
                let y = q.forward(&x).unwrap();
                dev.sync().unwrap();
                y
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
