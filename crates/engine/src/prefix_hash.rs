//! Rolling token-prefix hash: every stage keeps the hash of the tokens it has processed for a
//! session and checks the coordinator's hash before computing, so a stage that missed or
//! repeated a chunk is caught instead of silently producing wrong text.

/// FNV-1a offset basis: the hash of the empty prefix.
pub const EMPTY: u64 = 0xcbf2_9ce4_8422_2325;

/// Extends a prefix hash by `tokens`.
pub fn extend(mut h: u64, tokens: &[u32]) -> u64 {
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

pub fn of(tokens: &[u32]) -> u64 {
    extend(EMPTY, tokens)
}

#[cfg(test)]
mod tests {
    #[test]
    fn extending_equals_hashing_the_concatenation() {
        let a = [1u32, 2, 3];
        let b = [4u32, 5];
        assert_eq!(
            super::extend(super::of(&a), &b),
            super::of(&[1, 2, 3, 4, 5])
        );
        assert_ne!(super::of(&[1, 2]), super::of(&[2, 1]));
    }
}
