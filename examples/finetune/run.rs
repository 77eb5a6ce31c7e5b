//! Running a folder: evaluation before and after, fine-tuning (whole model or LoRA, the budget
//! choosing), sampling, and writing the results back.

use super::setup::{Folder, Setup};
use super::Args;
use fitgrad::compress::{quantize_gpt_base, quantize_llama_base, BaseQuant};
use fitgrad::hf::{
    save_gpt2, save_llama, LoraBase, MergeBase, PretrainedGpt, PretrainedLlama, TOKENIZER_FILE,
};
use fitgrad::nn::{trainable_parameters, Gpt, LanguageModel, Module, Sampling};
use fitgrad::optim::{decay_groups, AdamW, Optimizer, Sgd};
use fitgrad::train::text::{TextDataset, TokenBatch};
use fitgrad::train::WindowLoss;
use fitgrad::train::{window_loss, Precision, TrainModel, Trainer, TrainerConfig};
use fitgrad::{Device, Result};
use std::path::Path;

/// Windows per forward when evaluating.
pub const EVAL_BATCH: usize = 8;

/// What a run ends with.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The eval text's loss after fine-tuning (the loaded model's with --steps 0).
    pub eval: Option<WindowLoss>,
    /// The eval text's loss before fine-tuning (only when --steps > 0).
    pub eval_before: Option<WindowLoss>,
    /// The eval text's loss every --eval-every steps while fine-tuning: (step, loss).
    pub eval_during: Vec<(u64, WindowLoss)>,
    /// Mean training loss of the last steps.
    pub train_loss: Option<f32>,
    /// The prompt and its continuation.
    pub generated: Option<String>,
    /// A quantized frozen base's device bytes and parameters.
    pub base: Option<(u64, usize)>,
    /// What `--fit auto` chose, as printed: every candidate with its planned peak.
    pub fit_choice: Option<String>,
    /// The planned step of the fine-tuning run.
    pub plan: Option<fitgrad::train::Plan>,
}

/// The folder's model on `device`, with the adapters and the base `quant` the flags ask for;
/// the base's device bytes and parameters when quantized.
pub fn build_gpt(
    args: &Args,
    setup: &Setup,
    folder: &PretrainedGpt,
    device: &Device,
    quant: BaseQuant,
) -> Result<(Gpt, Option<(u64, usize)>)> {
    with_lora(args, setup, folder.build(device)?, quant, quantize_gpt_base)
}

/// [`build_gpt`] for a Llama folder.
pub fn build_llama(
    args: &Args,
    setup: &Setup,
    folder: &PretrainedLlama,
    device: &Device,
    quant: BaseQuant,
) -> Result<(fitgrad::nn::Llama, Option<(u64, usize)>)> {
    with_lora(
        args,
        setup,
        folder.build(device)?,
        quant,
        quantize_llama_base,
    )
}

/// `model` with the run's adapters (new, or the resumed ones) and its frozen base held as
/// `quant` by `quantize`; unchanged without LoRA.
fn with_lora<M: LoraBase>(
    args: &Args,
    setup: &Setup,
    mut model: M,
    quant: BaseQuant,
    quantize: fn(&mut M, BaseQuant) -> Result<(u64, usize)>,
) -> Result<Built<M>> {
    let Some(lora) = &setup.lora else {
        return Ok((model, None));
    };
    match &lora.resume {
        Some(a) => a.apply(&mut model, args.run.seed)?,
        None => {
            fitgrad::hf::add_lora(&mut model, &lora.spec, args.run.seed)?;
        }
    }
    let base = quantize(&mut model, quant)?;
    Ok((model, (quant != BaseQuant::None).then_some(base)))
}

/// Opens the device the flags ask for.
pub fn open_device(args: &Args, setup: &Setup) -> Result<Device> {
    fitgrad::run::open_device(args.run.adapter.as_deref(), setup.budget)
}

pub fn evaluate<M: LanguageModel>(model: &M, setup: &Setup) -> Result<Option<WindowLoss>> {
    let Some(ids) = &setup.eval else {
        return Ok(None);
    };
    model.set_training(false);
    let loss = window_loss(model, ids, setup.context, EVAL_BATCH, model.dtype())?;
    model.set_training(true);
    Ok(Some(loss))
}

