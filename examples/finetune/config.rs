//! `--config`: a model built from a config alone, with random weights, planned on a device
//! that only plans or trained on seeded random token ids.

use super::run::{make_trainer, optimizer_for, train_steps, trainer_config};
use super::setup::{check_flags, invalid, lora_spec, Flags};
use super::Args;
use fitgrad::compress::{quantize_gpt_base, quantize_llama_base, BaseQuant};
use fitgrad::hf::{add_lora, resolve_llama_targets, resolve_targets, LoraSpec, ModelConfig};
use fitgrad::nn::{Gpt, LanguageModel, Llama};
use fitgrad::train::text::{TextDataset, TokenBatch};
use fitgrad::train::{Plan, TrainModel, Trainer};
use fitgrad::{Bytes, Device, DeviceOptions, Result};

/// What a `--config` run reports.
#[derive(Clone, Debug, Default)]
pub struct ConfigReport {
    /// The step's plan.
    pub plan: Plan,
    /// The measured peak in use over the steps (none with --plan).
    pub measured_peak: Option<u64>,
    /// The measured peak in use of the first step (none with --plan).
    pub measured_first_step_peak: Option<u64>,
    /// The last training loss (none with --plan).
    pub train_loss: Option<f32>,
    /// Under LoRA with `--plan`: the ladder's rungs (base, checkpointing) and planned peaks.
    pub candidates: Vec<(String, bool, u64)>,
    /// Under LoRA: the plan of a step fine-tuning the whole model instead, for comparison.
    pub full_plan: Option<Plan>,
    /// The trained model's parameters.
    pub params: usize,
}

