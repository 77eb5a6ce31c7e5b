//! Text for character-level language models: a [`CharVocab`] (the sorted distinct characters
//! of a text), a [`TextCorpus`] (a text encoded and split into train and validation parts; the
//! Shakespeare plays embedded in the crate, or any UTF-8 file), [`TextDataset`] (windows of
//! `context + 1` tokens as [`TokenBatch`]es for next-character prediction, a [`BatchSource`]
//! for the trainer) and [`bigram_baseline`], the figure a model must beat. [`Gpt`] trains on
//! [`TokenBatch`]es through the trainer (its `TrainModel` implementation is here).
//!
//! Everything here is host code and checked before any device work: an empty or non-UTF-8
//! text, a split shorter than one window, a context of 0 are typed errors.

use std::collections::HashMap;
use std::path::Path;

use super::data::{data_err, gunzip_if_gz, read_maybe_gz};
use super::model::{check_indices, Batch, BatchSource, StepContext, TrainModel};
use crate::nn::Gpt;
use crate::{Error, Result, Tensor};

/// Eight Shakespeare plays (1,055,118 characters, 76 distinct), gzipped; see data/README.md.
pub(super) const SHAKESPEARE_GZ: &[u8] = include_bytes!("../../data/shakespeare.txt.gz");

/// The share of a text (its last characters) held out for validation.
pub const VALID_FRACTION: f64 = 0.1;

/// The most distinct characters a [`CharVocab`] holds: every Unicode script a text is likely to
/// mix fits, while the (vocab, dim) embedding and the (batch, context, vocab) logits of a
/// character model stay sizes a device can hold (65,536 x 64 f32 is 16 MiB; logits of 16 x 32
/// windows are 128 MiB, one binding's limit).
pub const MAX_VOCAB: usize = 1 << 16;

/// The largest vocabulary whose bigram counts are a dense table (2,048² u64 are 32 MiB); a
/// larger one counts only the pairs that occur, in a hash map (10-15x slower per pair).
const DENSE_BIGRAM_VOCAB: usize = 2048;

/// The distinct characters of a text, sorted; a character's id is its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    /// Sorted, distinct.
    chars: Vec<char>,
}

impl CharVocab {
    /// The sorted distinct characters of `text`; an empty text has no vocabulary, and one of
    /// more than [`MAX_VOCAB`] characters is refused (both [`Error::InvalidArgument`]).
    pub fn from_text(text: &str) -> Result<CharVocab> {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "CharVocab::from_text",
                reason,
            })
        };
        if chars.is_empty() {
            return bad("the text is empty: a vocabulary needs at least one character".into());
        }
        if chars.len() > MAX_VOCAB {
            return bad(format!(
                "the text has {} distinct characters, more than the {MAX_VOCAB} a character \
                 vocabulary holds; give a text with fewer distinct characters",
                chars.len()
            ));
        }
        Ok(CharVocab { chars })
    }

    /// A hash of the characters in id order (FNV-1a of their code points): two vocabularies
    /// with the same hash give every character the same id. Checkpoints store it, so a resume
    /// on another text is refused even when the sizes agree.
    pub fn hash(&self) -> u64 {
        crate::hash::Fnv1a::default()
            .words(self.chars.iter().map(|&c| u64::from(c)))
            .finish()
    }

    /// Ids of the characters of `s`; a character outside the vocabulary is an error naming it
    /// and its position.
    pub fn encode(&self, s: &str) -> Result<Vec<u32>> {
        s.chars()
            .enumerate()
            .map(|(i, c)| {
                self.id(c).ok_or_else(|| Error::InvalidArgument {
                    op: "CharVocab::encode",
                    reason: format!(
                        "character {c:?} (U+{:04X}) at position {i} is not in the vocabulary of {} characters",
                        c as u32,
                        self.chars.len()
                    ),
                })
            })
            .collect()
    }

    /// The id of `c`, if it is in the vocabulary.
    pub fn id(&self, c: char) -> Option<u32> {
        self.chars.binary_search(&c).ok().map(|i| i as u32)
    }

    /// The text of `ids`; an id outside the vocabulary becomes U+FFFD (the replacement
    /// character), so sampling output never fails.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| {
                self.chars
                    .get(i as usize)
                    .copied()
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect()
    }

    /// Characters in the vocabulary (the model's vocabulary size).
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Never true: a vocabulary holds at least one character.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters, in id order.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }
}