/// Evaluates, fine-tunes, evaluates again, samples and saves, on `device`.
pub fn run(args: &Args, setup: Setup, device: &Device) -> Result<Report> {
    println!("adapter: {}", device.info().adapter);
    println!(
        "model: {} ({}), context {}",
        args.model_dir().display(),
        setup.folder.describe(),
        setup.context
    );
    let setup = &setup;
    match &setup.folder {
        Folder::Gpt2(f) => run_model(
            args,
            setup,
            device,
            &|q| build_gpt(args, setup, f, device, q),
            &save_gpt2,
            &|gpt| save_lora(args, setup, f, gpt),
        ),
        Folder::Llama(f) => run_model(
            args,
            setup,
            device,
            &|q| build_llama(args, setup, f, device, q),
            &save_llama,
            &|m| save_lora(args, setup, f, m),
        ),
    }
}

/// Writes the adapters of a LoRA run as the flags ask: `--save-adapter`, `--merge-into`.
/// `folder`: the base folder `--merge-into` merges into.
pub fn save_lora<M: LoraBase>(
    args: &Args,
    setup: &Setup,
    folder: &dyn MergeBase,
    model: &M,
) -> Result<()> {
    let Some(lora) = &setup.lora else {
        return Ok(());
    };
    if let Some(dir) = &args.save_adapter {
        fitgrad::hf::save_adapter(
            model,
            &lora.spec,
            dir,
            &args.model_dir().display().to_string(),
        )?;
        println!("saved adapter {}", dir.display());
    }
    if let Some(dir) = &args.merge_into {
        let adapter = fitgrad::hf::adapter_of(model, &lora.spec)?;
        fitgrad::hf::merge_adapter(folder, &adapter, dir)?;
        println!("merged into {}", dir.display());
    }
    Ok(())
}

/// A model built for a run and, when its frozen base is quantized, the base's device bytes
/// and parameters.
pub type Built<M> = (M, Option<(u64, usize)>);

/// Builds the model with its frozen base held as asked.
pub type BuildFn<'a, M> = dyn Fn(BaseQuant) -> Result<Built<M>> + 'a;

/// Writes a model back as a folder, with a copy of the tokenizer.
pub type SaveFn<M> = dyn Fn(&M, &Path, Option<&Path>) -> Result<()>;

/// [`run`] for the model `build_model` makes (again when budget fitting rebuilds it); `save`
/// writes it back as a folder, `after` writes what else the trained model gives (adapters).
pub fn run_model<M>(
    args: &Args,
    setup: &Setup,
    device: &Device,
    build_model: &BuildFn<'_, M>,
    save: &SaveFn<M>,
    after: &dyn Fn(&M) -> Result<()>,
) -> Result<Report>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut report = Report::default();
    let quant = setup.lora.as_ref().map_or(BaseQuant::None, |l| l.quant);
    // Under --fit auto the budget is the ladder's to apply: the model loads without it, so a
    // budget it alone passes ends in fit auto's smallest workable budget, not a failed load.
    let budget = device.memory_stats().budget;
    if setup.fit_auto && setup.train.is_some() {
        device.set_memory_budget(None)?;
    }
    let built = build_model(quant);
    device.set_memory_budget(budget)?;
    let (mut gpt, mut base) = built?;
    let mut plan_peak = None;
    if let Some(train) = &setup.train {
        let tuned = fine_tune(
            args,
            setup,
            device,
            build_model,
            (gpt, base),
            train,
            &mut report,
        )?;
        let Some((model, tuned_base)) = tuned else {
            return Ok(report);
        };
        (gpt, base) = (model, tuned_base);
        plan_peak = report.plan.as_ref().map(|p| p.peak);
    }
    if let Some((bytes, params)) = base {
        println!(
            "frozen base: {quant} in {bytes} bytes, {:.4} bytes per parameter ({:.4}x of f32)",
            bytes as f64 / params as f64,
            bytes as f64 / (4.0 * params as f64)
        );
    }
    report.base = base;
    report.eval = evaluate(&gpt, setup)?;
    if let Some(e) = &report.eval {
        println!(
            "eval loss: {:.6} nats/token over {} tokens in {} windows",
            e.loss, e.tokens, e.windows
        );
    }
    if let Some(prompt) = &setup.prompt {
        let mut sampling = Sampling::new(args.temperature, args.run.seed);
        sampling.top_k = args.top_k;
        sampling.top_p = args.top_p;
        let ids = gpt.generate_with(prompt, args.max_new_tokens, &sampling)?;
        let text = setup.tokenizer.decode(&ids)?;
        println!("generated:\n{text}");
        report.generated = Some(text);
    }
    after(&gpt)?;
    if let Some(dir) = &args.save {
        save(&gpt, dir, Some(&setup.folder.dir().join(TOKENIZER_FILE)))?;
        println!("saved {}", dir.display());
    }
    if args.run.json {
        print_json(args, setup, device, &gpt, &report, plan_peak);
    }
    Ok(report)
}