/// `--config`: the architecture built with random weights; with `--plan` on a device that only
/// plans (nothing allocated), else trained `--steps` steps on seeded random token ids.
pub fn run_config(args: &Args) -> Result<ConfigReport> {
    let name = args
        .config
        .as_deref()
        .ok_or_else(|| invalid("run_config needs --config".into()))?;
    let flags = check_flags(args)?;
    let model = ModelConfig::open(name)?.with(flags.precision.param_dtype(), args.run.seed);
    let (positions, field) = model.positions();
    let context = args.context.unwrap_or(positions);
    if context == 0 || context > positions {
        return Err(invalid(format!(
            "--context {context}: between 1 and the model's {field} = {positions}"
        )));
    }
    if !args.run.plan && args.steps == 0 {
        return Err(invalid(
            "--config builds a model with random weights: add --plan, or --steps N".into(),
        ));
    }
    let lora = config_lora(args, &model)?;
    // Windows enough for one effective batch, of seeded random ids.
    let windows = args.batch_size * args.run.accum_steps;
    let mut rng = fitgrad::tensor::Rng::new(args.run.seed);
    let vocab = model.vocab_size() as u64;
    let ids = (0..windows + context)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    let train = TextDataset::new(ids, context)?;
    let mut options = DeviceOptions::default().plan_only(args.run.plan);
    options.adapter = args.run.adapter.clone();
    options.memory_budget = flags.budget;
    let device = Device::with_options(options)?;
    println!(
        "adapter: {}{}",
        device.info().adapter,
        if args.run.plan {
            " (planning only)"
        } else {
            ""
        }
    );
    println!(
        "model: {name} ({}), {} parameters, context {context}, random weights",
        model.describe(),
        model.num_parameters()
    );
    let report = match (&model, lora) {
        (ModelConfig::Gpt2(c), Some((spec, quant))) => {
            let build = |d: &Device, q: Option<BaseQuant>| -> Result<Gpt> {
                let mut gpt = Gpt::new(d, c.clone())?;
                if let Some(q) = q {
                    add_lora(&mut gpt, &spec, args.run.seed)?;
                    quantize_gpt_base(&mut gpt, q)?;
                }
                Ok(gpt)
            };
            config_lora_steps(args, &flags, &device, &train, &spec, quant, &build)
        }
        (ModelConfig::Llama(c), Some((spec, quant))) => {
            let build = |d: &Device, q: Option<BaseQuant>| -> Result<Llama> {
                let mut llama = Llama::new(d, c.clone())?;
                if let Some(q) = q {
                    add_lora(&mut llama, &spec, args.run.seed)?;
                    quantize_llama_base(&mut llama, q)?;
                }
                Ok(llama)
            };
            config_lora_steps(args, &flags, &device, &train, &spec, quant, &build)
        }
        (ModelConfig::Gpt2(c), None) => {
            let build = || Gpt::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
        (ModelConfig::Llama(c), None) => {
            let build = || Llama::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
    }?;
    // The JSON ends stdout: after every plan printed, the full fine-tune's included.
    if args.run.json {
        println!(
            "{}",
            serde_json::json!({
                "params": report.params,
                "planned_peak_bytes": report.plan.peak,
                "plan": report.plan,
                "measured_peak_bytes": report.measured_peak,
                "measured_first_step_peak_bytes": report.measured_first_step_peak,
                "train_loss": report.train_loss,
            })
        );
    }
    Ok(report)
}

/// The LoRA flags of a `--config` run, checked against its architecture on the host: the
/// adapters and the frozen base's format, or none without `--lora-rank`.
fn config_lora(args: &Args, model: &ModelConfig) -> Result<Option<(LoraSpec, BaseQuant)>> {
    let quant: BaseQuant = args.quantize.parse()?;
    if args.lora_rank.is_none() {
        let lora_only = [
            ("--lora-alpha", args.lora_alpha.is_some()),
            ("--lora-dropout", args.lora_dropout.is_some()),
            ("--lora-targets", args.lora_targets.is_some()),
            ("--quantize", quant != BaseQuant::None),
        ];
        if let Some((flag, _)) = lora_only.iter().find(|(_, g)| *g) {
            return Err(invalid(format!(
                "{flag} is a LoRA setting: add --lora-rank R"
            )));
        }
    }
    let folders = [
        ("--resume-adapter", args.resume_adapter.is_some()),
        ("--save-adapter", args.save_adapter.is_some()),
        ("--merge-into", args.merge_into.is_some()),
    ];
    if let Some((flag, _)) = folders.iter().find(|(_, g)| *g) {
        return Err(invalid(format!(
            "{flag}: --config builds random weights; adapters are read and written with --model DIR"
        )));
    }
    if args.lora_rank.is_none() {
        return Ok(None);
    }
    if quant != BaseQuant::None && args.run.precision == "f16" {
        return Err(invalid(format!(
            "--quantize {quant} quantizes f32 weights: use --precision f32 or mixed"
        )));
    }
    let defaults = match model {
        ModelConfig::Gpt2(_) => super::setup::GPT2_LORA_TARGETS,
        ModelConfig::Llama(_) => super::setup::LLAMA_LORA_TARGETS,
    };
    let spec = lora_spec(args, defaults)?;
    match model {
        ModelConfig::Gpt2(c) => resolve_targets(c, &spec)?,
        ModelConfig::Llama(c) => resolve_llama_targets(c, &spec)?,
    };
    Ok(Some((spec, quant)))
}

/// A `--config` model under LoRA: the frozen base held as `quant`. `model` builds it on a
/// device, with the adapters and the base held as given, or dense and whole with `None`. With
/// `--plan`, every rung of `--fit auto`'s LoRA ladder (dense, int8 and NF4 bases, each without
/// and, where the model checkpoints, with checkpointing) is planned and printed; with `--fit
/// auto` and no `--quantize` the budget chooses among them.
fn config_lora_steps<M>(
    args: &Args,
    flags: &Flags,
    device: &Device,
    train: &TextDataset,
    spec: &LoraSpec,
    quant: BaseQuant,
    model: &dyn Fn(&Device, Option<BaseQuant>) -> Result<M>,
) -> Result<ConfigReport>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let config = trainer_config(args, flags.precision);
    let build = |q: BaseQuant, checkpointing: bool| -> Result<Option<Trainer<M>>> {
        let mut m = model(device, Some(q))?;
        if !m.set_checkpointing(checkpointing) && checkpointing {
            return Ok(None);
        }
        let optimizer = optimizer_for(args, &m)?;
        Trainer::new(m, optimizer, config.clone()).map(Some)
    };
    let some = |t: Result<Option<Trainer<M>>>| {
        t?.ok_or_else(|| invalid("--checkpoint-activations: this model does not checkpoint".into()))
    };
    let bases = [
        BaseQuant::None,
        BaseQuant::Int8,
        BaseQuant::Nf4 { double_quant: true },
    ];
    let mut ladder = Vec::new();
    if args.run.plan && !flags.fit_auto {
        // The ladder without a budget: each rung's planned peak.
        let budget = device.memory_stats().budget;
        device.set_memory_budget(None)?;
        println!(
            "LoRA candidates (r = {}, targets {:?}):",
            spec.config.r, spec.targets
        );
        let mut candidates = Vec::new();
        for q in bases {
            for checkpointing in [false, true] {
                let Some(mut trainer) = build(q, checkpointing)? else {
                    continue;
                };
                let plan = trainer.plan(train)?;
                println!(
                    "  base {:<10} checkpointing {:<3}  planned peak {}",
                    q.to_string(),
                    if checkpointing { "on" } else { "off" },
                    Bytes(plan.peak)
                );
                candidates.push((q.to_string(), checkpointing, plan.peak));
            }
        }
        device.set_memory_budget(budget)?;
        ladder = candidates;
    }
    let mut trainer = if flags.fit_auto && quant == BaseQuant::None {
        let (trainer, choice) = Trainer::build_fit_auto_variants(device, train, &bases, |q| {
            some(build(*q, args.fit.checkpoint_activations))
        })?;
        print!("{choice}");
        trainer
    } else if flags.fit_auto {
        let (trainer, choice) = Trainer::build_fit_auto(device, train, || {
            some(build(quant, args.fit.checkpoint_activations))
        })?;
        print!("{choice}");
        trainer
    } else {
        let mut trainer = Trainer::build_within_budget(device, train, || {
            some(build(quant, args.fit.checkpoint_activations))
        })?;
        trainer.check_device_memory(train)?;
        trainer
    };
    // Loading a quantized base passes its dense weights through the device once; the step's
    // peak is what is measured from here.
    device.reset_peak();
    let mut report = trainer_steps(args, device, train, &mut trainer)?;
    report.candidates = ladder;
    let full = full_finetune_plan(args, flags, train, model)?;
    println!("for comparison, the full fine-tune (every weight trained, no adapters):");
    print!("{full}");
    report.full_plan = Some(full);
    Ok(report)
}

/// The step's plan of the same model fine-tuned whole (no adapters, dense, every weight
/// trained by the same optimizer, checkpointed as the flags ask), on a device of its own that
/// only plans, without a budget.
fn full_finetune_plan<M>(
    args: &Args,
    flags: &Flags,
    train: &TextDataset,
    model: &dyn Fn(&Device, Option<BaseQuant>) -> Result<M>,
) -> Result<Plan>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut options = DeviceOptions::default().plan_only(true);
    options.adapter = args.run.adapter.clone();
    let device = Device::with_options(options)?;
    let mut m = model(&device, None)?;
    m.set_checkpointing(args.fit.checkpoint_activations);
    let optimizer = optimizer_for(args, &m)?;
    Trainer::new(m, optimizer, trainer_config(args, flags.precision))?.plan(train)
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
    trainer_steps(args, device, train, &mut trainer)
}

