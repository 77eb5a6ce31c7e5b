//! The memory timeline: a recorded step's peak equals the arena's `peak_bytes_in_use` for that
//! step exactly, the roles replayed from its events add up to every event's bytes in use, and
//! the planner's timeline of the same step (recorded before the step ran) matches it within
//! 2% — on an Mlp (one batch; three accumulated micro-batches; mixed precision, where packed
//! f16 stages outputs through f32 temporaries) and on a custom model written with `module!`.
//! Off, nothing is recorded.
//!
//! Each test opens a device of its own on its backend, so no other test's tensors show in the
//! statistics.

use crate::common;

use common::*;
use fitgrad::memory::{EventKind, Role, SizeClass, Timeline};
use fitgrad::nn::{Activation, Linear, Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::train::{
    BatchSource, HostRows, Precision, StepContext, TensorBatch, TensorDataset, TrainModel, Trainer,
    TrainerConfig,
};
use fitgrad::{Bytes, DType, Device, DeviceOptions, Error, Result, Tensor};
use std::io::Write;

device_tests!(
    timeline_of_mlp_steps,
    timeline_of_custom_model_step,
    timeline_off_records_nothing
);

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// A device of its own on `dev`'s backend, with `dev`'s f16 mode.
fn fresh_like(dev: &Device) -> Device {
    let info = dev.info();
    Device::with_options(
        DeviceOptions::default()
            .backend(info.adapter.backend.clone())
            .force_packed_f16(!info.f16_native),
    )
    .unwrap()
}

/// Plans the next step's timeline, then runs the step on `data` over `idx` recording it:
/// (planned, measured, the arena's peak in use of the step).
fn planned_and_recorded<M, D>(
    t: &mut Trainer<M>,
    data: &D,
    idx: &[usize],
) -> (Timeline, Timeline, u64)
where
    M: Module + TrainModel<D::Batch>,
    D: BatchSource,
{
    let dev = t.device().clone();
    let (plan, planned) = t.plan_timeline(data).unwrap();
    assert_eq!(
        planned.peak(),
        plan.peak,
        "the plan and its timeline disagree"
    );
    dev.sync().unwrap();
    dev.reset_peak();
    dev.start_timeline().unwrap();
    t.step(data, idx).unwrap();
    let whole = dev.take_timeline().unwrap();
    let peak = dev.memory_stats().peak_bytes_in_use;
    assert_eq!(whole.steps(), 1, "one step was recorded");
    (planned, whole.last_step().unwrap(), peak)
}

/// Checks one recorded step against the arena and the plan; returns a line of figures.
fn check_step(what: &str, planned: &Timeline, measured: &Timeline, arena_peak: u64) -> String {
    assert!(measured.is_consistent(), "{what}: roles do not add up");
    assert!(
        planned.is_consistent(),
        "{what}: planned roles do not add up"
    );
    assert!(planned.planned && !measured.planned);
    // The peak, exactly.
    assert_eq!(
        measured.peak(),
        arena_peak,
        "{what}: the timeline's peak is not the arena's"
    );
    // Markers: the step and its phases.
    let phases: Vec<String> = measured.phases().into_iter().map(|p| p.name).collect();
    for p in ["forward", "backward", "optimizer step"] {
        assert!(
            phases.iter().any(|q| q == p),
            "{what}: no {p} in {phases:?}"
        );
    }
    assert_eq!(measured.events.first().unwrap().kind, EventKind::StepStart);
    assert_eq!(measured.events.last().unwrap().kind, EventKind::StepEnd);
    // Roles: activations come and go, gradients are adopted by the parameters.
    let allocs = |role: Role| {
        measured
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Alloc { role: r, .. } if r == role))
            .count()
    };
    assert!(allocs(Role::Activation) > 0, "{what}: no activation");
    assert!(
        measured.events.iter().any(|e| matches!(
            e.kind,
            EventKind::Retag {
                to: Role::Gradient,
                ..
            }
        )),
        "{what}: no gradient adopted"
    );
    assert!(measured.events.iter().all(|e| match e.kind {
        EventKind::Alloc {
            requested,
            size,
            class,
            ..
        } => size >= requested && size % 256 == 0 && class == SizeClass::of(size),
        _ => true,
    }));
    // The peak is named after a real op of the step.
    let op = measured.peak_op().expect("the peak has an op");
    assert!(!op.is_empty() && measured.peak_event().is_some());
    // The planner's timeline: the same ops, the same events, within 2% at every event.
    let peak_ratio = planned.peak() as f64 / measured.peak() as f64;
    assert!(
        (peak_ratio - 1.0).abs() <= 0.02,
        "{what}: planned peak {} measured {}",
        Bytes(planned.peak()),
        Bytes(measured.peak())
    );
    assert_eq!(planned.ops, measured.ops, "{what}: planned ops differ");
    assert_eq!(planned.events.len(), measured.events.len(), "{what}");
    let worst = planned
        .events
        .iter()
        .zip(&measured.events)
        .map(|(p, m)| (p.in_use as f64 - m.in_use as f64).abs() / measured.peak() as f64)
        .fold(0.0, f64::max);
    assert!(
        worst <= 0.02,
        "{what}: an event differs by {worst:.4} of the peak"
    );
    format!(
        "{what}: {} ops, {} events; peak {} (arena {}) at {op}; planned peak {} (ratio \
         {peak_ratio:.4}), worst event {:.4}% of the peak",
        measured.ops.len(),
        measured.events.len(),
        Bytes(measured.peak()),
        Bytes(arena_peak),
        Bytes(planned.peak()),
        100.0 * worst
    )
}

