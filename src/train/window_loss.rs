//! `window_loss`: a language model's loss on a whole token sequence as the Hugging Face
//! evaluations compute it: consecutive windows of `context + 1` tokens, one starting every
//! `context` tokens (the last may be shorter), each its own forward from position 0, and the
//! token-weighted mean next-token cross-entropy over all of them.

use crate::nn::LanguageModel;
use crate::{DType, Error, Result};

/// What [`window_loss`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowLoss {
    /// Mean next-token cross-entropy in nats over every predicted token.
    pub loss: f64,
    /// Tokens predicted (the sequence's length less one).
    pub tokens: usize,
    /// Windows run.
    pub windows: usize,
}

/// The loss of `model` on `tokens` in windows of `context + 1` tokens starting every `context`
/// tokens, `batch` full windows per forward (the shorter last one alone), with the matmuls in
/// `dtype`. Runs under `no_grad`; the model's dropout follows its training mode. Under a
/// budget, a forward of several windows that does not fit is split in halves (the same windows,
/// so the same loss up to the rounding of the sum).
///
/// Errors, before any device work: [`Error::InvalidArgument`] for fewer than 2 tokens, a
/// `context` or `batch` of 0, a context past the model's, and the id checks of
/// the model's forward ([`Gpt::forward_ids`](crate::nn::Gpt::forward_ids)).
pub fn window_loss<M: LanguageModel + ?Sized>(
    model: &M,
    tokens: &[u32],
    context: usize,
    batch: usize,
    dtype: DType,
) -> Result<WindowLoss> {
    let bad = |reason: String| {
        Err(Error::InvalidArgument {
            op: "window_loss",
            reason,
        })
    };
    if tokens.len() < 2 {
        return bad(format!(
            "{} tokens: the loss needs at least 2 (one to predict from, one to predict)",
            tokens.len()
        ));
    }
    if context == 0 || batch == 0 {
        return bad(format!(
            "context and batch must be at least 1, got {context} and {batch}"
        ));
    }
    if context > model.context() {
        return bad(format!(
            "context {context} passes the model's {} positions",
            model.context()
        ));
    }
    model.check_vocab("window_loss", tokens)?;
    let _g = crate::no_grad();
    // Window w covers tokens[w C .. min(w C + C + 1, n)]; those with a single token predict
    // nothing.
    let starts: Vec<usize> = (0..tokens.len() - 1).step_by(context).collect();
    let (full, short): (Vec<usize>, Vec<usize>) =
        starts.iter().partition(|&&s| s + context < tokens.len());
    let mut nats = 0.0f64;
    let mut groups: Vec<(Vec<usize>, usize)> =
        full.chunks(batch).map(|c| (c.to_vec(), context)).collect();
    groups.extend(short.iter().map(|&s| (vec![s], tokens.len() - 1 - s)));
    // In order; a group that runs out of memory (a budget's typed error, raised before the
    // driver is asked) is split in halves, so a budget bounds evaluation as it bounds
    // `Trainer::evaluate`: only one window that does not fit is an error.
    groups.reverse();
    while let Some((starts, t)) = groups.pop() {
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for &s in &starts {
            ids.extend_from_slice(&tokens[s..s + t]);
            targets.extend_from_slice(&tokens[s + 1..s + t + 1]);
        }
        let mean = match model
            .loss_in(&ids, &targets, starts.len(), t, dtype)
            .and_then(|l| l.item())
        {
            Err(Error::OutOfMemory { .. }) if starts.len() > 1 => {
                let (a, b) = starts.split_at(starts.len().div_ceil(2));
                groups.push((b.to_vec(), t));
                groups.push((a.to_vec(), t));
                continue;
            }
            other => other?,
        };
        nats += mean as f64 * (starts.len() * t) as f64;
    }
    Ok(WindowLoss {
        loss: nats / (tokens.len() - 1) as f64,
        tokens: tokens.len() - 1,
        windows: starts.len(),
    })
}
