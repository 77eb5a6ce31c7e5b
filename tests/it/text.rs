//! Character text data (host code, no GPU): the vocabulary round trip and its errors, the
//! embedded Shakespeare corpus and its split, windows of tokens against a plain loop on random
//! sequences, contexts and strides (edges: one window, stride past the end), reproducible epoch
//! orders, typed errors for empty, non-UTF-8 and too short texts, and the bigram baseline
//! against a plain probability table.

use fitgrad::train::text::{bigram_baseline, CharVocab, TextCorpus, TextDataset, VALID_FRACTION};
use fitgrad::train::BatchSource;
use fitgrad::Error;
use proptest::prelude::*;
use std::io::Write;

#[test]
fn vocab_is_sorted_distinct_and_round_trips() {
    let v = CharVocab::from_text("hello, world").unwrap();
    assert_eq!(
        v.chars(),
        &[' ', ',', 'd', 'e', 'h', 'l', 'o', 'r', 'w'],
        "sorted distinct characters"
    );
    assert_eq!(v.len(), 9);
    assert_eq!(v.encode("hold").unwrap(), vec![4, 6, 5, 2]);
    assert_eq!(v.decode(&[4, 6, 5, 2]), "hold");
    // An id outside the vocabulary decodes to the replacement character.
    assert_eq!(v.decode(&[0, 9, 100]), " \u{FFFD}\u{FFFD}");
    let err = v.encode("hold x").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(
        msg.contains("'x'") && msg.contains("position 5"),
        "the error names the character and where: {msg}"
    );
    assert!(matches!(
        CharVocab::from_text(""),
        Err(Error::InvalidArgument { .. })
    ));

    proptest!(ProptestConfig::with_cases(32), |(s in "[a-cé\u{1F600} \n]{1,40}")| {
        let v = CharVocab::from_text(&s).unwrap();
        let ids = v.encode(&s).unwrap();
        prop_assert_eq!(ids.len(), s.chars().count());
        prop_assert!(ids.iter().all(|&i| (i as usize) < v.len()));
        prop_assert_eq!(v.decode(&ids), s.clone());
        prop_assert!(v.chars().windows(2).all(|w| w[0] < w[1]));
    });
}

#[test]
fn shakespeare_loads_and_splits() {
    let c = TextCorpus::shakespeare();
    assert_eq!(c.name, "shakespeare");
    assert_eq!(c.len(), 1_055_118, "characters in data/shakespeare.txt.gz");
    assert_eq!(c.vocab.len(), 76, "distinct characters");
    assert_eq!(c.valid.len(), (c.len() as f64 * VALID_FRACTION) as usize);
    assert_eq!(c.train.len() + c.valid.len(), c.len());
    let text = c.vocab.decode(&c.train[..200]);
    assert!(text.contains("Hamlet") || text.contains("HAMLET"), "{text}");
    let baseline = c.bigram_baseline().unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "shakespeare bigram baseline: {baseline:.4} nats/char"
    );
    // Between a character model that knows something and a uniform guess over 76 characters.
    assert!(
        baseline > 1.5 && baseline < (76f64).ln(),
        "bigram baseline {baseline}"
    );
}