/// Host rows of `n` samples with `dim` features and `classes` labels.
fn rows(n: usize, dim: usize, classes: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let x = host_data(seed, n * dim, -1.0, 1.0);
    let y = (0..n).map(|i| (i * 7 % classes) as u32).collect();
    (x, y)
}

/// An Mlp: a whole batch with AdamW; three accumulated micro-batches with SGD and momentum;
/// mixed precision with odd widths (packed f16 stages those outputs).
fn timeline_of_mlp_steps(dev: &Device) {
    let dev = fresh_like(dev);
    let mut lines = Vec::new();
    for (label, widths, batch, micro, precision) in [
        ("mlp adamw", vec![16, 32, 4], 24, None, Precision::F32),
        (
            "mlp sgd 3 micro-batches",
            vec![16, 32, 4],
            24,
            Some(8),
            Precision::F32,
        ),
        ("mlp mixed", vec![15, 33, 5], 16, None, Precision::Mixed),
    ] {
        let model = Mlp::new(&dev, &widths, Activation::Relu, 3).unwrap();
        let opt: Box<dyn Optimizer> = if micro.is_some() {
            Box::new(
                Sgd::new(model.parameters(), 0.05)
                    .unwrap()
                    .momentum(0.9)
                    .unwrap(),
            )
        } else {
            Box::new(AdamW::new(model.parameters(), 1e-3).unwrap())
        };
        let config = TrainerConfig::new(batch, 1, 1e-3).precision(precision);
        let mut t = Trainer::new(model, opt, config).unwrap();
        if let Some(m) = micro {
            t.set_micro_batch(m).unwrap();
        }
        let (x, y) = rows(batch, widths[0], *widths.last().unwrap(), 5);
        let data = HostRows::new(&x, &y).unwrap();
        let idx: Vec<usize> = (0..batch).collect();
        t.step(&data, &idx).unwrap(); // makes the optimizer state
        let (planned, measured, arena_peak) = planned_and_recorded(&mut t, &data, &idx);
        lines.push(check_step(label, &planned, &measured, arena_peak));
        // The parameters are there from the start, counted as parameters.
        assert_eq!(measured.start.parameter, t.model.parameter_bytes());
        let staged = measured.events.iter().any(|e| {
            matches!(
                e.kind,
                EventKind::Alloc {
                    role: Role::Staging,
                    ..
                }
            )
        });
        if precision == Precision::Mixed && !dev.info().f16_native {
            assert!(staged, "packed f16 with odd widths stages outputs");
        }
        if precision == Precision::F32 {
            assert!(!staged, "{label}: f32 stages nothing");
        }
        if micro.is_some() {
            let forwards = measured
                .events
                .iter()
                .filter(
                    |e| matches!(&e.kind, EventKind::PhaseStart { phase } if phase == "forward"),
                )
                .count();
            assert_eq!(forwards, 3, "one forward per micro-batch");
        }
    }
    note(&format!("[{}]\n{}", label(&dev), lines.join("\n")));
}

