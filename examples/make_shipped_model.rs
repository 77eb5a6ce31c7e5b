//! `cargo run --release --example make_shipped_model -- models/shakespeare-gpt2` — makes the
//! small GPT-2-format model shipped in the crate, which `finetune` uses when no `--model` is
//! given: a byte-level BPE tokenizer trained on seven of the eight embedded plays (all but
//! [`HELD_OUT_PLAY`], Twelfth Night), a small `Gpt` trained by fitgrad on the same seven plays
//! (seeded: the same adapter gives the same bytes), exported as a Hugging Face GPT-2 folder
//! (`config.json`, `model.safetensors`, `tokenizer.json`) that transformers loads.

use clap::Parser;
use fitgrad::hf::{save_gpt2, Tokenizer, TOKENIZER_FILE};
use fitgrad::nn::{Gpt, GptConfig, LanguageModel, Module};
use fitgrad::optim::{decay_groups, AdamW, LrSchedule};
use fitgrad::train::plays::{held_out_play, training_plays, HELD_OUT_PLAY};
use fitgrad::train::text::TextDataset;
use fitgrad::train::{window_loss, BatchSource, Trainer, TrainerConfig};
use fitgrad::{Device, Result};
use std::path::PathBuf;
use std::process::ExitCode;

/// The flags (the defaults made the shipped folder).
#[derive(Parser, Debug)]
#[command(about = "Train and export the small GPT-2 folder shipped with fitgrad")]
struct Args {
    /// The folder to write.
    out: PathBuf,
    /// Tokens of the byte-level BPE vocabulary (special token included).
    #[arg(long, default_value_t = 1024)]
    vocab: usize,
    /// Positions of the model.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Blocks.
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 3)]
    heads: usize,
    /// Width.
    #[arg(long, default_value_t = 96)]
    dim: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Windows per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Peak AdamW learning rate (warm-up, then cosine to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Seed of the weights and of the window order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn make(args: &Args) -> Result<()> {
    let text = training_plays();
    let tokenizer = Tokenizer::train_byte_level(&[&text], args.vocab)?;
    let ids = tokenizer.encode(&text)?;
    let (_, _, held_out) = held_out_play();
    let held_out = tokenizer.encode(&held_out)?;
    println!(
        "tokenizer: {} tokens; seven plays: {} characters, {} tokens",
        tokenizer.vocab_size(),
        text.len(),
        ids.len()
    );
    let device = Device::new()?;
    println!("adapter: {}", device.info().adapter);
    let mut cfg = GptConfig::new(
        tokenizer.vocab_size(),
        args.context,
        args.layers,
        args.heads,
        args.dim,
    );
    cfg.seed = args.seed;
    let train = TextDataset::new(ids, args.context)?.with_stride(args.context / 2)?;
    let mut config = TrainerConfig::new(args.batch_size, 1, args.lr);
    config.schedule = LrSchedule::WarmupCosine {
        warmup_steps: args.steps / 20,
        total_steps: args.steps,
        min_lr_ratio: 0.1,
    };
    config.clip_grad_norm = Some(1.0);
    let model = Gpt::new(&device, cfg)?;
    println!("model: {} parameters", model.num_parameters());
    let groups = decay_groups(model.named_parameters(), 0.1);
    let optimizer = AdamW::with_groups(groups, args.lr)?.betas(0.9, 0.95)?;
    let mut trainer = Trainer::new(model, Box::new(optimizer), config)?;
    let n = train.len() as u64;
    let eff = args.batch_size as u64;
    let mut order = (u64::MAX, Vec::new());
    let start = std::time::Instant::now();
    for step in 0..args.steps {
        let idx: Vec<usize> = (0..eff)
            .map(|i| {
                let pos = step * eff + i;
                if order.0 != pos / n {
                    order = (pos / n, train.epoch_order(args.seed, pos / n));
                }
                order.1[(pos % n) as usize]
            })
            .collect();
        trainer.step(&train, &idx)?;
        if (step + 1) % 50 == 0 || step + 1 == args.steps {
            println!(
                "step {}: train loss {:.4} ({:.0} s)",
                step + 1,
                trainer.take_loss()?,
                start.elapsed().as_secs_f64()
            );
        }
    }
    let model = trainer.model;
    model.set_training(false);
    let held = window_loss(&model, &held_out, args.context, 8, model.dtype())?;
    println!(
        "held-out play {} (end): {:.4} nats/token over {} tokens",
        HELD_OUT_PLAY + 1,
        held.loss,
        held.tokens
    );
    let tmp = tempfile::tempdir().map_err(|source| fitgrad::Error::Io {
        path: "a temporary folder".into(),
        source,
    })?;
    let tok_path = tmp.path().join(TOKENIZER_FILE);
    fitgrad::write_atomic(&tok_path, tokenizer.to_json()?.as_bytes())?;
    save_gpt2(&model, &args.out, Some(&tok_path))?;
    println!("saved {}", args.out.display());
    Ok(())
}

fn main() -> ExitCode {
    match make(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
