//! The ranks' start-up agreement on every setting that shapes the run ([`agree_settings`]):
//! steps, batch, accumulation, model, data, precision and the rest change the number or the
//! shape of the collectives, so ranks started with different ones would exchange buffers of
//! different lengths (a corrupted heap under MPI) or wait on one another forever. One hash of
//! the resolved settings is compared in one small all-gather; only when it differs are the
//! settings' own hashes gathered, to name the first that differs.

use super::comm::Communicator;
use crate::hash::Fnv1a;
use crate::{Error, Result};

/// The hash of one setting: its name and its value, each length-prefixed (so ("ab", "c") and
/// ("a", "bc") differ).
pub fn setting_hash(name: &str, value: &str) -> u64 {
    Fnv1a::default()
        .words([name.len() as u64])
        .bytes(name.as_bytes())
        .words([value.len() as u64])
        .bytes(value.as_bytes())
        .finish()
}

/// The one hash of `settings` (name, resolved value), in their order.
pub fn settings_hash(settings: &[(&str, String)]) -> u64 {
    Fnv1a::default()
        .words(settings.iter().map(|(n, v)| setting_hash(n, v)))
        .finish()
}

/// Of `gathered` (every rank's hashes of the same `count` settings, rank after rank), the
/// index of the first setting some rank holds otherwise than rank 0, and those ranks.
pub fn first_difference(gathered: &[u64], count: usize) -> Option<(usize, Vec<usize>)> {
    if count == 0 {
        return None;
    }
    let ranks: Vec<&[u64]> = gathered.chunks(count).collect();
    (0..count).find_map(|i| {
        let differ: Vec<usize> = (1..ranks.len())
            .filter(|&r| ranks[r].get(i) != ranks[0].get(i))
            .collect();
        (!differ.is_empty()).then_some((i, differ))
    })
}

/// The error every rank ends on when setting `name` (this rank's `value`) differs from rank
/// 0's on `differ`.
fn disagreement(rank: usize, name: &str, value: &str, differ: &[usize]) -> Error {
    let ranks = differ
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Error::Distributed {
        rank,
        reason: format!(
            "{name} differs between the ranks (rank {ranks} from rank 0; this rank has \
             {value:?}): every rank must start with the same {name}, since it changes the \
             run's collectives; start them all with one command line"
        ),
    }
}

/// Agrees on `settings` (each a flag's name and its resolved value, in the same order on every
/// rank) among `comm`'s members, before any collective of the run: `Ok` when every member
/// holds the same ones. Otherwise every member returns the same [`Error::Distributed`] naming
/// the first setting that differs (its name; this member's value), so every rank ends on one
/// message. Two small all-gathers at most; a member alone agrees with itself.
pub fn agree_settings(comm: &mut dyn Communicator, settings: &[(&str, String)]) -> Result<()> {
    match disagreement_of(comm, settings)? {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// [`agree_settings`]'s exchange: `Err` when a collective failed (on some rank), else the
/// disagreement every member found alike, if any.
pub(crate) fn disagreement_of(
    comm: &mut dyn Communicator,
    settings: &[(&str, String)],
) -> Result<Option<Error>> {
    if comm.size() < 2 {
        return Ok(None);
    }
    let rank = comm.rank();
    let summary = comm.all_gather(&[settings_hash(settings), settings.len() as u64])?;
    let pairs: Vec<&[u64]> = summary.chunks(2).collect();
    if pairs.iter().all(|p| p == &pairs[0]) {
        return Ok(None);
    }
    if pairs.iter().any(|p| p[1] != pairs[0][1]) {
        // Another number of settings: another program (or build) on some rank.
        let differ: Vec<usize> = (1..pairs.len())
            .filter(|&r| pairs[r][1] != pairs[0][1])
            .collect();
        return Ok(Some(disagreement(
            rank,
            "the program",
            &format!("{} settings", settings.len()),
            &differ,
        )));
    }
    let each: Vec<u64> = settings.iter().map(|(n, v)| setting_hash(n, v)).collect();
    let gathered = comm.all_gather(&each)?;
    // None although the summaries differ: a collision of the whole hash, not a difference.
    Ok(first_difference(&gathered, settings.len())
        .map(|(i, differ)| disagreement(rank, settings[i].0, &settings[i].1, &differ)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(steps: &str, batch: &str) -> Vec<(&'static str, String)> {
        vec![
            ("--steps", steps.to_string()),
            ("--batch-size", batch.to_string()),
            ("--precision", "f32".to_string()),
        ]
    }

    #[test]
    fn the_hash_sees_every_setting_and_its_name() {
        let a = settings_hash(&settings("100", "32"));
        assert_eq!(a, settings_hash(&settings("100", "32")));
        assert_ne!(a, settings_hash(&settings("101", "32")));
        assert_ne!(a, settings_hash(&settings("100", "33")));
        assert_ne!(setting_hash("ab", "c"), setting_hash("a", "bc"));
        assert_ne!(setting_hash("--steps", "1"), setting_hash("--epochs", "1"));
    }

    #[test]
    fn the_first_differing_setting_is_named_with_its_ranks() {
        let hashes = |s: &[(&str, String)]| -> Vec<u64> {
            s.iter().map(|(n, v)| setting_hash(n, v)).collect()
        };
        let same = [
            hashes(&settings("100", "32")),
            hashes(&settings("100", "32")),
        ]
        .concat();
        assert_eq!(first_difference(&same, 3), None);
        let gathered = [
            hashes(&settings("100", "32")),
            hashes(&settings("100", "64")),
            hashes(&settings("7", "64")),
        ]
        .concat();
        assert_eq!(first_difference(&gathered, 3), Some((0, vec![2])));
        let gathered = [
            hashes(&settings("100", "32")),
            hashes(&settings("100", "64")),
            hashes(&settings("100", "64")),
        ]
        .concat();
        assert_eq!(first_difference(&gathered, 3), Some((1, vec![1, 2])));
        let e = disagreement(1, "--batch-size", "64", &[1, 2]).to_string();
        assert!(
            e.contains("--batch-size differs") && e.contains("rank 1, 2") && e.contains("\"64\""),
            "{e}"
        );
    }
}