/// Fine-tunes `first` (the model `build_model` made, and its base's bytes) on `train`: the
/// trainer built within the budget or by `--fit auto` (under LoRA over the bases too), the
/// step planned (`--plan` prints it and returns `None`), the eval text before, during and
/// after. Returns the trained model and its base.
fn fine_tune<M>(
    args: &Args,
    setup: &Setup,
    device: &Device,
    build_model: &BuildFn<'_, M>,
    (gpt, base): Built<M>,
    train: &TextDataset,
    report: &mut Report,
) -> Result<Option<Built<M>>>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut gpt = gpt;
    let quant = setup.lora.as_ref().map_or(BaseQuant::None, |l| l.quant);
    let mut config = TrainerConfig::new(args.batch_size, args.run.accum_steps, args.lr);
    config.precision = setup.precision;
    config.clip_grad_norm = Some(1.0);
    gpt.set_checkpointing(args.fit.checkpoint_activations);
    // The first build hands over the model already loaded; a rebuild (budget fitting)
    // loads the weights again.
    let first = std::cell::RefCell::new(Some((gpt, quant)));
    let built_base = std::cell::Cell::new(base);
    let build_with = |q: &BaseQuant| {
        let model = match first.borrow_mut().take() {
            Some((m, mq)) if mq == *q => m,
            _ => {
                let (mut m, b) = build_model(*q)?;
                built_base.set(b);
                m.set_checkpointing(args.fit.checkpoint_activations);
                m
            }
        };
        let optimizer = optimizer_for(args, &model)?;
        Trainer::new(model, optimizer, config.clone())
    };
    let build = || build_with(&quant);
    let mut fit_choice = None;
    let mut trainer = if setup.fit_auto && setup.lora.is_some() && quant == BaseQuant::None {
        // The budget also chooses the base: dense, then int8, then NF4.
        let bases = [
            BaseQuant::None,
            BaseQuant::Int8,
            BaseQuant::Nf4 { double_quant: true },
        ];
        let (trainer, choice) =
            Trainer::build_fit_auto_variants(device, train, &bases, build_with)?;
        print!("{choice}");
        fit_choice = Some(choice.to_string());
        trainer
    } else if setup.fit_auto {
        let (trainer, choice) = Trainer::build_fit_auto(device, train, build)?;
        print!("{choice}");
        fit_choice = Some(choice.to_string());
        trainer
    } else {
        let mut trainer = Trainer::build_within_budget(device, train, build)?;
        trainer.check_device_memory(train)?;
        trainer
    };
    report.fit_choice = fit_choice;
    let plan = trainer.plan(train)?;
    report.plan = Some(plan.clone());
    if args.run.plan {
        print!("{plan}");
        if args.run.json {
            println!("{}", serde_json::json!({"planned_peak_bytes": plan.peak}));
        }
        return Ok(None);
    }
    report.eval_before = evaluate(&trainer.model, setup)?;
    if let Some(e) = &report.eval_before {
        println!("eval loss before fine-tuning: {:.6} nats/token", e.loss);
    }
    let mut during = Vec::new();
    report.train_loss = train_steps(args, &mut trainer, train, &mut |step, model| {
        let every = args.eval_every;
        if every == 0 || step % every != 0 || step == args.steps {
            return Ok(());
        }
        if let Some(e) = evaluate(model, setup)? {
            println!("eval loss after step {step}: {:.6} nats/token", e.loss);
            during.push((step, e));
        }
        Ok(())
    })?;
    report.eval_during = during;
    Ok(Some((trainer.model, built_base.get())))
}

