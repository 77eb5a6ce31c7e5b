//! The eight plays of the embedded Shakespeare text, split apart by their title pages, and the
//! one the shipped model never saw (the eighth), cut into a part to fine-tune on and a held-out
//! part. One place, so the example that made the shipped model, the finetune example and the
//! tests agree on which text is which.

use super::data::gunzip_if_gz;
use std::path::Path;

/// The line under every play's title in data/shakespeare.txt.gz.
const BYLINE: &str = "\n\nby William Shakespeare\n";

/// Which play (0-based, in the text's order) the shipped model was not trained on: the
/// eighth, Twelfth Night.
pub const HELD_OUT_PLAY: usize = 7;

/// The fraction of the held-out play's lines kept for evaluation (its end).
pub const HELD_OUT_EVAL_FRACTION: f64 = 0.1;

/// One play: its title line and its whole text (title page included, up to the next play).
#[derive(Clone, Debug, PartialEq)]
pub struct Play {
    /// The title as the text prints it ("HAMLET, PRINCE OF DENMARK").
    pub title: String,
    /// The play's text.
    pub text: String,
}

/// The embedded text, as one string (data/shakespeare.txt.gz, UTF-8).
pub fn shakespeare_text() -> String {
    // The bytes are the crate's own and a test reads them, so a failure is a build defect.
    let raw = gunzip_if_gz(
        Path::new("shakespeare"),
        super::text::SHAKESPEARE_GZ.to_vec(),
    )
    .expect("the embedded shakespeare.txt.gz decodes");
    String::from_utf8(raw).expect("the embedded text is UTF-8")
}

/// The eight plays, in the text's order; their texts concatenate to [`shakespeare_text`].
pub fn shakespeare_plays() -> Vec<Play> {
    let text = shakespeare_text();
    // A play starts at the start of its title line, the line before the byline.
    let starts: Vec<usize> = text
        .match_indices(BYLINE)
        .map(|(at, _)| text[..at].rfind('\n').map_or(0, |nl| nl + 1))
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let end = starts.get(i + 1).copied().unwrap_or(text.len());
            let body = &text[s..end];
            Play {
                title: body.lines().next().unwrap_or("").trim().to_string(),
                text: body.to_string(),
            }
        })
        .collect()
}

/// The seven plays the shipped model was trained on, concatenated in order.
pub fn training_plays() -> String {
    shakespeare_plays()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != HELD_OUT_PLAY)
        .map(|(_, p)| p.text)
        .collect()
}

/// The held-out play cut at a line boundary into (fine-tuning part, evaluation part): the
/// last [`HELD_OUT_EVAL_FRACTION`] of its lines are for evaluation.
pub fn held_out_play() -> (Play, String, String) {
    let play = shakespeare_plays().swap_remove(HELD_OUT_PLAY);
    let lines: Vec<&str> = play.text.split_inclusive('\n').collect();
    let cut = lines.len() - (lines.len() as f64 * HELD_OUT_EVAL_FRACTION) as usize;
    let train = lines[..cut].concat();
    let eval = lines[cut..].concat();
    (play, train, eval)
}
