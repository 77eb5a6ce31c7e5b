//! `Tokenizer`: a Hugging Face `tokenizer.json` read offline through the `tokenizers` crate
//! (pure Rust: fancy-regex, no onig or esaxx C++), encoding and decoding as the Python library
//! does.

use std::path::Path;

use crate::{Error, Result};

/// GPT-2's one special token, which starts and ends texts.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The tokenizer's file in a model folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The `tokenizer.json` of the model folder `dir`, or an [`Error::Data`] naming the folder if
/// it has none.
pub(crate) fn folder_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let path = dir.join(TOKENIZER_FILE);
    if !path.is_file() {
        return Err(Error::Data {
            path: dir.display().to_string(),
            reason: format!("no {TOKENIZER_FILE} in the model folder"),
        });
    }
    Tokenizer::from_file(&path)
}

/// A tokenizer from a `tokenizer.json` (byte-level BPE for GPT-2, SentencePiece-style BPE for
/// Llama). Encoding adds no special tokens: text is tokenized as it is.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
}

impl Tokenizer {
    /// Reads `path`. Errors: [`Error::Io`] when it cannot be read, [`Error::Data`] naming it when
    /// it is not a tokenizer the crate understands.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: name.clone(),
            source,
        })?;
        Tokenizer::from_bytes(&bytes, &name)
    }

    /// A tokenizer from the bytes of a `tokenizer.json`; `source` names it in errors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| Error::Data {
            path: source.to_string(),
            reason: format!("not a tokenizer.json the tokenizers crate reads: {e}"),
        })?;
        Ok(Tokenizer {
            inner,
            path: source.to_string(),
        })
    }

    /// The ids of `text`, with no special tokens added (a special token's own text, such as
    /// `<|endoftext|>`, still becomes its id, as in Python).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens kept. Errors: [`Error::Data`] for an id outside the
    /// vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let v = self.vocab_size();
        if let Some(id) = ids.iter().find(|&&id| id as usize >= v) {
            return Err(Error::InvalidArgument {
                op: "Tokenizer::decode",
                reason: format!("id {id} is outside the tokenizer's vocabulary of {v}"),
            });
        }
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }

    /// Ids are below this (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token's text (`<|endoftext|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A byte-level BPE tokenizer as GPT-2's is made (the ByteLevel pre-tokenizer with GPT-2's
    /// split pattern and no prefix space, the ByteLevel decoder, all 256 bytes in the initial
    /// alphabet, so any text encodes) trained on `texts` to at most `vocab_size` tokens, pairs
    /// seen at least twice merged. [`END_OF_TEXT`] is its one special token, id 0. Pure Rust
    /// (the tokenizers crate's BPE trainer), deterministic.
    ///
    /// Errors: [`Error::InvalidArgument`] for a vocabulary under 257 (the bytes and the special
    /// token) or no text.
    pub fn train_byte_level(texts: &[&str], vocab_size: usize) -> Result<Tokenizer> {
        use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
        use tokenizers::models::TrainerWrapper;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let op = "Tokenizer::train_byte_level";
        if vocab_size < 257 || texts.iter().all(|t| t.is_empty()) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "a byte-level BPE needs a vocabulary of at least 257 (256 bytes and \
                     {END_OF_TEXT}) and some text; got {vocab_size} over {} texts",
                    texts.len()
                ),
            });
        }
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![tokenizers::AddedToken::from(END_OF_TEXT, true)])
            .build()
            .into();
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner
            .train(&mut trainer, texts.iter())
            .map_err(|e| Error::InvalidArgument {
                op,
                reason: format!("BPE training failed: {e}"),
            })?;
        Ok(Tokenizer {
            inner,
            path: "a trained tokenizer".into(),
        })
    }

    /// The `tokenizer.json` text of this tokenizer (what transformers and [`Tokenizer::from_bytes`]
    /// read).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(|e| self.err(e))
    }

    fn err(&self, e: tokenizers::Error) -> Error {
        Error::Data {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}
