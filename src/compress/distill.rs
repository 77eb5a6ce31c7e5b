//! Knowledge distillation (Hinton et al.): a small student learns from a large teacher's
//! softened outputs as well as from the labels. [`distillation_loss`] is the loss, composed
//! from recorded ops so autograd differentiates it; [`Distill`] wraps a teacher and a student
//! into one model the [`Trainer`](crate::train::Trainer) trains (only the student's
//! parameters are the model's). [`Logits`] is what it needs of each model: logits for a batch,
//! one row per label ([`Labeled`]); any [`Module`] has them for a [`ClassBatch`], a [`Gpt`]
//! for a [`TokenBatch`].

use crate::nn::{self, Gpt, Module};
use crate::train::text::TokenBatch;
use crate::train::{Batch, ClassBatch, EvalBatch, StepContext, TrainModel};
use crate::{DType, Error, Result, Tensor};

/// How the two terms of [`distillation_loss`] are weighed.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DistillConfig {
    /// The soft (teacher) term's weight, in [0, 1]; the labels' term gets `1 - alpha`.
    pub alpha: f32,
    /// The softmax temperature T, a positive number: above 1 it spreads the teacher's
    /// probabilities over the wrong classes, which is what the student learns from.
    pub temperature: f32,
}

impl Default for DistillConfig {
    /// alpha 0.5, T = 4: examples/distill.rs's settings (docs/design-notes.md has what they gave).
    fn default() -> DistillConfig {
        DistillConfig::new(0.5, 4.0)
    }
}

impl DistillConfig {
    /// The soft term's weight `alpha` and the temperature.
    pub fn new(alpha: f32, temperature: f32) -> DistillConfig {
        DistillConfig { alpha, temperature }
    }

    /// Sets the soft term's weight.
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets the temperature.
    pub fn temperature(mut self, temperature: f32) -> Self {
        self.temperature = temperature;
        self
    }

    /// A temperature that is not a positive number or an `alpha` outside [0, 1] (NaN
    /// included) is an [`Error::InvalidArgument`]. [`Distill::new`] and
    /// [`distillation_loss`] call it; a program can call it before it opens a device.
    pub fn validate(&self) -> Result<()> {
        check_settings("DistillConfig", self.alpha, self.temperature)
    }
}

/// alpha in [0, 1], temperature a positive finite number.
fn check_settings(op: &'static str, alpha: f32, temperature: f32) -> Result<()> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("the temperature must be a positive number, got {temperature}"),
        });
    }
    if !(0.0..=1.0).contains(&alpha) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("alpha (the soft term's weight) must be in [0, 1], got {alpha}"),
        });
    }
    Ok(())
}

/// `alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) *
/// CE(student, labels)`, both terms means over the rows (KL summed over classes, as torch's
/// `kl_div(..., reduction="batchmean")`). `student` and `teacher` are logits (N, C) of one
/// dtype family; the teacher is detached (it gets no gradient). T^2 keeps the soft term's
/// gradients at the scale of the hard term's as T grows (they shrink as 1 / T^2).
///
/// Typed errors, all before any device work: a temperature that is not a positive number or
/// an `alpha` outside [0, 1] is an [`Error::InvalidArgument`]; logits that are not 2-D, a
/// teacher of another shape (another output width) or a label count that is not N an
/// [`Error::Shape`]; a label `>= C` an [`Error::InvalidArgument`]; a teacher on another device
/// an [`Error::DeviceMismatch`].
pub fn distillation_loss(
    student: &Tensor,
    teacher: &Tensor,
    labels: &[u32],
    alpha: f32,
    temperature: f32,
) -> Result<Tensor> {
    const OP: &str = "distillation_loss";
    check_settings(OP, alpha, temperature)?;
    if student.rank() != 2 || student.dims() != teacher.dims() {
        return Err(Error::Shape {
            op: OP,
            lhs: student.dims().to_vec(),
            rhs: teacher.dims().to_vec(),
            reason: "student and teacher logits must both be (rows, classes), the teacher's \
                     output as wide as the student's"
                .into(),
        });
    }
    let n = student.dims()[0];
    if labels.len() != n {
        return Err(Error::Shape {
            op: OP,
            lhs: student.dims().to_vec(),
            rhs: vec![labels.len()],
            reason: "one label per row of logits".into(),
        });
    }
    if student.device() != teacher.device() {
        return Err(Error::DeviceMismatch { op: OP });
    }
    // The hard term first: cross_entropy_loss checks the labels' range before its own work,
    // so every check is done before the soft term records anything.
    let hard = student
        .cross_entropy_loss(labels)?
        .mul_scalar(1.0 - alpha)?;
    let teacher = if teacher.dtype() == student.dtype() {
        teacher.detach()
    } else {
        teacher.detach().to_dtype(student.dtype())?
    };
    // (N, C) log-probabilities at temperature T.
    let log_s = student.div_scalar(temperature)?.log_softmax()?;
    let log_t = teacher.div_scalar(temperature)?.log_softmax()?;
    // Sum over rows and classes of p_t (log p_t - log p_s); p_t is a constant, so backward
    // gives d/d log_s = -p_t, and log_softmax's rule turns that into (p_s - p_t) / T per row.
    let kl = log_t.exp()?.mul(&log_t.sub(&log_s)?)?.sum()?;
    let soft = kl.mul_scalar(alpha * temperature * temperature / n.max(1) as f32)?;
    soft.add(&hard)
}

/// A batch with class labels: one per row of the logits a model gives for it ([`Logits`]).
pub trait Labeled: Batch {
    /// The labels, one per row of logits.
    fn labels(&self) -> &[u32];
}

