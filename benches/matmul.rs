//! Matmul throughput (GFLOP/s) on the default adapter: squares and the shapes of an MLP
//! 784-512-512-10 training step at batch 128 (forward, dW = XᵀdY, dX = dYWᵀ), f32 and f16; dW
//! also as the backward runs it, its 128 rows summed in blocks of 16 (`dW_k_blocks`).
//! `cargo bench --bench matmul`; `cargo xtask bench` adds the naive and CPU references.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fitgrad::{DType, MatmulOptions, Tensor};

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    // (name, m, n, k, trans_a, trans_b, k_blocks)
    let mut shapes = vec![];
    for s in [256, 512, 1024, 2048] {
        shapes.push(("square", s, s, s, false, false, false));
    }
    for (k, n) in [(784, 512), (512, 512), (512, 10)] {
        shapes.push(("fwd", 128, n, k, false, false, false));
        shapes.push(("dW", k, n, 128, true, false, false));
        shapes.push(("dW_k_blocks", k, n, 128, true, false, true));
        shapes.push(("dX", 128, k, n, false, true, false));
    }
    for dtype in [DType::F32, DType::F16] {
        let mut g = c.benchmark_group(format!("matmul_{dtype}"));
        g.sample_size(10);
        for &(name, m, n, k, ta, tb, kb) in &shapes {
            let ad = if ta { [k, m] } else { [m, k] };
            let bd = if tb { [n, k] } else { [k, n] };
            let a = Tensor::randn(&dev, &ad, 0.0, 1.0, 1, dtype).unwrap();
            let b = Tensor::randn(&dev, &bd, 0.0, 1.0, 2, dtype).unwrap();
            let opts = MatmulOptions::new().trans_a(ta).trans_b(tb).k_blocks(kb);
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            g.bench_function(BenchmarkId::new(name, format!("{m}x{n}x{k}")), |bch| {
                bch.iter(|| {
                    let c = a.matmul_with(&b, &opts).unwrap();
                    dev.sync().unwrap();
                    c
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
