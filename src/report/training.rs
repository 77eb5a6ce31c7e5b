//! The data of a training report ([`TrainingReport`]), filled as a run goes, its JSON, and
//! [`StepCapture`], which records one step's memory timeline beside the planner's.
//!
//! Values that can be NaN in a run (a loss before any step) are left out rather than stored,
//! so the JSON (which has no NaN) reads back to the same report.

use crate::memory::Timeline;
use crate::nn::Module;
use crate::train::{BatchSource, Evaluation, FitChoice, Plan, TrainEvent, TrainModel, Trainer};
use crate::{Bytes, Device, Error, MemoryStats, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One logged point of the training loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPoint {
    /// Optimizer steps done.
    pub step: u64,
    /// Mean training loss of the steps since the previous point.
    pub loss: f32,
    /// Samples (or tokens) per second so far in the epoch, where measured.
    pub throughput: Option<f64>,
}

/// One evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Optimizer steps done when it ran.
    pub step: u64,
    /// The epoch it ended, for per-epoch evaluations.
    pub epoch: Option<u64>,
    /// What was evaluated ("test", "validation").
    pub split: String,
    /// Mean loss.
    pub loss: f32,
    /// Fraction right, for classifiers.
    pub accuracy: Option<f32>,
}

/// One epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochPoint {
    /// The epoch (0-based).
    pub epoch: u64,
    /// Optimizer steps done at its end.
    pub steps: u64,
    /// Mean training loss of its last logged steps.
    pub train_loss: Option<f32>,
    /// Samples (or tokens) per second over the epoch.
    pub throughput: Option<f64>,
    /// Seconds it took.
    pub seconds: f64,
}

/// The memory of one training step: measured while it ran, and planned before it ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMemory {
    /// The optimizer step recorded (0-based).
    pub step: u64,
    /// What the arena recorded while the step ran.
    pub measured: Timeline,
    /// What the dry-run planner recorded for the same step before it ran.
    pub planned: Timeline,
    /// The planner's figures for that step.
    pub plan: Plan,
    /// Host memory the trainer held for the step (optimizer offload, streamed parameters):
    /// not device memory; 0 when everything is on the device.
    #[serde(default)]
    pub host_bytes: u64,
    /// Bytes the step moved between host and device (streamed parameters up and gradients
    /// back as counted by the streaming, plus the offloaded optimizer's gradients read back
    /// and parameters uploaded).
    #[serde(default)]
    pub bytes_moved: u64,
}

impl StepMemory {
    /// Planned peak over measured peak (1.0: exact).
    pub fn ratio(&self) -> f64 {
        self.planned.peak() as f64 / self.measured.peak().max(1) as f64
    }
}

/// A memory budget and what was chosen to fit it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetFit {
    /// The budget on reserved bytes.
    pub budget: u64,
    /// Samples per batch (kept).
    pub batch_size: usize,
    /// Samples per forward/backward chosen.
    pub micro_batch: usize,
    /// The strategy in words.
    pub strategy: String,
    /// Every candidate `--fit auto` planned, when it chose.
    pub fit: Option<FitChoice>,
}

/// Everything a report page shows about one training run (see the module docs of
/// `fitgrad::report`). Fields are public to read; build one with [`TrainingReport::new`] and
/// the methods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TrainingReport {
    /// What ran ("train_mlp on digits").
    pub title: String,
    /// The fitgrad version.
    pub fitgrad_version: String,
    /// The adapter: name, backend, driver, memory, f16, subgroups, limits.
    pub adapter: Vec<(String, String)>,
    /// The run's settings, in the order given.
    pub settings: Vec<(String, String)>,
    /// Final figures (test accuracy, validation loss, ...), in the order given.
    pub results: Vec<(String, String)>,
    /// The unit of the throughput figures ("samples/s", "tokens/s").
    pub throughput_unit: String,
    /// The training loss as logged.
    pub steps: Vec<StepPoint>,
    /// Evaluations.
    pub evals: Vec<EvalPoint>,
    /// Epochs.
    pub epochs: Vec<EpochPoint>,
    /// One step's memory timeline, measured and planned.
    pub step_memory: Option<StepMemory>,
    /// The plan of a step made before training.
    pub plan: Option<Plan>,
    /// The arena's statistics at the end of training.
    pub memory: Option<MemoryStats>,
    /// What the trainer changed on its own (out-of-memory retries, loss scaling).
    pub events: Vec<TrainEvent>,
    /// The budget and what fitted it, when one was given.
    pub budget: Option<BudgetFit>,
}