impl Labeled for ClassBatch {
    /// One class per sample.
    fn labels(&self) -> &[u32] {
        &self.y
    }
}

impl Labeled for TokenBatch {
    /// The next token of every (window, position), row-major: `batch * t` labels.
    fn labels(&self) -> &[u32] {
        &self.targets
    }
}

/// What [`Distill`] needs of the teacher and the student: logits (N, C) in f32 for a batch,
/// row `i` for label `i` of [`Labeled::labels`], recorded for autograd where grad is enabled.
pub trait Logits<B> {
    /// The logits of `batch`, in f32.
    fn logits(&self, batch: &B, ctx: &StepContext) -> Result<Tensor>;
}

/// `t` in f32 (a recorded cast, or `t` itself).
fn to_f32(t: Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        Ok(t)
    } else {
        t.to_dtype(DType::F32)
    }
}

impl<M: Module> Logits<ClassBatch> for M {
    /// [`Module::forward`] of the features (so in the parameters' dtype, also under mixed
    /// precision), cast to f32.
    fn logits(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        let x = b.x.to_device(&ctx.device)?;
        to_f32(self.forward(&x)?)
    }
}

impl Logits<TokenBatch> for Gpt {
    /// The next-token logits of every position, (batch * t, vocab), in the step's dtype
    /// (f16 under mixed precision), returned in f32.
    fn logits(&self, b: &TokenBatch, ctx: &StepContext) -> Result<Tensor> {
        let logits = self.forward_ids_in(&b.ids, b.batch, b.t, ctx.dtype)?;
        let v = logits.dims().last().copied().unwrap_or(0);
        logits.reshape(&[b.batch * b.t, v])
    }
}

/// A student trained from a teacher: as a [`Module`] it is the student (its forward, its
/// parameters: the optimizer and checkpoints see only those); as a [`TrainModel`] its loss is
/// [`distillation_loss`] of the two models' [`Logits`] on the batch, the teacher's computed
/// under `no_grad` (no graph, nothing saved for backward) and dropped when the step's
/// backward frees the graph (the loss holds only `softmax(teacher / T)`, until then).
///
/// The teacher is put in eval mode (dropout off) and stays there: [`Module::set_training`]
/// reaches the student only. Evaluation reports the student alone: its cross-entropy on the
/// labels and, when there is one label per sample, its right predictions.
///
/// A teacher whose output is not as wide as the student's is an [`Error::Shape`] at the
/// first step, before the loss records anything (only the models' logits know their width).
///
/// ```no_run
/// use fitgrad::compress::{Distill, DistillConfig};
/// use fitgrad::nn::{Activation, Mlp, Module};
/// use fitgrad::optim::AdamW;
/// use fitgrad::train::{Trainer, TrainerConfig};
/// # fn f(dev: &fitgrad::Device, teacher: Mlp) -> fitgrad::Result<()> {
/// let student = Mlp::new(dev, &[64, 32, 10], Activation::Relu, 1)?;
/// let model = Distill::new(teacher, student, DistillConfig::new(0.5, 4.0))?;
/// let opt = AdamW::new(model.parameters(), 3e-3)?; // the student's
/// let trainer = Trainer::new(model, Box::new(opt), TrainerConfig::new(64, 1, 3e-3))?;
/// # Ok(()) }
/// ```
pub struct Distill<T, S> {
    /// The trained model whose outputs the student learns from (never updated).
    pub teacher: T,
    /// The model being trained.
    pub student: S,
    /// The loss's weight and temperature (checked again by every loss).
    pub config: DistillConfig,
}

impl<T: Module, S: Module> Distill<T, S> {
    /// Checks `config` ([`DistillConfig::validate`]: an [`Error::InvalidArgument`]) and puts
    /// the teacher in eval mode.
    pub fn new(teacher: T, student: S, config: DistillConfig) -> Result<Distill<T, S>> {
        config.validate()?;
        teacher.set_training(false);
        Ok(Distill {
            teacher,
            student,
            config,
        })
    }
}

impl<T: Module, S: Module> Module for Distill<T, S> {
    /// The student's forward.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.student.forward(x)
    }

    /// The student's parameters only.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.student.named_parameters()
    }

    /// The student's configuration (a checkpoint of a `Distill` is the student's).
    fn config(&self) -> Vec<(String, String)> {
        self.student.config()
    }

    /// Reaches the student only: the teacher stays in eval mode.
    fn set_training(&self, training: bool) {
        self.student.set_training(training);
    }
}

impl<B, T, S> TrainModel<B> for Distill<T, S>
where
    B: Labeled,
    T: Module + Logits<B>,
    S: Module + Logits<B>,
{
    fn forward_loss(&self, b: &B, ctx: &StepContext) -> Result<Tensor> {
        let teacher = {
            let _g = crate::no_grad();
            self.teacher.logits(b, ctx)?
        };
        let student = self.student.logits(b, ctx)?;
        distillation_loss(
            &student,
            &teacher,
            b.labels(),
            self.config.alpha,
            self.config.temperature,
        )
    }

    /// The student alone, as it will be used: its cross-entropy on the labels, and its right
    /// predictions where the batch has one label per sample.
    fn evaluate_batch(&self, b: &B, ctx: &StepContext) -> Result<EvalBatch> {
        let logits = self.student.logits(b, ctx)?;
        let labels = b.labels();
        Ok(EvalBatch {
            loss: nn::cross_entropy(&logits, labels)?.item()?,
            correct: if labels.len() == b.len() {
                Some(nn::correct(&logits, labels)?)
            } else {
                None
            },
        })
    }
}