/// A text encoded with its own vocabulary and split: the last [`VALID_FRACTION`] of its
/// characters for validation, the rest for training.
#[derive(Clone, Debug, PartialEq)]
pub struct TextCorpus {
    /// Where the text came from (a file's path, or "shakespeare").
    pub name: String,
    /// The distinct characters of the whole text.
    pub vocab: CharVocab,
    /// Token ids of the training part.
    pub train: Vec<u32>,
    /// Token ids of the validation part (the text's end).
    pub valid: Vec<u32>,
}

impl TextCorpus {
    /// The Shakespeare plays embedded in the crate (data/shakespeare.txt.gz).
    pub fn shakespeare() -> TextCorpus {
        // The bytes are the crate's own and a test loads them, so a failure is a build defect.
        TextCorpus::from_bytes("shakespeare", SHAKESPEARE_GZ)
            .expect("the embedded shakespeare.txt.gz decodes")
    }

    /// `text`, named `name` in errors. An empty text is [`Error::Data`].
    pub fn from_text(name: &str, text: &str) -> Result<TextCorpus> {
        if text.is_empty() {
            return Err(data_err(
                Path::new(name),
                "the text is empty; give a file with at least one window of text",
            ));
        }
        let vocab = CharVocab::from_text(text).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => data_err(Path::new(name), reason),
            e => e,
        })?;
        let mut ids = vocab.encode(text)?;
        let n_valid = (ids.len() as f64 * VALID_FRACTION) as usize;
        let valid = ids.split_off(ids.len() - n_valid);
        Ok(TextCorpus {
            name: name.to_string(),
            vocab,
            train: ids,
            valid,
        })
    }

    /// The text in `bytes` (gzipped or not, detected by the magic bytes), which must be UTF-8
    /// ([`Error::Data`] naming the first bad byte otherwise).
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<TextCorpus> {
        let path = Path::new(name);
        let raw = gunzip_if_gz(path, bytes.to_vec())?;
        let text = std::str::from_utf8(&raw).map_err(|e| {
            data_err(
                path,
                format!("not UTF-8 text: {e} (save the file as UTF-8; the model reads characters)"),
            )
        })?;
        TextCorpus::from_text(name, text)
    }

    /// The text file at `path` (optionally gzipped).
    pub fn from_file(path: &Path) -> Result<TextCorpus> {
        let raw = read_maybe_gz(path)?;
        TextCorpus::from_bytes(&path.display().to_string(), &raw)
    }

    /// Characters in the whole text.
    pub fn len(&self) -> usize {
        self.train.len() + self.valid.len()
    }

    /// Never true: a corpus holds at least one character.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (train, validation) datasets of windows of `context + 1` tokens: every start in the
    /// training part (stride 1), non-overlapping windows in the validation part (stride
    /// `context`, so each validation character is predicted once). Either part shorter than one
    /// window is an error that says how long the context may be.
    pub fn datasets(&self, context: usize) -> Result<(TextDataset, TextDataset)> {
        let check = |part: &str, n: usize| {
            if context > 0 && n < context + 1 {
                // Both parts need a whole window: the validation part (the last
                // VALID_FRACTION) does at ceil((context + 1) / VALID_FRACTION) characters.
                let need = ((context + 1) as f64 / VALID_FRACTION).ceil() as usize;
                let fits = self.train.len().min(self.valid.len()).saturating_sub(1);
                let shorter = if fits > 0 {
                    format!(", or a context of at most {fits}")
                } else {
                    String::new()
                };
                return Err(data_err(
                    Path::new(&self.name),
                    format!(
                        "the {part} part holds {n} characters, fewer than one window of context + 1 = {}; \
                         a context of {context} needs a text of at least {need} characters (this one has {}): \
                         give a longer text{shorter}",
                        context + 1,
                        self.len()
                    ),
                ));
            }
            Ok(())
        };
        check("training", self.train.len())?;
        check("validation", self.valid.len())?;
        Ok((
            TextDataset::new(self.train.clone(), context)?,
            TextDataset::new(self.valid.clone(), context)?.with_stride(context)?,
        ))
    }

    /// A hash of the token ids of the whole text (train, then validation) and its length:
    /// the text a checkpoint was trained on, whatever its file is called.
    pub fn hash(&self) -> u64 {
        crate::hash::Fnv1a::default()
            .words(self.train.iter().chain(&self.valid).map(|&t| u64::from(t)))
            .words([self.len() as u64])
            .finish()
    }

    /// [`bigram_baseline`] of this corpus's split.
    pub fn bigram_baseline(&self) -> Result<f64> {
        bigram_baseline(&self.train, &self.valid, self.vocab.len())
    }
}