#[test]
fn corpus_errors_are_typed_and_say_what_to_change() {
    // Empty, before or after gzip.
    for bytes in [Vec::new(), gzip(b"")] {
        let err = TextCorpus::from_bytes("empty.txt", &bytes).unwrap_err();
        assert!(
            matches!(&err, Error::Data { path, .. } if path == "empty.txt"),
            "{err:?}"
        );
        assert!(err.to_string().contains("empty"), "{err}");
    }
    // Invalid UTF-8 (a lone continuation byte), gzipped or not.
    for bytes in [b"abc\x80def".to_vec(), gzip(b"abc\x80def")] {
        let err = TextCorpus::from_bytes("latin1.txt", &bytes).unwrap_err();
        assert!(matches!(err, Error::Data { .. }), "{err:?}");
        assert!(err.to_string().contains("UTF-8"), "{err}");
    }
    // A gzipped text reads as the text itself.
    let plain = TextCorpus::from_bytes("a", b"to be or not to be, that is it").unwrap();
    let zipped = TextCorpus::from_bytes("a", &gzip(b"to be or not to be, that is it")).unwrap();
    assert_eq!(plain, zipped);
    // 30 characters: 27 train, 3 validation.
    assert_eq!((plain.train.len(), plain.valid.len()), (27, 3));
    assert!(plain.datasets(2).is_ok());
    let err = plain.datasets(3).unwrap_err();
    assert!(matches!(err, Error::Data { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("validation") && msg.contains("at most 2"),
        "the error says which part is short and how long the context may be: {msg}"
    );
    assert!(matches!(
        plain.datasets(0),
        Err(Error::InvalidArgument { .. })
    ));
    // A file, and a missing one.
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(b"to be or not to be, that is it").unwrap();
    let from_file = TextCorpus::from_file(f.path()).unwrap();
    assert_eq!(from_file.train, plain.train);
    assert_eq!(from_file.name, f.path().display().to_string());
    let missing = std::path::Path::new("/nonexistent/fitgrad/text.txt");
    assert!(matches!(
        TextCorpus::from_file(missing),
        Err(Error::Io { .. })
    ));
}

/// `data` gzipped.
fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn windows_match_a_plain_loop() {
    let strat = (1usize..40, 1usize..12, 1usize..6, any::<u64>());
    proptest!(ProptestConfig::with_cases(48), |((extra, context, stride, seed) in strat)| {
        // At least one window: context + 1 tokens, plus `extra - 1` more.
        let n = context + extra;
        let tokens: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 7).collect();
        let d = TextDataset::new(tokens.clone(), context).unwrap().with_stride(stride).unwrap();
        let starts: Vec<usize> = (0..n).step_by(stride).filter(|s| s + context < n).collect();
        prop_assert_eq!(d.len(), starts.len());
        prop_assert_eq!(d.context(), context);
        // Every sample, in a seeded order, as one batch.
        let order = d.epoch_order(seed, 0);
        let b = d.batch(&order).unwrap();
        prop_assert_eq!((b.batch, b.t), (order.len(), context));
        for (row, &i) in order.iter().enumerate() {
            let s = starts[i];
            for j in 0..context {
                prop_assert_eq!(b.ids[row * context + j], tokens[s + j]);
                prop_assert_eq!(b.targets[row * context + j], tokens[s + j + 1]);
            }
        }
        let err = d.batch(&[d.len()]).unwrap_err();
        prop_assert!(matches!(err, Error::InvalidArgument { .. }), "{:?}", err);
    });
    // Exactly one window, and the empty batch.
    let d = TextDataset::new(vec![3, 1, 4], 2).unwrap();
    assert_eq!(d.len(), 1);
    let b = d.batch(&[0]).unwrap();
    assert_eq!((b.ids, b.targets), (vec![3, 1], vec![1, 4]));
    let empty = d.batch(&[]).unwrap();
    assert_eq!((empty.batch, empty.ids.len()), (0, 0));
    // Typed errors.
    for (tokens, context) in [(vec![1, 2], 2), (vec![], 1), (vec![1, 2, 3], 0)] {
        let err = TextDataset::new(tokens, context).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    }
    assert!(matches!(
        d.clone().with_stride(0),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn epoch_order_is_reproducible() {
    let d = TextDataset::new((0..500).map(|i| i % 13).collect(), 16).unwrap();
    let a = d.epoch_order(7, 3);
    assert_eq!(a, d.epoch_order(7, 3), "same seed and epoch, same order");
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..d.len()).collect::<Vec<_>>(), "a permutation");
    assert_ne!(a, d.epoch_order(7, 4), "another epoch, another order");
    assert_ne!(a, d.epoch_order(8, 3), "another seed, another order");
}

/// The bigram baseline from an explicit (vocab, vocab) probability table whose rows are
/// checked to sum to 1.
fn bigram_reference(train: &[u32], valid: &[u32], vocab: usize) -> f64 {
    let mut table = vec![vec![1.0f64; vocab]; vocab];
    for w in train.windows(2) {
        table[w[0] as usize][w[1] as usize] += 1.0;
    }
    for row in &mut table {
        let total: f64 = row.iter().sum();
        row.iter_mut().for_each(|p| *p /= total);
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }
    let mut nats = 0.0;
    for w in valid.windows(2) {
        nats -= table[w[0] as usize][w[1] as usize].ln();
    }
    nats / (valid.len() - 1) as f64
}

#[test]
fn bigram_baseline_matches_a_probability_table() {
    // By hand: train "abab" has a->b twice, b->a once; vocab 2. p(b|a) = 3/4, p(a|b) = 2/3.
    let got = bigram_baseline(&[0, 1, 0, 1], &[0, 1, 0], 2).unwrap();
    let want = -((3.0f64 / 4.0).ln() + (2.0f64 / 3.0).ln()) / 2.0;
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // Nothing to learn from: uniform, ln(vocab).
    let uniform = bigram_baseline(&[], &[0, 1, 2, 3], 5).unwrap();
    assert!((uniform - 5f64.ln()).abs() < 1e-12, "{uniform}");

    let strat = (1usize..9, 0usize..60, 2usize..30, any::<u64>());
    proptest!(ProptestConfig::with_cases(32), |((vocab, n_train, n_valid, seed) in strat)| {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        };
        let train: Vec<u32> = (0..n_train).map(|_| next()).collect();
        let valid: Vec<u32> = (0..n_valid).map(|_| next()).collect();
        let got = bigram_baseline(&train, &valid, vocab).unwrap();
        let want = bigram_reference(&train, &valid, vocab);
        prop_assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "{} vs {}", got, want);
    });

    for (train, valid, vocab) in [
        (vec![0, 1], vec![0], 2),       // one validation token: no pair
        (vec![0, 1], vec![0, 1], 0),    // no vocabulary
        (vec![0, 2], vec![0, 1], 2),    // id outside the vocabulary
        (vec![0, 1], vec![0, 1, 5], 2), // likewise, in validation
    ] {
        let err = bigram_baseline(&train, &valid, vocab).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    }
}

