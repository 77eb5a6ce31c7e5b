//! `Tokenizer`: a Hugging Face `tokenizer.json` read offline through the `tokenizers` crate
//! (pure Rust: fancy-regex, no onig or esaxx C++), encoding and decoding as the Python library
//! does.

use std::path::Path;

use crate::{Error, Result};

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

    fn err(&self, e: tokenizers::Error) -> Error {
        Error::Data {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}
