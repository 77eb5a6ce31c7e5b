//! Matmul throughput (GFLOP/s) on the default adapter: squares and the shapes of an MLP
//! 784-512-512-10 training step at batch 128 (forward, dW = XᵀdY, dX = dYWᵀ), f32 and f16; dW
//! also as the backward runs it, its 128 rows summed in blocks of 16 (`dW_k_blocks`), and in f32
//! as batch-invariant sums fold it onto the gradient held: by the kernel the autotuner chooses
//! (`dW_fold`) and by the naive one-invocation-per-output kernel (`dW_fold_naive`).
//! `cargo bench --bench matmul`; `cargo xtask bench` adds the naive and CPU references.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fitgrad::{DType, MatmulOptions, MatmulVariant as Variant, Tensor};

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
        if dtype == DType::F32 {
            for &(_, m, n, k, ..) in shapes.iter().filter(|s| s.0 == "dW") {
                let x = Tensor::randn(&dev, &[k, m], 0.0, 1.0, 1, dtype).unwrap();
                let dy = Tensor::randn(&dev, &[k, n], 0.0, 1.0, 2, dtype).unwrap();
                let grad = Tensor::zeros(&dev, &[m, n], dtype).unwrap();
                let chosen = x
                    .matmul_chosen(&dy, &MatmulOptions::new().trans_a(true))
                    .unwrap();
                g.throughput(Throughput::Elements((2 * m * n * k) as u64));
                for (name, v) in [("dW_fold", chosen), ("dW_fold_naive", Variant::Naive)] {
                    g.bench_function(BenchmarkId::new(name, format!("{m}x{n}x{k}")), |bch| {
                        bch.iter(|| {
                            x.fold_rows_onto(&dy, &grad, v).unwrap();
                            dev.sync().unwrap();
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
