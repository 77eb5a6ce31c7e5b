//! A tiny training run with a report, as examples/train_mlp/main.rs makes it: an Mlp on the
//! embedded digits for a few epochs, the second step's memory recorded beside the planner's,
//! the loss logged every 5 steps, the test set evaluated after every epoch. Included by the
//! report tests with `#[path]`.

use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::AdamW;
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::train::{data, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device};
use std::time::Instant;

/// The report of `epochs` epochs of a 64-32-10 Mlp on the digits (batch 64), on `dev`, under
/// `budget` when one is given (the micro-batch is fitted to it).
pub fn digits_report(dev: &Device, epochs: u64, budget: Option<u64>) -> TrainingReport {
    let (train, test) = data::load("digits", 0).unwrap();
    let model = Mlp::new(dev, &[train.dim, 32, train.classes], Activation::Relu, 0).unwrap();
    let opt = Box::new(AdamW::new(model.parameters(), 3e-3).unwrap());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let mut report = TrainingReport::new("digits report test", dev, "samples/s");
    if let Some(b) = budget {
        let micro = t.fit_to_budget(&train, b).unwrap();
        report.set_budget(b, 64, micro, None);
    }
    report.set_plan(t.plan(&train).unwrap());
    report.setting("dataset", &train.name).setting(
        "memory budget",
        budget.map_or("none".into(), |b| Bytes(b).to_string()),
    );
    let mut capture = StepCapture::new();
    for epoch in 0..epochs {
        let start = Instant::now();
        let mut last = f32::NAN;
        t.train_epoch(&train, 0, epoch, |t, done, total| {
            capture.after_step(t, &train)?;
            if done % 5 == 0 || done == total {
                let loss = t.take_loss()?;
                last = loss;
                let rate = (done * 64) as f64 / start.elapsed().as_secs_f64();
                report.log_step(t.steps(), loss, Some(rate));
            }
            Ok(())
        })
        .unwrap();
        let secs = start.elapsed().as_secs_f64();
        report.add_events(&t.take_events());
        report.log_epoch(epoch, t.steps(), last, train.len() as f64 / secs, secs);
        let e = t.evaluate(&test, t.micro_batch()).unwrap();
        report.log_eval(t.steps(), Some(epoch), "test", &e);
    }
    report.set_step_memory(capture.finish());
    report.set_memory(dev.memory_stats());
    report.result("steps", t.steps());
    report
}
