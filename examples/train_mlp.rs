//! `cargo run --release --example train_mlp`
//!
//! Until the trainer lands (autograd issue), this shows the device fitgrad picked, runs the
//! first kernels on it, checks them against the host, and prints the memory report.

use fitgrad::{DType, Device, Tensor};
use std::process::ExitCode;

fn run() -> fitgrad::Result<()> {
    println!("adapters on this machine:");
    for a in Device::adapters() {
        println!("  {a}");
    }
    let dev = Device::new()?;
    println!("\nusing {}\n", dev.info());

    // A batch of "inputs" (64, 784) and a bias (784,), as a first layer would see them.
    let x = Tensor::randn(&dev, &[64, 784], 0.0, 1.0, 7, DType::F32)?;
    let bias = Tensor::rand_uniform(&dev, &[784], -0.1, 0.1, 8, DType::F32)?;
    let h = x.add(&bias)?.relu()?; // (64, 784)
    let col_mean = h.mean_axis(0, false)?; // (784,)
    let total = h.sum()?.item()?;

    // The same on the host, to show the kernels agree.
    let (xv, bv) = (x.to_vec::<f32>()?, bias.to_vec::<f32>()?);
    let host: f64 = xv
        .iter()
        .enumerate()
        .map(|(i, v)| (v + bv[i % 784]).max(0.0) as f64)
        .sum();
    println!("sum(relu(x + b)) on the GPU {total:.3}, on the host {host:.3}");
    println!(
        "mean of the first column {:.4}",
        col_mean.to_vec::<f32>()?[0]
    );

    // Half precision: the same activations in f16 take half the memory.
    let h16 = h.to_dtype(DType::F16)?;
    println!(
        "activations: f32 {} bytes, f16 {} bytes; transpose of f16 -> {:?}",
        h.allocated_bytes(),
        h16.allocated_bytes(),
        h16.transpose()?.dims()
    );

    // Dropped tensors' memory is reused: this loop creates no new buffers.
    let before = dev.memory_stats().buffers_created;
    for step in 0..100 {
        let y = x.mul_scalar(step as f32)?.add(&bias)?;
        drop(y);
    }
    dev.sync()?;
    println!(
        "100 steps of temporaries created {} new buffers\n",
        dev.memory_stats().buffers_created - before
    );
    println!("{}", dev.memory_report());
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
