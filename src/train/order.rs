//! The seeded orders of samples: one shuffle, used by every data source and the split.

use crate::tensor::Rng;

/// The seeded shuffle of 0..n for one epoch (the one copy every data source uses).
pub fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    // Hash the epoch before mixing it in: SplitMix64 streams whose seeds differ by a multiple
    // of its increment are shifted copies of each other.
    let mut rng = Rng::new(seed ^ Rng::new(epoch ^ 0xA076_1D64_78BD_642F).next_u64());
    permutation(n, &mut rng)
}

/// Fisher–Yates over 0..n.
pub(crate) fn permutation(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        // Multiply-shift maps 64 random bits to 0..=i; the bias is below 2^-32 for any real n.
        let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}
