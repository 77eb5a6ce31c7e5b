use fitgrad::nn::{Act, Mlp, Module};
use fitgrad::optim::AdamW;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{DType, Device, Tensor};
use std::time::Instant;
fn t<F: FnMut() -> fitgrad::Result<()>>(dev: &Device, name: &str, n: usize, mut f: F) -> fitgrad::Result<()> {
    f()?; dev.sync()?;
    let s = Instant::now();
    for _ in 0..n { f()?; }
    dev.sync()?;
    println!("{name}: {:.3} ms", s.elapsed().as_secs_f64() * 1e3 / n as f64);
    Ok(())
}
fn main() -> fitgrad::Result<()> {
    let dev = Device::new()?;
    let b: usize = std::env::var("B").ok().and_then(|s| s.parse().ok()).unwrap_or(64);
    let w: Vec<usize> = if b == 128 { vec![784, 512, 512, 10] } else { vec![64, 256, 256, 10] };
    let model = Mlp::new(&dev, &w, Act::Relu, 0)?;
    let opt = AdamW::new(model.parameters(), 1e-3)?;
    let mut tr = Trainer::new(model, Box::new(opt), TrainerConfig { batch_size: b, ..Default::default() })?;
    let x: Vec<f32> = (0..b * w[0]).map(|i| (i % 17) as f32 / 17.0).collect();
    let y: Vec<u32> = (0..b).map(|i| (i % 10) as u32).collect();
    t(&dev, "step", 10, || tr.step(&x, &y))?;
    let a = Tensor::randn(&dev, &[b, 256], 0.0, 1.0, 1, DType::F32)?;
    let c = Tensor::randn(&dev, &[b, 256], 0.0, 1.0, 2, DType::F32)?;
    t(&dev, "add", 20, || a.add(&c).map(|_| ()))?;
    t(&dev, "relu", 20, || a.relu().map(|_| ()))?;
    t(&dev, "sum_axis0", 20, || a.sum_axis(0, false).map(|_| ()))?;
    t(&dev, "mean", 20, || a.mean().map(|_| ()))?;
    t(&dev, "upload", 20, || Tensor::from_slice(&dev, &x, &[b, w[0]]).map(|_| ()))?;
    t(&dev, "ce", 20, || a.cross_entropy_loss(&y).map(|_| ()))?;
    let wt = Tensor::randn(&dev, &[256, 256], 0.0, 1.0, 3, DType::F32)?;
    t(&dev, "matmul", 20, || a.matmul(&wt).map(|_| ()))?;
    let ag = a.clone().with_requires_grad();
    t(&dev, "fwd+bwd relu sum", 10, || { let l = ag.relu()?.sum()?; l.backward() })?;
    Ok(())
}