/// Plans the step of `trainer` and prints it; without `--plan`, runs the steps and measures
/// the peak.
fn trainer_steps<M>(
    args: &Args,
    device: &Device,
    train: &TextDataset,
    trainer: &mut Trainer<M>,
) -> Result<ConfigReport>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut report = ConfigReport {
        plan: trainer.plan(train)?,
        ..Default::default()
    };
    print!("{}", report.plan);
    if !args.run.plan {
        let mut first = 0;
        report.train_loss = train_steps(args, trainer, train, &mut |step, _| {
            if step == 1 {
                first = device.memory_stats().peak_bytes_in_use;
            }
            Ok(())
        })?;
        let measured = device.memory_stats().peak_bytes_in_use;
        // The first step holds no optimizer state before its update: its peak is the plan's
        // first step's; the steps after it reach the plan's peak.
        let line = |what: &str, planned: u64, measured: u64| {
            println!(
                "planned peak in use{what} {} / measured {} ({:+.2}%)",
                Bytes(planned),
                Bytes(measured),
                (measured as f64 / planned as f64 - 1.0) * 100.0
            )
        };
        line(" of the first step", report.plan.first_step_peak, first);
        if args.steps > 1 {
            line("", report.plan.peak, measured);
        }
        report.measured_first_step_peak = Some(first);
        report.measured_peak = Some(measured);
    }
    report.params = trainer.model.num_parameters();
    Ok(report)
}