/// A vocabulary of 60,000 characters: the baseline counts only the pairs that occur (a dense
/// (vocab, vocab) table of u64 would be 28.8 GB and abort), and gives what a plain loop over
/// the same add-one formula gives; a vocabulary past `MAX_VOCAB` is a typed error naming it.
#[test]
fn bigram_baseline_of_a_large_vocabulary_and_the_vocabulary_bound() {
    let vocab = 60_000usize;
    let train: Vec<u32> = (0..20_000u32).map(|i| (i * 7919) % vocab as u32).collect();
    let valid: Vec<u32> = (0..500u32).map(|i| (i * 7919 + 3) % vocab as u32).collect();
    let got = bigram_baseline(&train, &valid, vocab).unwrap();
    let count = |a: u32, b: u32| train.windows(2).filter(|w| w[0] == a && w[1] == b).count();
    let row = |a: u32| train[..train.len() - 1].iter().filter(|&&t| t == a).count();
    let want: f64 = valid
        .windows(2)
        .map(|w| -((count(w[0], w[1]) as f64 + 1.0) / (row(w[0]) as f64 + vocab as f64)).ln())
        .sum::<f64>()
        / (valid.len() - 1) as f64;
    assert!((got - want).abs() < 1e-9, "{got} vs {want}");

    let max = fitgrad::train::text::MAX_VOCAB;
    let text: String = (0..=max as u32)
        .map(|i| char::from_u32(0x10000 + i).unwrap())
        .collect();
    let err = CharVocab::from_text(&text).unwrap_err().to_string();
    assert!(err.contains(&max.to_string()), "{err}");
    assert_eq!(
        CharVocab::from_text(&text[..text.len() - 4]).unwrap().len(),
        max
    );
    let err = TextCorpus::from_text("wide.txt", &text).unwrap_err();
    assert!(matches!(err, Error::Data { .. }), "{err:?}");
}

/// A text too short for any context says how long the text must be, never "a context of at
/// most 0"; the vocabulary's and the text's hashes tell texts apart.
#[test]
fn short_texts_and_text_identity() {
    let c = TextCorpus::from_text("tiny", "abc").unwrap();
    let msg = c.datasets(8).unwrap_err().to_string();
    assert!(
        msg.contains("at least 90 characters") && !msg.contains("at most 0"),
        "{msg}"
    );
    let a = TextCorpus::from_text("a", "to be or not to be").unwrap();
    let b = TextCorpus::from_text("b", "be or not to be to").unwrap();
    assert_eq!(a.vocab.hash(), b.vocab.hash());
    assert_ne!(a.hash(), b.hash());
    let (v, w) = (
        CharVocab::from_text("to be").unwrap(),
        CharVocab::from_text("up cf").unwrap(),
    );
    assert_eq!(v.len(), w.len());
    assert_ne!(v.hash(), w.hash());
}
