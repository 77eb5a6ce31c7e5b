//! `--config`: a model built from a config alone, with random weights, planned on a device
//! that only plans or trained on seeded random token ids.

use super::run::{make_trainer, train_steps};
use super::setup::{check_flags, invalid, Flags};
use super::Args;
use fitgrad::hf::ModelConfig;
use fitgrad::nn::{Gpt, LanguageModel, Llama};
use fitgrad::train::text::{TextDataset, TokenBatch};
use fitgrad::train::{Plan, TrainModel};
use fitgrad::{Bytes, Device, DeviceOptions, Result};

/// What a `--config` run reports.
#[derive(Clone, Debug, Default)]
pub struct ConfigReport {
    /// The step's plan.
    pub plan: Plan,
    /// The measured peak in use over the steps (none with --plan).
    pub measured_peak: Option<u64>,
    /// The last training loss (none with --plan).
    pub train_loss: Option<f32>,
}

/// `--config`: the architecture built with random weights; with `--plan` on a device that only
/// plans (nothing allocated), else trained `--steps` steps on seeded random token ids.
pub fn run_config(args: &Args) -> Result<ConfigReport> {
    let name = args
        .config
        .as_deref()
        .ok_or_else(|| invalid("run_config needs --config".into()))?;
    let flags = check_flags(args)?;
    let model = ModelConfig::open(name)?.with(flags.precision.param_dtype(), args.seed);
    let (positions, field) = model.positions();
    let context = args.context.unwrap_or(positions);
    if context == 0 || context > positions {
        return Err(invalid(format!(
            "--context {context}: between 1 and the model's {field} = {positions}"
        )));
    }
    if !args.plan && args.steps == 0 {
        return Err(invalid(
            "--config builds a model with random weights: add --plan, or --steps N".into(),
        ));
    }
    if args.checkpoint_activations && matches!(model, ModelConfig::Llama(_)) {
        return Err(invalid(
            "--checkpoint-activations: a Llama's blocks are not checkpointed (yet)".into(),
        ));
    }
    // Windows enough for one effective batch, of seeded random ids.
    let windows = args.batch_size * args.accum_steps;
    let mut rng = fitgrad::tensor::Rng::new(args.seed);
    let vocab = model.vocab_size() as u64;
    let ids = (0..windows + context)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    let train = TextDataset::new(ids, context)?;
    let mut options = DeviceOptions::default().plan_only(args.plan);
    options.adapter = args.adapter.clone();
    options.memory_budget = flags.budget;
    let device = Device::with_options(options)?;
    println!(
        "adapter: {}{}",
        device.info().adapter,
        if args.plan { " (planning only)" } else { "" }
    );
    println!(
        "model: {name} ({}), {} parameters, context {context}, random weights",
        model.describe(),
        model.num_parameters()
    );
    match &model {
        ModelConfig::Gpt2(c) => {
            let build = || Gpt::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
        ModelConfig::Llama(c) => {
            let build = || Llama::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
    }
}

/// [`run_config`] once the model is built.
pub fn config_steps<M>(
    args: &Args,
    flags: &Flags,
    device: &Device,
    train: &TextDataset,
    first: M,
    build_model: &dyn Fn() -> Result<M>,
) -> Result<ConfigReport>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut trainer = make_trainer(
        args,
        flags.precision,
        flags.fit_auto,
        device,
        train,
        first,
        build_model,
    )?;
    let mut report = ConfigReport {
        plan: trainer.plan(train)?,
        ..Default::default()
    };
    print!("{}", report.plan);
    if !args.plan {
        report.train_loss = train_steps(args, &mut trainer, train)?;
        let measured = device.memory_stats().peak_bytes_in_use;
        println!(
            "planned peak in use {} / measured {} ({:+.2}%)",
            Bytes(report.plan.peak),
            Bytes(measured),
            (measured as f64 / report.plan.peak as f64 - 1.0) * 100.0
        );
        report.measured_peak = Some(measured);
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "params": trainer.model.num_parameters(),
                "planned_peak_bytes": report.plan.peak,
                "plan": report.plan,
                "measured_peak_bytes": report.measured_peak,
                "train_loss": report.train_loss,
            })
        );
    }
    Ok(report)
}
