//! The flags and files of a finetune run, read and checked on the host before any device work:
//! the folder and its tokenizer, the texts, the prompt, the LoRA settings.

use super::Args;
use fitgrad::compress::BaseQuant;
use fitgrad::hf::TOKENIZER_FILE;
use fitgrad::hf::{Adapter, LoraSpec, ModelConfig, PretrainedGpt, PretrainedLlama, Tokenizer};
use fitgrad::nn::LoraConfig;
use fitgrad::run::{self, MAX_SAMPLE_LEN, MAX_STEPS, MAX_WIDTH};
use fitgrad::train::plays::Play;
use fitgrad::train::text::TextDataset;
use fitgrad::train::Precision;
use fitgrad::{Error, Result};
use std::path::Path;

/// A model folder read and checked on the host.
pub enum Folder {
    /// `GPT2LMHeadModel`.
    Gpt2(PretrainedGpt),
    /// `LlamaForCausalLM`.
    Llama(PretrainedLlama),
}

/// PEFT's default `target_modules` for GPT-2 and for Llama.
pub const GPT2_LORA_TARGETS: &str = "c_attn";
pub const LLAMA_LORA_TARGETS: &str = "q_proj,v_proj";

impl Folder {
    /// PEFT's default LoRA targets for the folder's architecture.
    pub fn default_lora_targets(&self) -> &'static str {
        match self {
            Folder::Gpt2(_) => GPT2_LORA_TARGETS,
            Folder::Llama(_) => LLAMA_LORA_TARGETS,
        }
    }

    /// Reads `dir` with the loader its `config.json`'s model_type names.
    pub fn open(dir: &Path, dtype: fitgrad::DType) -> Result<Folder> {
        match fitgrad::hf::model_type(dir)?.as_str() {
            "llama" => Ok(Folder::Llama(PretrainedLlama::open(dir, dtype)?)),
            // GPT-2's loader names any other model_type in its refusal.
            _ => Ok(Folder::Gpt2(PretrainedGpt::open(dir, dtype)?)),
        }
    }

    pub fn dir(&self) -> &Path {
        match self {
            Folder::Gpt2(f) => &f.dir,
            Folder::Llama(f) => &f.dir,
        }
    }

    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match self {
            Folder::Gpt2(f) => f.tokenizer(),
            Folder::Llama(f) => f.tokenizer(),
        }
    }

    /// The most positions, and the config field that says so.
    pub fn positions(&self) -> (usize, &'static str) {
        match self {
            Folder::Gpt2(f) => (f.config.context, "n_positions"),
            Folder::Llama(f) => (f.config.context, "max_position_embeddings"),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Folder::Gpt2(f) => f.config.vocab_size,
            Folder::Llama(f) => f.config.vocab_size,
        }
    }

    /// One line on the architecture.
    pub fn describe(&self) -> String {
        match self {
            Folder::Gpt2(f) => ModelConfig::Gpt2(f.config.clone()).describe(),
            Folder::Llama(f) => ModelConfig::Llama(f.config.clone()).describe(),
        }
    }
}

/// Everything the flags ask for, read and checked on the host.
pub struct Setup {
    pub folder: Folder,
    pub tokenizer: Tokenizer,
    pub context: usize,
    pub eval: Option<Vec<u32>>,
    pub train: Option<TextDataset>,
    pub prompt: Option<Vec<u32>>,
    pub precision: Precision,
    pub budget: Option<u64>,
    pub fit_auto: bool,
    pub lora: Option<LoraSetup>,
}

/// The LoRA flags, checked.
pub struct LoraSetup {
    pub spec: LoraSpec,
    pub resume: Option<Adapter>,
    pub quant: BaseQuant,
}

pub fn invalid(reason: String) -> Error {
    run::invalid(OP, reason)
}

/// This command's name in its errors.
const OP: &str = "finetune";

pub fn read_text(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| Error::Data {
        path: path.display().to_string(),
        reason: format!("not UTF-8 text: {e}"),
    })
}