/// A batch of token windows: sample b holds inputs `ids[b * t..(b + 1) * t]` and, shifted by
/// one token, targets `targets[b * t..(b + 1) * t]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// (batch, t) input ids, row-major.
    pub ids: Vec<u32>,
    /// (batch, t) next-token ids, row-major.
    pub targets: Vec<u32>,
    /// Windows in the batch.
    pub batch: usize,
    /// Tokens per window (the context).
    pub t: usize,
}

impl Batch for TokenBatch {
    fn len(&self) -> usize {
        self.batch
    }
}

/// Windows of `context + 1` tokens of one token sequence, for next-token prediction. Sample i
/// starts at token `i * stride`. An epoch's order is the trainer's seeded shuffle of the samples
/// ([`BatchSource::epoch_order`]: it depends only on (seed, epoch), so a resumed run sees the
/// same windows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextDataset {
    tokens: Vec<u32>,
    context: usize,
    stride: usize,
}

impl TextDataset {
    /// Every window of `context + 1` consecutive tokens of `tokens` (stride 1). A context of 0
    /// or fewer than `context + 1` tokens is [`Error::InvalidArgument`].
    pub fn new(tokens: Vec<u32>, context: usize) -> Result<TextDataset> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "TextDataset::new",
                reason,
            })
        };
        if context == 0 {
            return bad("the context must be at least 1 token".into());
        }
        if tokens.len() < context + 1 {
            return bad(format!(
                "{} tokens are fewer than one window of context + 1 = {}; use a context of at most {} or more text",
                tokens.len(),
                context + 1,
                tokens.len().saturating_sub(1)
            ));
        }
        Ok(TextDataset {
            tokens,
            context,
            stride: 1,
        })
    }

    /// The same tokens with windows starting every `stride` tokens (`stride = context`: windows
    /// that do not overlap, for evaluation).
    pub fn with_stride(mut self, stride: usize) -> Result<TextDataset> {
        if stride == 0 {
            return Err(Error::InvalidArgument {
                op: "TextDataset::with_stride",
                reason: "the stride must be at least 1 token".into(),
            });
        }
        self.stride = stride;
        Ok(self)
    }

    /// Tokens per window's input (T).
    pub fn context(&self) -> usize {
        self.context
    }

    /// The token sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl BatchSource for TextDataset {
    type Batch = TokenBatch;

    fn len(&self) -> usize {
        // Starts 0, stride, ... up to the last start with a whole window after it.
        (self.tokens.len() - self.context - 1) / self.stride + 1
    }

    fn batch(&self, indices: &[usize]) -> Result<TokenBatch> {
        check_indices("TextDataset::batch", indices, BatchSource::len(self))?;
        let t = self.context;
        let mut b = TokenBatch {
            ids: Vec::with_capacity(indices.len() * t),
            targets: Vec::with_capacity(indices.len() * t),
            batch: indices.len(),
            t,
        };
        for &i in indices {
            let start = i * self.stride;
            b.ids.extend_from_slice(&self.tokens[start..start + t]);
            b.targets
                .extend_from_slice(&self.tokens[start + 1..start + t + 1]);
        }
        Ok(b)
    }
}

