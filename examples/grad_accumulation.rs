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
//! `backward()` calls; the arena creates no buffer after the first step.

use fitgrad::nn::{mse_loss, Linear, Module};
use fitgrad::optim::{Optimizer, Sgd};
use fitgrad::{DType, Device, Tensor};

fn main() -> fitgrad::Result<()> {
    let dev = Device::new()?;
    let model = Linear::new(&dev, 1024, 1024, 0)?;
    let criterion = mse_loss;
    let mut optimizer = Sgd::new(model.parameters(), 0.01)?;
    let accumulation_steps = 4;
    let mut seed = 1u64;
    let mut randn = |dims: &[usize]| {
        seed += 1;
        Tensor::randn(&dev, dims, 0.0, 1.0, seed, DType::F32)
    };

    for epoch in 0..10 {
        let mut loss = None;
        for i in 0..100 {
            let inputs = randn(&[32, 1024])?;
            let targets = randn(&[32, 1024])?;
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
        let loss = loss.expect("100 micro-batches ran");
        println!("Epoch {}, Loss: {:.4}", epoch + 1, loss.item()?);
    }
    println!("\n{}", dev.memory_report());
    Ok(())
}
