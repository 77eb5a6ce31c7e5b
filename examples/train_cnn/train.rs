//! train_cnn's trainer as the flags ask, and its epochs: the loss every 50 steps on stderr,
//! the events, a save after each epoch.

use super::augment::Augmented;
use super::model::{self, ResNet};
use super::{Args, Setup};
use fitgrad::nn::Module;
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::run;
use fitgrad::train::{TrainEvent, Trainer, TrainerConfig};
use fitgrad::Result;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The model and its trainer as the flags ask: the optimizer, the schedule over
/// `total_steps`, batch-invariant sums with group norm in f32.
pub fn build(
    args: &Args,
    setup: &Setup,
    device: &fitgrad::Device,
    total_steps: u64,
) -> Result<Trainer<ResNet>> {
    let shape = model::Shape {
        width: setup.width,
        stem_stride: setup.stem_stride,
        blocks: args.blocks,
        group_norm: setup.group,
        seed: args.run.seed,
    };
    let model = ResNet::new(device, setup.side, setup.train.classes, shape)?;
    if args.fit.checkpoint_activations {
        model.checkpoint.store(true, Ordering::Relaxed);
    }
    let lr = setup.lr as f32;
    let optimizer: Box<dyn Optimizer> = match args.optimizer.as_str() {
        "sgd" => Box::new(Sgd::new(model.parameters(), lr)?.momentum(0.9)?),
        _ => Box::new(AdamW::new(model.parameters(), lr)?),
    };
    let schedule = run::lr_schedule(setup.cosine, total_steps, 0.0);
    // Group norm mixes no samples: with batch-invariant sums a budget's micro-batches then give
    // the whole batch's bits (f32; mixed precision rounds each micro-batch's gradients to f16).
    let invariant =
        setup.group && setup.precision == fitgrad::train::Precision::F32 && !args.fast_sums;
    let config = TrainerConfig::new(setup.batch_size, args.run.accum_steps, lr)
        .schedule(schedule)
        .precision(setup.precision)
        .batch_invariant(invariant);
    Trainer::new(model, optimizer, config)
}

/// Epochs `first..`: the loss every 50 steps on stderr, the events, a save after each epoch;
/// (the last loss, the steps redone after running out of memory, the step's memory).
pub fn train_epochs(
    args: &Args,
    setup: &Setup,
    trainer: &mut Trainer<ResNet>,
    images: &Augmented<'_>,
    first: u64,
    report: &mut TrainingReport,
    root: bool,
) -> Result<(f32, usize, StepCapture)> {
    let train = &setup.train;
    let eff = trainer.effective_batch();
    let steps_per_epoch = train.len().div_ceil(eff);
    let mut final_loss = f32::NAN;
    let mut capture = StepCapture::new();
    let mut oom_retries = 0;
    for epoch in first..setup.epochs {
        let epoch_start = Instant::now();
        trainer.train_epoch(images, args.run.seed, epoch, |t, done, total| {
            if args.report.is_some() {
                capture.after_step(t, images)?;
            }
            if done.is_multiple_of(50) || done == total {
                let loss = t.take_loss()?;
                if !loss.is_nan() {
                    final_loss = loss;
                }
                let rate = (done * eff).min(train.len()) as f64 / epoch_start.elapsed().as_secs_f64();
                if root {
                    eprintln!(
                        "epoch {} step {done}/{steps_per_epoch}: loss {final_loss:.4}, {rate:.0} samples/s",
                        epoch + 1
                    );
                }
                report.log_step(t.steps(), loss, Some(rate));
            }
            Ok(())
        })?;
        let secs = epoch_start.elapsed().as_secs_f64();
        for e in trainer.take_events() {
            if matches!(e, TrainEvent::OomRetry { .. }) {
                oom_retries += 1;
            }
            if root {
                println!("  {e}");
            }
        }
        let rate = train.len() as f64 / secs;
        report.log_epoch(epoch, trainer.steps(), final_loss, rate, secs);
        if let (Some(path), true) = (&args.checkpoint.save, root) {
            trainer.save_checkpoint(path, epoch + 1)?;
        }
    }
    Ok((final_loss, oom_retries, capture))
}

/// Says the model, the sums, the augmentation and the schedule (on rank 0).
pub fn describe(args: &Args, setup: &Setup, trainer: &Trainer<ResNet>, total_steps: u64) {
    let w = setup.width;
    println!(
        "model: ResNet, stem stride {}, 3 stages of width {w}, {}, {} ({} blocks, {} norm, {} parameters), {} lr {}, {}, batch {} x {}",
        setup.stem_stride,
        2 * w,
        4 * w,
        trainer.model.blocks.len(),
        args.norm,
        trainer.model.num_parameters(),
        args.optimizer,
        setup.lr,
        args.run.precision,
        setup.batch_size,
        args.run.accum_steps
    );
    if trainer.config().batch_invariant {
        println!("group norm: batch-invariant sums (any micro-batch size gives the same weights)");
    }
    let aug = setup.aug;
    if aug.is_on() {
        let flips = if aug.flip {
            "horizontal flips"
        } else {
            "no flips"
        };
        println!(
            "augmentation: random crops (padding {}), {flips} (seeded per sample and epoch)",
            aug.pad
        );
    }
    if setup.cosine {
        println!(
            "learning rate: cosine to 0 over {total_steps} steps, warm-up {}",
            total_steps / 20
        );
    }
}