/// Nats per character of an add-one-smoothed character bigram model, fitted on `train` and
/// evaluated on every consecutive pair of `valid`: `p(b | a) = (count(a, b) + 1) / (count(a) +
/// vocab)`, counts over `train`'s pairs: the reference a character model must beat. An id
/// `>= vocab`, a vocabulary of 0 or a validation part of fewer than two tokens is
/// [`Error::InvalidArgument`].
pub fn bigram_baseline(train: &[u32], valid: &[u32], vocab: usize) -> Result<f64> {
    let bad = |reason: String| {
        Err(Error::InvalidArgument {
            op: "bigram_baseline",
            reason,
        })
    };
    if vocab == 0 || valid.len() < 2 {
        return bad(format!(
            "need a vocabulary of at least 1 and at least 2 validation tokens, got {vocab} and {}",
            valid.len()
        ));
    }
    if let Some(&id) = train.iter().chain(valid).find(|&&i| i as usize >= vocab) {
        return bad(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ));
    }
    // A dense (vocab, vocab) table while it is small (up to 2,048 characters: 32 MiB), else
    // only the pairs that occur (65,536 characters would make a dense table of 32 GiB).
    let dense = vocab <= DENSE_BIGRAM_VOCAB;
    let mut table = vec![0u64; if dense { vocab * vocab } else { 0 }];
    let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
    let mut row_totals = vec![0u64; vocab];
    for w in train.windows(2) {
        if dense {
            table[w[0] as usize * vocab + w[1] as usize] += 1;
        } else {
            *pairs.entry((w[0], w[1])).or_insert(0) += 1;
        }
        row_totals[w[0] as usize] += 1;
    }
    let count = |a: u32, b: u32| {
        if dense {
            table[a as usize * vocab + b as usize]
        } else {
            pairs.get(&(a, b)).copied().unwrap_or(0)
        }
    };
    let v = vocab as f64;
    let nats: f64 = valid
        .windows(2)
        .map(|w| {
            let p = (count(w[0], w[1]) as f64 + 1.0) / (row_totals[w[0] as usize] as f64 + v);
            -p.ln()
        })
        .sum();
    Ok(nats / (valid.len() - 1) as f64)
}

impl TrainModel<TokenBatch> for crate::nn::Llama {
    /// The mean next-token cross-entropy of the batch's windows, matmuls in the step's dtype.
    fn forward_loss(&self, b: &TokenBatch, ctx: &StepContext) -> Result<Tensor> {
        self.loss_in(&b.ids, &b.targets, b.batch, b.t, ctx.dtype)
    }

    /// Sets [`Llama::set_checkpoint_blocks`](crate::nn::Llama::set_checkpoint_blocks).
    fn set_checkpointing(&mut self, on: bool) -> bool {
        self.set_checkpoint_blocks(on);
        true
    }
}

impl TrainModel<TokenBatch> for Gpt {
    /// The mean next-token cross-entropy of the batch's (batch, t) windows, with the matmuls in
    /// the step's dtype (f16 under mixed precision; the loss is f32).
    fn forward_loss(&self, b: &TokenBatch, ctx: &StepContext) -> Result<Tensor> {
        self.loss_in(&b.ids, &b.targets, b.batch, b.t, ctx.dtype)
    }

    /// Sets [`Gpt::set_checkpoint_blocks`]: every block can be checkpointed.
    fn set_checkpointing(&mut self, on: bool) -> bool {
        self.set_checkpoint_blocks(on);
        true
    }
}