fn finite(v: f32) -> Option<f32> {
    v.is_finite().then_some(v)
}

fn finite64(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

impl TrainingReport {
    /// An empty report titled `title` of a run on `device`, throughput in `unit`.
    pub fn new(title: impl Into<String>, device: &Device, unit: &str) -> TrainingReport {
        let info = device.info();
        let a = &info.adapter;
        let mut adapter = vec![
            ("name".to_string(), a.name.clone()),
            ("vendor".into(), a.vendor_name.to_string()),
            ("backend".into(), a.backend.clone()),
            ("type".into(), a.device_type.clone()),
            (
                "driver".into(),
                format!("{} {}", a.driver, a.driver_info).trim().to_string(),
            ),
            (
                "device memory".into(),
                a.memory
                    .map_or("not reported".into(), |m| Bytes(m).to_string()),
            ),
            (
                "f16".into(),
                if info.f16_native {
                    "native (SHADER_F16)".into()
                } else {
                    "packed in u32, computed in f32".into()
                },
            ),
            (
                "subgroups".into(),
                info.subgroup_size
                    .map_or("none of fixed size".into(), |n| format!("{n} lanes")),
            ),
        ];
        let l = &info.limits;
        adapter.push((
            "limits".into(),
            format!(
                "buffer {}, storage binding {}, workgroup storage {}",
                Bytes(l.max_buffer_size),
                Bytes(l.max_storage_buffer_binding_size),
                Bytes(l.max_compute_workgroup_storage_size as u64)
            ),
        ));
        TrainingReport {
            title: title.into(),
            fitgrad_version: env!("CARGO_PKG_VERSION").into(),
            adapter,
            settings: Vec::new(),
            results: Vec::new(),
            throughput_unit: unit.into(),
            steps: Vec::new(),
            evals: Vec::new(),
            epochs: Vec::new(),
            step_memory: None,
            plan: None,
            memory: None,
            events: Vec::new(),
            budget: None,
        }
    }

    /// Adds a setting of the run.
    pub fn setting(&mut self, key: &str, value: impl ToString) -> &mut Self {
        self.settings.push((key.into(), value.to_string()));
        self
    }

    /// Adds a final figure.
    pub fn result(&mut self, key: &str, value: impl ToString) -> &mut Self {
        self.results.push((key.into(), value.to_string()));
        self
    }

    /// Logs the training loss after `step` steps (left out when not finite).
    pub fn log_step(&mut self, step: u64, loss: f32, throughput: Option<f64>) {
        if let Some(loss) = finite(loss) {
            self.steps.push(StepPoint {
                step,
                loss,
                throughput: throughput.and_then(finite64),
            });
        }
    }

    /// Logs an evaluation after `step` steps (left out when its loss is not finite).
    pub fn log_eval(&mut self, step: u64, epoch: Option<u64>, split: &str, e: &Evaluation) {
        if let Some(loss) = finite(e.loss) {
            self.evals.push(EvalPoint {
                step,
                epoch,
                split: split.into(),
                loss,
                accuracy: e.accuracy.and_then(finite),
            });
        }
    }

    /// Logs an epoch that ended after `steps` steps.
    pub fn log_epoch(&mut self, epoch: u64, steps: u64, loss: f32, throughput: f64, secs: f64) {
        self.epochs.push(EpochPoint {
            epoch,
            steps,
            train_loss: finite(loss),
            throughput: finite64(throughput),
            seconds: if secs.is_finite() { secs } else { 0.0 },
        });
    }

    /// Adds what the trainer changed on its own.
    pub fn add_events(&mut self, events: &[TrainEvent]) {
        self.events.extend_from_slice(events);
    }

    /// Records the budget and what fitted it: `fit` from `--fit auto`, else the micro-batch
    /// the budget chose.
    pub fn set_budget(&mut self, budget: u64, batch: usize, micro: usize, fit: Option<FitChoice>) {
        let strategy = match &fit {
            Some(f) => f
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("fit auto, ")
                .to_string(),
            None if micro >= batch => format!("the whole batch of {batch} fits"),
            None => format!(
                "micro-batches of {micro} of each batch of {batch} ({} per batch, gradients \
                 accumulated: the same update)",
                batch.div_ceil(micro)
            ),
        };
        self.budget = Some(BudgetFit {
            budget,
            batch_size: batch,
            micro_batch: micro,
            strategy,
            fit,
        });
    }

    /// Records the plan of a step made before training.
    pub fn set_plan(&mut self, plan: Plan) {
        self.plan = Some(plan);
    }

    /// Records the arena's statistics at the end of training.
    pub fn set_memory(&mut self, stats: MemoryStats) {
        self.memory = Some(stats);
    }

    /// Records one step's memory (from [`StepCapture::finish`]).
    pub fn set_step_memory(&mut self, memory: Option<StepMemory>) {
        self.step_memory = memory;
    }

    /// The JSON of the report (pretty-printed).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report holds only finite numbers and text")
    }

    /// A report read back from [`TrainingReport::to_json`]'s text.
    pub fn from_json(text: &str) -> Result<TrainingReport> {
        serde_json::from_str(text).map_err(|e| Error::Data {
            path: "<report json>".into(),
            reason: e.to_string(),
        })
    }

    /// Writes [`TrainingReport::to_json`] to `path`, atomically.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, self.to_json().as_bytes())
    }
}

