//! Softmax throughput (GB/s of memory touched: the row read once and written once) on the
//! default adapter, next to a plain copy of the same bytes (`to_dtype` of the same dtype, the
//! copy kernel), which is the bar: softmax should cost a small multiple of the copy.
//! `cargo bench --bench softmax`; set FITGRAD_BACKEND / FITGRAD_ADAPTER to pick another adapter.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fitgrad::{DType, SoftmaxOptions, Tensor};

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    let (rows, cols) = (4096usize, 1024usize);
    for dtype in [DType::F32, DType::F16] {
        let x = Tensor::randn(&dev, &[rows, cols], 0.0, 3.0, 1, dtype).unwrap();
        let mut g = c.benchmark_group(format!("softmax_{dtype}"));
        g.sample_size(20);
        // Both read and write every element once.
        g.throughput(Throughput::Bytes((2 * rows * cols * dtype.size()) as u64));
        g.bench_function("copy_4096x1024", |b| {
            b.iter(|| {
                let y = x.to_dtype(dtype).unwrap();
                dev.sync().unwrap();
                y
            })
        });
        g.bench_function("softmax_4096x1024", |b| {
            b.iter(|| {
                let y = x.softmax().unwrap();
                dev.sync().unwrap();
                y
            })
        });
        g.bench_function("log_softmax_4096x1024", |b| {
            b.iter(|| {
                let y = x.log_softmax().unwrap();
                dev.sync().unwrap();
                y
            })
        });
        // Attention weights: 4 heads of 1024 x 1024 causal scores, scaled (half the row unread).
        let scores = x.reshape(&[4, 1024, 1024]).unwrap();
        let causal = SoftmaxOptions::new().scale(0.125).causal(true);
        g.bench_function("softmax_masked_causal_4x1024x1024", |b| {
            b.iter(|| {
                let y = scores.softmax_masked(causal.clone()).unwrap();
                dev.sync().unwrap();
                y
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