/// x + fc2(tanh(fc1(x))): (B, C) -> (B, C).
struct Block {
    fc1: Linear,
    fc2: Linear,
}

fitgrad::module! {
    impl Module for Block {
        params { fc1, fc2 }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            x.add(&self.fc2.forward(&self.fc1.forward(x)?.tanh()?)?)
        }
    }
}

/// stem, residual blocks, head: (B, 12) -> (B, 3).
struct Regressor {
    stem: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

fitgrad::module! {
    impl Module for Regressor {
        params { stem, blocks, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.head.forward(&self.blocks.forward(&self.stem.forward(x)?)?)
        }
    }
}

impl TrainModel<TensorBatch> for Regressor {
    fn forward_loss(&self, b: &TensorBatch, ctx: &StepContext) -> Result<Tensor> {
        let (x, y) = b.to_device(&ctx.device)?;
        fitgrad::nn::mse_loss(&self.forward(&x)?, &y)
    }
}

/// A custom model with AdamW and two accumulated micro-batches.
fn timeline_of_custom_model_step(dev: &Device) {
    let dev = fresh_like(dev);
    let lin = |i, o, s| Linear::with_options(&dev, i, o, true, DType::F32, s).unwrap();
    let model = Regressor {
        stem: lin(12, 24, 1),
        blocks: (0..2)
            .map(|k| Block {
                fc1: lin(24, 24, 10 + k),
                fc2: lin(24, 24, 20 + k),
            })
            .collect(),
        head: lin(24, 3, 3),
    };
    let opt = Box::new(AdamW::new(model.parameters(), 3e-3).unwrap());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(20, 1, 3e-3)).unwrap();
    t.set_micro_batch(10).unwrap();
    let n = 20;
    let x = host_data(7, n * 12, -1.0, 1.0);
    let y = host_data(8, n * 3, -1.0, 1.0);
    let data = TensorDataset::new(x, &[12], y, &[3]).unwrap();
    let idx: Vec<usize> = (0..n).collect();
    t.step(&data, &idx).unwrap();
    let (planned, measured, arena_peak) = planned_and_recorded(&mut t, &data, &idx);
    let line = check_step("custom model", &planned, &measured, arena_peak);
    assert!(measured.start.optimizer_state > 0, "AdamW's moments exist");
    note(&format!("[{}]\n{line}", label(&dev)));
}

/// Off: nothing is recorded; a started timeline is taken once; two at once are refused.
fn timeline_off_records_nothing(dev: &Device) {
    let dev = fresh_like(dev);
    let model = Mlp::new(&dev, &[16, 32, 4], Activation::Relu, 1).unwrap();
    let opt = Box::new(AdamW::new(model.parameters(), 1e-3).unwrap());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(24, 1, 1e-3)).unwrap();
    let (x, y) = rows(24, 16, 4, 2);
    let data = HostRows::new(&x, &y).unwrap();
    let idx: Vec<usize> = (0..24).collect();
    t.step(&data, &idx).unwrap();
    t.plan(&data).unwrap();
    assert!(dev.take_timeline().is_none(), "recorded while off");
    dev.start_timeline().unwrap();
    assert!(matches!(
        dev.start_timeline(),
        Err(Error::InvalidArgument { .. })
    ));
    let empty = dev.take_timeline().unwrap();
    assert!(empty.events.is_empty() && empty.ops.is_empty());
    assert_eq!(empty.start_in_use(), dev.memory_stats().bytes_in_use);
    t.step(&data, &idx).unwrap();
    assert!(
        dev.take_timeline().is_none(),
        "recording went on after take"
    );
    // A plan records on its own arena only when asked: the real arena stays off.
    t.plan_timeline(&data).unwrap();
    assert!(dev.take_timeline().is_none());
}