/// The training flags every mode shares, checked.
pub struct Flags {
    pub precision: Precision,
    pub budget: Option<u64>,
    pub fit_auto: bool,
}

/// Checks the flags that need no file: every count within the bound every command shares,
/// the budget, the numbers.
pub fn check_flags(args: &Args) -> Result<Flags> {
    let precision: Precision = args.run.precision.parse()?;
    let budget = run::parse_budget(OP, args.run.memory_budget.as_deref())?;
    // Fit auto chooses checkpointing itself: --checkpoint-activations beside it is refused,
    // as in every command, never dropped.
    let fit_auto = args.fit.auto(OP, budget, "block checkpointing")?;
    run::effective_batch(OP, args.batch_size, args.run.accum_steps)?;
    let n = |v: usize| v as u64;
    run::check_counts(
        OP,
        &[
            ("--steps", args.steps, 0, MAX_STEPS),
            ("--eval-every", args.eval_every, 0, MAX_STEPS),
            ("--context", n(args.context.unwrap_or(1)), 0, MAX_WIDTH),
            (
                "--max-new-tokens",
                n(args.max_new_tokens),
                0,
                MAX_SAMPLE_LEN,
            ),
            ("--lora-rank", n(args.lora_rank.unwrap_or(1)), 0, MAX_WIDTH),
        ],
    )?;
    run::check_environment()?;
    run::check_number(OP, "--lr", args.lr, false)?;
    run::check_number(OP, "--temperature", args.temperature, false)?;
    if args.top_k == Some(0) || args.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(invalid(format!(
            "--top-k must be at least 1 and --top-p in (0, 1], got {:?} and {:?}",
            args.top_k, args.top_p
        )));
    }
    Ok(Flags {
        precision,
        budget,
        fit_auto,
    })
}

/// The files a model folder holds that `--save` and `--merge-into` write.
const MODEL_FILES: &[&str] = &["model.safetensors", "config.json", TOKENIZER_FILE];
/// The files of a PEFT adapter folder.
const ADAPTER_FILES: &[&str] = &["adapter_model.safetensors", "adapter_config.json"];

/// No output overwrites an input (a file of the model's folder or the adapter's, the texts)
/// or another output, checked before any device work.
fn check_files(args: &Args) -> Result<()> {
    let model = args.config.is_none().then(|| args.model_dir());
    run::Files::new()
        .input_folder("--model", model)
        .input_folder("--resume-adapter", args.resume_adapter.as_deref())
        .input("--text", args.text.as_deref())
        .input("--eval-text", args.eval_text.as_deref())
        .output_folder("--save", args.save.as_deref(), MODEL_FILES)
        .output_folder("--merge-into", args.merge_into.as_deref(), MODEL_FILES)
        .output_folder(
            "--save-adapter",
            args.save_adapter.as_deref(),
            ADAPTER_FILES,
        )
        .check()?;
    // An output folder that is an input folder would mix the run's files with the input's.
    let outputs = [
        ("--save", &args.save),
        ("--merge-into", &args.merge_into),
        ("--save-adapter", &args.save_adapter),
    ];
    let inputs = [
        ("--model", model),
        ("--resume-adapter", args.resume_adapter.as_deref()),
    ];
    for (flag, dir) in outputs {
        let Some(dir) = dir else { continue };
        for (input, idir) in inputs {
            if idir.is_some_and(|i| same_folder(dir, i)) {
                return Err(invalid(format!(
                    "{flag} {} is the {input} folder: writing it would overwrite an input \
                     folder; give {flag} another folder",
                    dir.display()
                )));
            }
        }
    }
    Ok(())
}

/// Whether `a` and `b` name one folder (after resolving links).
fn same_folder(a: &Path, b: &Path) -> bool {
    a.canonicalize()
        .ok()
        .is_some_and(|x| Some(x) == b.canonicalize().ok())
}

