//! Elementwise and reduction throughput (GB/s of memory touched) on the default adapter.
//! `cargo bench --bench elementwise`; set FITGRAD_BACKEND / FITGRAD_ADAPTER to pick another.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fitgrad::{DType, Tensor};

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    let n = 1 << 20;
    for dtype in [DType::F32, DType::F16] {
        let a = Tensor::randn(&dev, &[n], 0.0, 1.0, 1, dtype).unwrap();
        let b = Tensor::randn(&dev, &[n], 0.0, 1.0, 2, dtype).unwrap();
        let mut g = c.benchmark_group(format!("elementwise_{dtype}"));
        g.sample_size(10);
        // add reads two tensors and writes one.
        g.throughput(Throughput::Bytes((3 * n * dtype.size()) as u64));
        g.bench_function("add_1M", |bch| {
            bch.iter(|| {
                let c = a.add(&b).unwrap();
                dev.sync().unwrap();
                c
            })
        });
        g.throughput(Throughput::Bytes((n * dtype.size()) as u64));
        g.bench_function("sum_1M", |bch| {
            bch.iter(|| a.sum().unwrap().item().unwrap())
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
