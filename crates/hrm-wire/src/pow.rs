//! The proof of work that registration costs (hashcash style): the hub hands out a challenge;
//! the client finds a `nonce` such that SHA-256 over the challenge, its own API key and the
//! nonce starts with the challenge's number of zero bits. Binding the key means every
//! registration needs its own search; the hub checks one hash.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What the client sends back with `POST /api/v1/auth/register`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Proof {
    pub challenge: String,
    pub nonce: u64,
}

/// The digest a proof is judged by.
pub fn digest(challenge: &str, api_key: &str, nonce: u64) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"hrm-register-v1\0");
    hasher.update(challenge.as_bytes());
    hasher.update(b"\0");
    hasher.update(api_key.as_bytes());
    hasher.update(b"\0");
    hasher.update(nonce.to_le_bytes());
    hasher.finalize().into()
}

/// Zero bits at the start of `hash`.
pub fn leading_zero_bits(hash: &[u8]) -> u32 {
    let mut bits = 0;
    for byte in hash {
        if *byte == 0 {
            bits += 8;
        } else {
            return bits + byte.leading_zeros();
        }
    }
    bits
}

/// Whether `nonce` proves `bits` bits of work on `challenge` for `api_key`.
pub fn verify(challenge: &str, api_key: &str, nonce: u64, bits: u32) -> bool {
    leading_zero_bits(&digest(challenge, api_key, nonce)) >= bits
}

/// The first nonce that proves `bits` bits of work: about 2^bits hashes.
pub fn solve(challenge: &str, api_key: &str, bits: u32) -> u64 {
    (0u64..)
        .find(|&nonce| verify(challenge, api_key, nonce, bits))
        .expect("a nonce exists below 2^64")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_solution_verifies_for_its_key_only() {
        let nonce = solve("c1", "key-a", 12);
        assert!(verify("c1", "key-a", nonce, 12));
        assert!(leading_zero_bits(&digest("c1", "key-a", nonce)) >= 12);
        // Another key or challenge needs its own search (fixed inputs: deterministic).
        assert!(!verify("c1", "key-b", nonce, 12));
        assert!(!verify("c2", "key-a", nonce, 12));
    }

    #[test]
    fn leading_zero_bits_counts_across_bytes() {
        assert_eq!(leading_zero_bits(&[0, 0, 0b0001_0000, 0xff]), 19);
        assert_eq!(leading_zero_bits(&[0xff]), 0);
        assert_eq!(leading_zero_bits(&[0, 0]), 16);
    }
}
