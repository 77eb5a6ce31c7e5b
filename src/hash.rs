//! 64-bit FNV-1a, the one hash of things that are stored or compared across processes: the
//! autotuner's cache file names, the data a checkpoint was trained on, the model identity of
//! data-parallel replicas, ids within a page.
//!
//! Written out here because std's `DefaultHasher` may change between Rust releases (which would
//! orphan every stored hash); FNV-1a is a fixed function of its input on every platform.

const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// An FNV-1a state: feed it bytes or words, read the hash with [`Fnv1a::finish`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(OFFSET)
    }
}

impl Fnv1a {
    /// Mixes in each byte.
    pub(crate) fn bytes(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
        self
    }

    /// Mixes in each word whole (one multiply per word: 4x fewer than its bytes, for long
    /// token or pixel arrays). Not the hash of the words' bytes.
    pub(crate) fn words(mut self, words: impl IntoIterator<Item = u64>) -> Self {
        for w in words {
            self.0 = (self.0 ^ w).wrapping_mul(PRIME);
        }
        self
    }

    /// The hash.
    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

/// FNV-1a of `bytes`.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    Fnv1a::default().bytes(bytes).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_the_published_function() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        // A word is one step: a byte-sized word hashes as that byte.
        assert_eq!(Fnv1a::default().words([97]).finish(), fnv1a(b"a"));
    }
}