/// Records one training step's memory for a report: after the first step of a run it plans
/// the next step with its timeline ([`Trainer::plan_timeline`]) and starts recording; after
/// that step it stops and keeps both. Call [`StepCapture::after_step`] after every step.
#[derive(Default)]
pub struct StepCapture {
    state: State,
}

#[derive(Default)]
enum State {
    #[default]
    Waiting,
    Recording {
        device: Device,
        step: u64,
        planned: Timeline,
        plan: Plan,
    },
    Done(StepMemory),
}

impl StepCapture {
    /// A capture of the second step from now (the first makes the optimizer state, so the
    /// second is the steady state).
    pub fn new() -> StepCapture {
        StepCapture::default()
    }

    /// Advances after a step of `trainer` (whose batches come from `data`).
    pub fn after_step<M, D>(&mut self, trainer: &mut Trainer<M>, data: &D) -> Result<()>
    where
        M: Module + TrainModel<D::Batch>,
        D: BatchSource,
    {
        match std::mem::take(&mut self.state) {
            State::Waiting => {
                let (plan, planned) = trainer.plan_timeline(data)?;
                let device = trainer.device().clone();
                trainer.take_bytes_moved();
                device.start_timeline()?;
                self.state = State::Recording {
                    device,
                    step: trainer.steps(),
                    planned,
                    plan,
                };
            }
            State::Recording {
                device,
                step,
                planned,
                plan,
            } => {
                let bytes_moved =
                    trainer.take_bytes_moved().total() + trainer.offload_bytes_moved();
                self.state = match device.take_timeline().and_then(|t| t.last_step()) {
                    Some(measured) => State::Done(StepMemory {
                        step,
                        measured,
                        planned,
                        plan,
                        host_bytes: trainer.memory_summary().host_bytes,
                        bytes_moved,
                    }),
                    None => State::Waiting,
                };
            }
            done => self.state = done,
        }
        Ok(())
    }

    /// The step's memory, once recorded (a recording still open is stopped and dropped).
    pub fn finish(self) -> Option<StepMemory> {
        match self.state {
            State::Done(m) => Some(m),
            State::Recording { device, .. } => {
                device.take_timeline();
                None
            }
            State::Waiting => None,
        }
    }
}