/// The `--json` line of a folder run: the model, its base, the eval losses, the training
/// loss, the planned peak and the sample.
fn print_json<M: LanguageModel>(
    args: &Args,
    setup: &Setup,
    device: &Device,
    gpt: &M,
    report: &Report,
    plan_peak: Option<u64>,
) {
    let quant = setup.lora.as_ref().map_or(BaseQuant::None, |l| l.quant);
    let base = report.base;
    let trainable = trainable_parameters(gpt)
        .iter()
        .map(|(_, t)| t.numel())
        .sum::<usize>();
    let during: Vec<_> = report
        .eval_during
        .iter()
        .map(|(s, e)| (s, e.loss))
        .collect();
    let j = serde_json::json!({
        "model": args.model_dir().display().to_string(),
        "adapter": device.info().adapter.name,
        "params": gpt.num_parameters(),
        "trainable_params": trainable,
        "quantize": quant.to_string(),
        "base_bytes": base.map(|b| b.0),
        "base_bytes_per_param": base.map(|(b, p)| b as f64 / p as f64),
        "context": setup.context,
        "steps": args.steps,
        "eval_loss": report.eval.map(|e| e.loss),
        "eval_tokens": report.eval.map(|e| e.tokens),
        "eval_windows": report.eval.map(|e| e.windows),
        "eval_loss_before": report.eval_before.map(|e| e.loss),
        "eval_loss_during": during,
        "train_loss": report.train_loss,
        "planned_peak_bytes": plan_peak,
        "generated": report.generated,
    });
    println!("{j}");
}

/// `--optimizer` over the parameters that train (under LoRA the adapters only: the base has
/// no gradients and no state): AdamW without weight decay, or SGD.
pub fn optimizer_for<M: Module>(args: &Args, model: &M) -> Result<Box<dyn Optimizer>> {
    let groups = decay_groups(trainable_parameters(model), 0.0);
    Ok(if args.optimizer == "sgd" {
        let params = groups.into_iter().flat_map(|g| g.params).collect();
        Box::new(Sgd::new(params, args.lr)?)
    } else {
        Box::new(AdamW::with_groups(groups, args.lr)?)
    })
}

/// The trainer's settings the flags ask for: gradients clipped to norm 1.
pub fn trainer_config(args: &Args, precision: Precision) -> TrainerConfig {
    let mut config = TrainerConfig::new(args.batch_size, args.run.accum_steps, args.lr);
    config.precision = precision;
    config.clip_grad_norm = Some(1.0);
    config
}

/// The trainer of a fine-tuning run: `first` is the model already built, `build_model`
/// builds it again where budget fitting tries several. AdamW without weight decay (or SGD),
/// gradients clipped to norm 1; `--fit auto` prints its choice.
pub fn make_trainer<M>(
    args: &Args,
    precision: Precision,
    fit_auto: bool,
    device: &Device,
    train: &TextDataset,
    mut first: M,
    build_model: &dyn Fn() -> Result<M>,
) -> Result<Trainer<M>>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let config = trainer_config(args, precision);
    first.set_checkpointing(args.fit.checkpoint_activations);
    let first = std::cell::RefCell::new(Some(first));
    let build = || {
        let model = match first.borrow_mut().take() {
            Some(m) => m,
            None => {
                let mut m = build_model()?;
                m.set_checkpointing(args.fit.checkpoint_activations);
                m
            }
        };
        let optimizer = optimizer_for(args, &model)?;
        Trainer::new(model, optimizer, config.clone())
    };
    if fit_auto {
        let (trainer, choice) = Trainer::build_fit_auto(device, train, build)?;
        print!("{choice}");
        return Ok(trainer);
    }
    let mut trainer = Trainer::build_within_budget(device, train, build)?;
    trainer.check_device_memory(train)?;
    Ok(trainer)
}

/// Runs `--steps` optimizer steps over the seeded epoch orders of `train`, printing the loss
/// every 10 and calling `after` with the step's number (from 1) and the model after each;
/// returns the last printed loss.
pub fn train_steps<M>(
    args: &Args,
    trainer: &mut Trainer<M>,
    train: &TextDataset,
    after: &mut dyn FnMut(u64, &M) -> Result<()>,
) -> Result<Option<f32>>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let eff = args.batch_size * args.run.accum_steps;
    let mut last = None;
    let mut order = fitgrad::run::StepOrder::new(args.run.seed);
    for step in 0..args.steps {
        // Positions step * eff .. of the concatenated seeded epoch orders.
        let idx = order.indices(train, step, eff);
        trainer.step(train, &idx)?;
        if (step + 1) % 10 == 0 || step + 1 == args.steps {
            let loss = trainer.take_loss()?;
            println!("step {}: train loss {loss:.4}", step + 1);
            last = Some(loss);
        }
        after(step + 1, &trainer.model)?;
    }
    Ok(last)
}