/// Checks every flag, reads the folder, the tokenizer and the texts, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let Flags {
        precision,
        budget,
        fit_auto,
    } = check_flags(args)?;
    // With no --model, no --text and no --eval-text: the shipped model, fine-tuned on the
    // eighth play's first part and evaluated on its held-out end.
    let play = (args.model.is_none() && args.text.is_none() && args.eval_text.is_none())
        .then(fitgrad::train::plays::held_out_play);
    if (args.steps > 0 || args.run.plan) && args.text.is_none() && play.is_none() {
        return Err(invalid(
            "--steps and --plan fine-tune on a text: add --text FILE".into(),
        ));
    }
    if args.model.is_none() && !args.model_dir().join("config.json").is_file() {
        return Err(Error::Data {
            path: args.model_dir().display().to_string(),
            reason: "the shipped model is missing (make it with `cargo run --release --example \
                     make_shipped_model -- models/shakespeare-gpt2`); or give --model DIR"
                .into(),
        });
    }
    let folder = Folder::open(args.model_dir(), precision.param_dtype())?;
    let lora = prepare_lora(args, &folder, precision)?;
    // The LoRA flags first (an output of a setting that does not apply says so), then what
    // the outputs would overwrite.
    check_files(args)?;
    let tokenizer = folder.tokenizer()?;
    let (n_positions, field) = folder.positions();
    let context = args.context.unwrap_or(n_positions);
    if context == 0 || context > n_positions {
        return Err(invalid(format!(
            "--context {context}: between 1 and the model's {field} = {n_positions}"
        )));
    }
    if tokenizer.vocab_size() > folder.vocab_size() {
        return Err(Error::Data {
            path: args.model_dir().join(TOKENIZER_FILE).display().to_string(),
            reason: format!(
                "the tokenizer's {} tokens pass the model's vocab_size of {}",
                tokenizer.vocab_size(),
                folder.vocab_size()
            ),
        });
    }
    let (eval, train) = read_texts(args, &tokenizer, context, play.as_ref())?;
    let prompt = match &args.generate {
        Some(p) => {
            let ids = tokenizer.encode(p)?;
            if ids.is_empty() {
                return Err(invalid(
                    "--generate needs a prompt of at least one token".into(),
                ));
            }
            Some(ids)
        }
        None => None,
    };
    Ok(Setup {
        folder,
        tokenizer,
        context,
        eval,
        train,
        prompt,
        precision,
        budget,
        fit_auto,
        lora,
    })
}

