//! Gradient accumulation, written the way the PyTorch recipe is:
//!
//! ```python
//! model = nn.Linear(1024, 1024)
//! criterion = nn.MSELoss()
//! optimizer = optim.SGD(model.parameters(), lr=0.01)
//! accumulation_steps = 4
//! for epoch in range(10):
//!     for i in range(100):
//!         inputs = torch.randn(32, 1024)
//!         targets = torch.randn(32, 1024)
//!         outputs = model(inputs)
//!         loss = criterion(outputs, targets)
//!         loss = loss / accumulation_steps
//!         loss.backward()
//!         if (i + 1) % accumulation_steps == 0:
//!             optimizer.step()
//!             optimizer.zero_grad()
//!     print(f"Epoch {epoch+1}, Loss: {loss.item():.4f}")
//! ```
//!
//! `cargo run --release --example grad_accumulation`. Gradients add up in place across the four
//! `backward()` calls; the arena creates no buffer after the first step. The recipe's numbers
//! are the defaults of its flags (`--help`): `--features`, `--batch-size`, `--epochs`,
//! `--batches`, `--accumulation-steps`, `--lr`, `--seed`, `--adapter`.

use clap::Parser;
use fitgrad::nn::{mse_loss, Linear, Module};
use fitgrad::optim::{Optimizer, Sgd};
use fitgrad::run::{self, MAX_BATCH, MAX_EPOCHS, MAX_STEPS, MAX_WIDTH};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Gradient accumulation as the PyTorch recipe writes it, with fitgrad")]
struct Args {
    /// Inputs and outputs of the Linear layer.
    #[arg(long, default_value_t = 1024)]
    features: usize,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Epochs.
    #[arg(long, default_value_t = 10)]
    epochs: u64,
    /// Micro-batches per epoch (a multiple of --accumulation-steps).
    #[arg(long, default_value_t = 100)]
    batches: u64,
    /// Micro-batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 4)]
    accumulation_steps: u64,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01, allow_negative_numbers = true)]
    lr: f32,
    /// Seed of the weights and the random data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Substring of the adapter name to use.
    #[arg(long)]
    adapter: Option<String>,
}

fn run(args: Args) -> fitgrad::Result<()> {
    let invalid = |reason: String| Error::InvalidArgument {
        op: "grad_accumulation",
        reason,
    };
    let n = |v: usize| v as u64;
    run::check_counts(
        "grad_accumulation",
        &[
            ("--features", n(args.features), 1, MAX_WIDTH),
            ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
            ("--epochs", args.epochs, 1, MAX_EPOCHS),
            ("--batches", args.batches, 1, MAX_STEPS),
            (
                "--accumulation-steps",
                args.accumulation_steps,
                1,
                MAX_BATCH,
            ),
        ],
    )?;
    run::check_environment()?;
    if !args.batches.is_multiple_of(args.accumulation_steps) {
        return Err(invalid(format!(
            "--batches {} is not a multiple of --accumulation-steps {}: the last micro-batches' \
             gradients would never be applied",
            args.batches, args.accumulation_steps
        )));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(invalid(format!(
            "--lr must be a number > 0, got {}",
            args.lr
        )));
    }
    let mut options = DeviceOptions::default();
    options.adapter = args.adapter.clone();
    let dev = Device::with_options(options)?;
    let model = Linear::new(&dev, args.features, args.features, args.seed)?;
    let criterion = mse_loss;
    let mut optimizer = Sgd::new(model.parameters(), args.lr)?;
    let accumulation_steps = args.accumulation_steps;
    let mut seed = args.seed.wrapping_mul(1_000_003).wrapping_add(1);
    let mut randn = |dims: &[usize]| {
        seed = seed.wrapping_add(1);
        Tensor::randn(&dev, dims, 0.0, 1.0, seed, DType::F32)
    };
    let dims = [args.batch_size, args.features];

    for epoch in 0..args.epochs {
        let mut loss = None;
        for i in 0..args.batches {
            let inputs = randn(&dims)?;
            let targets = randn(&dims)?;
            let outputs = model.forward(&inputs)?;
            let l = criterion(&outputs, &targets)?;
            let l = l.div_scalar(accumulation_steps as f32)?;
            l.backward()?;
            if (i + 1) % accumulation_steps == 0 {
                optimizer.step()?;
                optimizer.zero_grad();
            }
            loss = Some(l);
        }
        let loss = loss.expect("--batches is at least 1");
        let value = loss.item()?;
        if !value.is_finite() {
            return Err(Error::NonFinite {
                step: (epoch + 1) * args.batches / accumulation_steps,
                what: format!("the loss of epoch {} is {value}", epoch + 1),
                remedy: "lower --lr".into(),
            });
        }
        println!("Epoch {}, Loss: {value:.4}", epoch + 1);
    }
    println!("\n{}", dev.memory_report());
    Ok(())
}

fn main() -> ExitCode {
    let args = match fitgrad::run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
