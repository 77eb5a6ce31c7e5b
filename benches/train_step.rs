//! One full training step (forward, backward, AdamW) of an MLP 784-512-512-10 at batch 128, and
//! the same step's matmuls alone: the difference is what the rest of the step costs.
//! `cargo bench --bench train_step`; FITGRAD_BACKEND / FITGRAD_ADAPTER pick another adapter.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fitgrad::train::bench::{step_fixture, StepMatmuls};

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    const B: usize = 128;
    let widths = [784, 512, 512, 10];
    let (mut trainer, x, y) = step_fixture(&dev, &widths, B).unwrap();
    trainer.step_rows(&x, &y).unwrap();
    let mats = StepMatmuls::new(&dev, &widths, B).unwrap();
    let mut g = c.benchmark_group("train_step_mlp_784_512_512_10");
    g.sample_size(20);
    // Throughput in samples per second.
    g.throughput(Throughput::Elements(B as u64));
    g.bench_function("step_adamw_b128", |b| {
        b.iter(|| {
            trainer.step_rows(&x, &y).unwrap();
            dev.sync().unwrap();
        })
    });
    g.bench_function("matmuls_only_b128", |b| {
        b.iter(|| {
            mats.run().unwrap();
            dev.sync().unwrap();
        })
    });
    g.finish();
    let mem = trainer.memory_summary();
    eprintln!("{mem}");
}

criterion_group!(benches, bench);
criterion_main!(benches);