/// The eval text's ids and the training windows: `--eval-text` and `--text`, or the held-out
/// `play`'s parts (its eval part said).
fn read_texts(
    args: &Args,
    tokenizer: &Tokenizer,
    context: usize,
    play: Option<&(Play, String, String)>,
) -> Result<(Option<Vec<u32>>, Option<TextDataset>)> {
    let eval = match (&args.eval_text, play) {
        (None, Some((p, _, held_out))) => {
            println!(
                "no --model: the shipped model, on play {} ({}): {} characters to fine-tune \
                 on, the last {} held out",
                fitgrad::train::plays::HELD_OUT_PLAY + 1,
                p.title,
                p.text.len() - held_out.len(),
                held_out.len()
            );
            Some(tokenizer.encode(held_out)?)
        }
        (Some(path), _) => {
            let ids = tokenizer.encode(&read_text(path)?)?;
            if ids.len() < 2 {
                return Err(Error::Data {
                    path: path.display().to_string(),
                    reason: format!("{} tokens: the loss needs at least 2", ids.len()),
                });
            }
            Some(ids)
        }
        (None, None) => None,
    };
    let train = match (&args.text, play) {
        (None, Some((_, part, _))) => Some(TextDataset::new(tokenizer.encode(part)?, context)?),
        (Some(path), _) => {
            let ids = tokenizer.encode(&read_text(path)?)?;
            Some(TextDataset::new(ids, context).map_err(|e| Error::Data {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?)
        }
        (None, None) => None,
    };
    Ok((eval, train))
}

/// The adapters `--lora-rank`, `--lora-alpha`, `--lora-dropout` and `--lora-targets` ask for
/// (PEFT's defaults: alpha 8, no dropout, `c_attn`).
/// The LoRA flags' adapter settings; `default_targets` (PEFT's default for the architecture)
/// without `--lora-targets`.
pub fn lora_spec(args: &Args, default_targets: &str) -> Result<LoraSpec> {
    let r = args
        .lora_rank
        .ok_or_else(|| invalid("LoRA needs --lora-rank R".into()))?;
    let targets = args
        .lora_targets
        .as_deref()
        .unwrap_or(default_targets)
        .split(',')
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    Ok(LoraSpec {
        config: LoraConfig {
            r,
            alpha: args.lora_alpha.unwrap_or(8.0),
            dropout: args.lora_dropout.unwrap_or(0.0),
        },
        targets,
    })
}

/// Checks the LoRA flags against the folder's model, on the host.
pub fn prepare_lora(
    args: &Args,
    folder: &Folder,
    precision: Precision,
) -> Result<Option<LoraSetup>> {
    let quant: BaseQuant = args.quantize.parse()?;
    let on = args.lora_rank.is_some() || args.resume_adapter.is_some();
    if !on {
        let given = [
            ("--lora-alpha", args.lora_alpha.is_some()),
            ("--lora-dropout", args.lora_dropout.is_some()),
            ("--lora-targets", args.lora_targets.is_some()),
            ("--quantize", quant != BaseQuant::None),
            ("--save-adapter", args.save_adapter.is_some()),
            ("--merge-into", args.merge_into.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            return Err(invalid(format!(
                "{flag} is a LoRA setting: add --lora-rank R or --resume-adapter DIR"
            )));
        }
        return Ok(None);
    }
    if quant != BaseQuant::None && precision == Precision::F16 {
        return Err(invalid(format!(
            "--quantize {quant} quantizes f32 weights: use --precision f32 or mixed"
        )));
    }
    if args.save.is_some() {
        return Err(invalid(
            "--save writes the base without its adapters: use --merge-into DIR (merged) or \
             --save-adapter DIR (the adapters alone)"
                .into(),
        ));
    }
    let (spec, resume) = match &args.resume_adapter {
        Some(dir) => {
            let a = match folder {
                Folder::Gpt2(f) => fitgrad::hf::read_adapter(dir, &f.config)?,
                Folder::Llama(f) => fitgrad::hf::read_llama_adapter(dir, &f.config)?,
            };
            let differs = [
                (
                    "--lora-rank",
                    args.lora_rank.is_some_and(|r| r != a.spec.config.r),
                ),
                (
                    "--lora-alpha",
                    args.lora_alpha.is_some_and(|v| v != a.spec.config.alpha),
                ),
                ("--lora-targets", args.lora_targets.is_some()),
            ];
            if let Some((flag, _)) = differs.iter().find(|(_, d)| *d) {
                return Err(invalid(format!(
                    "{flag} differs from the adapter in {} (r = {}, alpha = {}, targets {:?});                      drop the flag",
                    dir.display(),
                    a.spec.config.r,
                    a.spec.config.alpha,
                    a.spec.targets
                )));
            }
            let mut spec = a.spec.clone();
            if let Some(p) = args.lora_dropout {
                spec.config.dropout = p;
            }
            (spec, Some(a))
        }
        None => (lora_spec(args, folder.default_lora_targets())?, None),
    };
    // Every target and the rank, against the model's widths.
    match folder {
        Folder::Gpt2(f) => fitgrad::hf::resolve_targets(&f.config, &spec)?,
        Folder::Llama(f) => fitgrad::hf::resolve_llama_targets(&f.config, &spec)?,
    };
    Ok(Some(LoraSetup {
        spec,
        resume,
        quant,
    }))
}
