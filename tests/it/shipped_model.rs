//! The small model shipped in the crate (models/shakespeare-gpt2, made by
//! examples/make_shipped_model.rs): the eight embedded plays split apart, the folder within
//! 2 MB, its tokenizer the one trained on the seven plays it saw, and finetune with no flags
//! lowering the eighth play's held-out loss, under LoRA and QLoRA alike.

use crate::common;

use crate::examples::finetune;

use fitgrad::hf::{PretrainedGpt, Tokenizer, TOKENIZER_FILE};
use fitgrad::train::plays::{
    held_out_play, shakespeare_plays, shakespeare_text, training_plays, HELD_OUT_PLAY,
};
use fitgrad::DType;
use std::path::Path;

/// The order data/README.md lists them in.
const TITLES: [&str; 8] = [
    "HAMLET",
    "KING LEAR",
    "MACBETH",
    "OTHELLO",
    "ROMEO AND JULIET",
    "JULIUS CAESAR",
    "THE TEMPEST",
    "TWELFTH NIGHT",
];

#[test]
fn the_plays_split_apart() {
    let plays = shakespeare_plays();
    assert_eq!(plays.len(), 8);
    for (p, t) in plays.iter().zip(TITLES) {
        assert!(p.title.contains(t), "{} vs {t}", p.title);
        assert!(p.text.starts_with(&p.title));
        // One play each: one byline, and its own.
        assert_eq!(p.text.matches("by William Shakespeare").count(), 1, "{t}");
    }
    let whole: String = plays.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(whole, shakespeare_text());
    let seven = training_plays();
    assert_eq!(seven.len() + plays[HELD_OUT_PLAY].text.len(), whole.len());
    assert!(!seven.contains("TWELFTH NIGHT"));
    let (play, train, eval) = held_out_play();
    assert_eq!(play, plays[HELD_OUT_PLAY]);
    assert_eq!(format!("{train}{eval}"), play.text);
    let (lines, held) = (play.text.lines().count(), eval.lines().count());
    assert_eq!(held, lines / 10, "the last tenth of the lines");
}

#[test]
fn the_shipped_folder_is_small_and_its_tokenizer_is_the_seven_plays() {
    let dir = Path::new(finetune::SHIPPED_MODEL);
    let bytes: u64 = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(bytes <= 2_000_000, "{bytes} bytes");
    let folder = PretrainedGpt::open(dir, DType::F32).unwrap();
    let tok = folder.tokenizer().unwrap();
    assert_eq!(tok.vocab_size(), folder.config.vocab_size);
    // Byte-level: any text round-trips, Unicode, tabs and runs of spaces included.
    let text = "Où est   l'été?\tNaïve — ✓\n\nROMEO.";
    assert_eq!(tok.decode(&tok.encode(text).unwrap()).unwrap(), text);
    // The committed tokenizer is what training on the seven plays gives.
    let trained = Tokenizer::train_byte_level(&[&training_plays()], tok.vocab_size()).unwrap();
    let committed = std::fs::read_to_string(dir.join(TOKENIZER_FILE)).unwrap();
    assert_eq!(trained.to_json().unwrap(), committed);
}

/// The run `finetune` makes with no flags, shortened, and the same on an NF4 base: the
/// held-out loss falls, evaluated before, during and after, and QLoRA ends within 0.05 nats
/// of LoRA on the f32 base.
#[test]
#[allow(clippy::field_reassign_with_default)]
fn the_default_run_lowers_the_held_out_loss_under_lora_and_qlora() {
    let mut o = fitgrad::DeviceOptions::default();
    o.backend = Some("vulkan".into());
    let Some(dev) = common::fresh_device(o) else {
        return;
    };
    let short = ["--steps", "10", "--eval-every", "5"];
    let mut ends = Vec::new();
    for quant in ["none", "nf4"] {
        let args = finetune::Args::default_run(&[&short[..], &["--quantize", quant]].concat());
        let setup = finetune::prepare(&args).unwrap();
        let r = finetune::run(&args, setup, &dev).unwrap();
        let before = r.eval_before.unwrap().loss;
        let after = r.eval.unwrap().loss;
        assert_eq!(r.eval_during.len(), 1, "{quant}");
        assert!(after < before, "{quant}: {before} -> {after}");
        ends.push(after);
    }
    assert!((ends[0] - ends[1]).abs() < 0.05, "{ends:?}");
}
