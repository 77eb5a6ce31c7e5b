//! What keeping the model off the device costs. One training step of a GPT (4 blocks of width
//! 128, context 64, batch 8, AdamW) with its state on the device, in 8 bits, offloaded to host
//! memory and streamed unit by unit: the same model and batch, so each step time is read
//! against the on-device step of the same run; the bytes each strategy moves per step and
//! keeps in host memory are printed from its plan. Then AdamW's update of 4M parameters: the
//! device's kernel against the offloaded update (gradients read back, the threaded host
//! update, parameters uploaded), as elements per second.
//! `cargo bench --bench offload`; FITGRAD_BACKEND / FITGRAD_ADAPTER pick another adapter.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fitgrad::nn::{cross_entropy, Activation, Gpt, GptConfig, Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer};
use fitgrad::tensor::Rng;
use fitgrad::train::text::TextDataset;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Device, Tensor};

const BATCH: usize = 8;

#[derive(Clone, Copy)]
enum Strategy {
    Device,
    EightBit,
    OffloadOptimizer,
    Streamed,
}

impl Strategy {
    fn name(self) -> &'static str {
        match self {
            Strategy::Device => "on_device",
            Strategy::EightBit => "adamw8bit",
            Strategy::OffloadOptimizer => "offload_optimizer",
            Strategy::Streamed => "offload_parameters",
        }
    }
}

fn gpt_trainer(dev: &Device, s: Strategy) -> fitgrad::Result<Trainer<Gpt>> {
    let mut cfg = GptConfig::new(64, 64, 4, 4, 128);
    cfg.seed = 1;
    let model = Gpt::new(dev, cfg)?;
    let mut opt = AdamW::new(model.parameters(), 1e-3)?;
    if matches!(s, Strategy::EightBit) {
        opt = opt.eight_bit();
    }
    let config = TrainerConfig::default()
        .batch_size(BATCH)
        .lr(1e-3)
        .offload_optimizer(matches!(s, Strategy::OffloadOptimizer))
        .offload_parameters(matches!(s, Strategy::Streamed));
    Trainer::new(model, Box::new(opt), config)
}

fn steps(c: &mut Criterion, dev: &Device) -> fitgrad::Result<()> {
    let mut rng = Rng::new(3);
    let tokens: Vec<u32> = (0..4096).map(|_| (rng.next_u64() % 64) as u32).collect();
    let data = TextDataset::new(tokens, 64)?;
    let idx: Vec<usize> = (0..BATCH).map(|i| i * 97).collect();
    let mut g = c.benchmark_group("gpt_L4_d128_step");
    g.sample_size(10);
    g.throughput(Throughput::Elements(BATCH as u64));
    for s in [
        Strategy::Device,
        Strategy::EightBit,
        Strategy::OffloadOptimizer,
        Strategy::Streamed,
    ] {
        let mut t = gpt_trainer(dev, s)?;
        let plan = t.plan(&data)?;
        eprintln!(
            "{}: planned device peak {} B, host {} B, moved {} B per step",
            s.name(),
            plan.peak,
            plan.host_bytes,
            plan.bytes_moved
        );
        t.step(&data, &idx)?;
        g.bench_function(s.name(), |b| {
            b.iter(|| {
                t.step(&data, &idx).unwrap();
                dev.sync().unwrap();
            })
        });
    }
    g.finish();
    Ok(())
}

/// A 2048x2048 linear layer (4.2M parameters) with gradients from one backward pass.
fn layer_with_grads(dev: &Device) -> fitgrad::Result<Mlp> {
    let model = Mlp::new(dev, &[2048, 2048], Activation::Relu, 5)?;
    let mut rng = Rng::new(4);
    let x: Vec<f32> = (0..4 * 2048).map(|_| rng.next_f64() as f32).collect();
    let x = Tensor::from_slice(dev, &x, &[4, 2048])?;
    let y: Vec<u32> = (0..4).map(|i| i * 100).collect();
    cross_entropy(&model.forward(&x)?, &y)?.backward()?;
    Ok(model)
}

fn updates(c: &mut Criterion, dev: &Device) -> fitgrad::Result<()> {
    let model = layer_with_grads(dev)?;
    let n: usize = model.parameters().iter().map(|p| p.numel()).sum();
    let mut g = c.benchmark_group("adamw_update_4m");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    for host in [false, true] {
        let mut opt = AdamW::new(model.parameters(), 1e-3)?;
        if host {
            opt.offload_to_host()?;
        }
        opt.step()?;
        let name = if host {
            "host_offloaded"
        } else {
            "device_kernel"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                opt.step().unwrap();
                dev.sync().unwrap();
            })
        });
    }
    g.finish();
    Ok(())
}

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    if let Err(e) = steps(c, &dev).and_then(|_| updates(c, &dev)) {
        eprintln!("offload bench: {e}");
        std::process::exit(1);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
