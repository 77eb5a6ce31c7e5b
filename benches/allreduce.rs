//! Data-parallel training's gradient all-reduce on two logical devices of the default adapter
//! (MLP 784-512-512-10, 669,706 parameters, batch 128 split 64 / 64): the host round trip of
//! one step's all-reduce (flat buffer gathered on the device, read back, summed, written back
//! into the gradients), against a plain readback of as many bytes and against a whole step on
//! one device and on the two replicas. `cargo bench --bench allreduce`.

use criterion::{criterion_group, criterion_main, Criterion};
use fitgrad::distributed::DataParallel;
use fitgrad::nn::Module;
use fitgrad::train::bench::step_fixture;
use fitgrad::train::HostRows;
use fitgrad::{DType, Device, Tensor};

fn bench(c: &mut Criterion) {
    let open = || Device::new().map_err(|e| eprintln!("no adapter, nothing to measure: {e}"));
    let (Ok(d0), Ok(d1), Ok(reference)) = (open(), open(), open()) else {
        return;
    };
    eprintln!("{}", d0.info());
    const B: usize = 128;
    let widths = [784, 512, 512, 10];
    let (mut single, x, y) = step_fixture(&reference, &widths, B).unwrap();
    let rows = HostRows::new(&x, &y).unwrap();
    let all: Vec<usize> = (0..B).collect();
    let devices = [d0.clone(), d1.clone()];
    let mut dp = DataParallel::new(&devices, |d| Ok(step_fixture(d, &widths, B)?.0)).unwrap();
    single.step(&rows, &all).unwrap();
    dp.step(&rows, &all).unwrap();
    let values = single.model.num_parameters() + 1;
    let flat = Tensor::zeros(&reference, &[values], DType::F32).unwrap();

    let mut g = c.benchmark_group("all_reduce_mlp_784_512_512_10");
    g.sample_size(20);
    g.bench_function("round_trip_2_replicas", |b| {
        b.iter_custom(|iters| {
            let before = dp.all_reduce_stats()[0].round_trip();
            for _ in 0..iters {
                dp.step(&rows, &all).unwrap();
            }
            dp.all_reduce_stats()[0].round_trip() - before
        })
    });
    g.bench_function("readback_of_as_many_bytes", |b| {
        b.iter(|| flat.to_vec::<f32>().unwrap())
    });
    g.bench_function("step_2_replicas_b64_each", |b| {
        b.iter(|| {
            dp.step(&rows, &all).unwrap();
            d0.sync().unwrap();
            d1.sync().unwrap();
        })
    });
    g.bench_function("step_1_device_b128", |b| {
        b.iter(|| {
            single.step(&rows, &all).unwrap();
            reference.sync().unwrap();
        })
    });
    g.finish();
    let s = &dp.all_reduce_stats()[0];
    eprintln!(
        "all-reduce buffer {} bytes; per step: round trip {:?} (gather + readback {:?}, \
         exchange {:?}, write-back {:?}), waiting for the backward {:?}",
        s.buffer_bytes,
        s.round_trip_per_step(),
        s.gather / s.steps.max(1) as u32,
        s.communicate / s.steps.max(1) as u32,
        s.scatter / s.steps.max(1) as u32,
        s.backward_wait / s.steps.max(1) as u32,
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
