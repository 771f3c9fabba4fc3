//! Registration challenges: what a new identity must prove work on (the hashcash scheme of
//! `hrm_wire::pow`). A challenge is stateless and signed: `bits.expires.nonce.mac`, the MAC an
//! HMAC-SHA256 under a secret kept in `hub_state`, so every replica can check what any replica
//! issued, and nobody can make their own easy or everlasting challenges.

use crate::db::{now_ms, to_datetime};
use hmac::{KeyInit, Mac};
use hrm_wire::Challenge;
use rand::Rng;
use sha2::Sha256;
use std::time::Duration;

/// How long a challenge may be answered.
pub const CHALLENGE_LIFETIME: Duration = Duration::from_secs(600);

type HmacSha256 = hmac::Hmac<Sha256>;

/// Issues and checks challenges under one secret.
pub struct Challenges {
    secret: Vec<u8>,
    pub bits: u32,
}

/// Why a proof was refused.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    Missing,
    Malformed,
    Forged,
    Expired,
    TooEasy,
    NotSolved,
}

impl Refusal {
    pub fn message(&self, bits: u32) -> String {
        match self {
            Refusal::Missing => format!(
                "registration needs a proof of work ({bits} bits) on a challenge from GET /api/v1/auth/challenge"
            ),
            Refusal::Malformed | Refusal::Forged => {
                "the challenge was not issued by this hub".to_string()
            }
            Refusal::Expired => "the challenge has expired; ask for a new one".to_string(),
            Refusal::TooEasy => format!("the challenge asks for fewer than this hub's {bits} bits"),
            Refusal::NotSolved => {
                "the nonce does not solve the challenge for this API key".to_string()
            }
        }
    }
}

impl Challenges {
    pub fn new(secret: &str, bits: u32) -> Self {
        Self {
            secret: secret.as_bytes().to_vec(),
            bits,
        }
    }

    /// A fresh secret for `hub_state`.
    pub fn fresh_secret() -> String {
        hex::encode(rand::rng().random::<[u8; 32]>())
    }

    fn mac(&self, body: &str) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length");
        mac.update(body.as_bytes());
        mac
    }

    pub fn issue(&self) -> Challenge {
        let expires = now_ms() + CHALLENGE_LIFETIME.as_millis() as i64;
        let nonce = hex::encode(rand::rng().random::<[u8; 16]>());
        let body = format!("{}.{expires}.{nonce}", self.bits);
        let tag = hex::encode(self.mac(&body).finalize().into_bytes());
        Challenge {
            challenge: format!("{body}.{tag}"),
            bits: self.bits,
            expires_at: to_datetime(expires),
        }
    }

    /// Checks a registration's proof for `api_key`.
    pub fn check(
        &self,
        proof: Option<&hrm_wire::pow::Proof>,
        api_key: &str,
    ) -> Result<(), Refusal> {
        if self.bits == 0 {
            return Ok(());
        }
        let proof = proof.ok_or(Refusal::Missing)?;
        let (body, tag) = proof.challenge.rsplit_once('.').ok_or(Refusal::Malformed)?;
        let tag = hex::decode(tag).map_err(|_| Refusal::Malformed)?;
        self.mac(body)
            .verify_slice(&tag)
            .map_err(|_| Refusal::Forged)?;
        let mut fields = body.split('.');
        let bits: u32 = fields
            .next()
            .and_then(|b| b.parse().ok())
            .ok_or(Refusal::Malformed)?;
        let expires: i64 = fields
            .next()
            .and_then(|e| e.parse().ok())
            .ok_or(Refusal::Malformed)?;
        if expires < now_ms() {
            return Err(Refusal::Expired);
        }
        if bits < self.bits {
            return Err(Refusal::TooEasy);
        }
        if !hrm_wire::pow::verify(&proof.challenge, api_key, proof.nonce, bits) {
            return Err(Refusal::NotSolved);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hrm_wire::pow::{Proof, solve};

    #[test]
    fn a_solved_challenge_registers_one_key_and_forgeries_fail() {
        let hub = Challenges::new("secret", 8);
        let challenge = hub.issue().challenge;
        let nonce = solve(&challenge, "key-a", 8);
        let proof = Proof {
            challenge: challenge.clone(),
            nonce,
        };
        assert_eq!(hub.check(Some(&proof), "key-a"), Ok(()));
        assert_eq!(hub.check(Some(&proof), "key-b"), Err(Refusal::NotSolved));
        assert_eq!(hub.check(None, "key-a"), Err(Refusal::Missing));
        // An easier challenge of the client's own making.
        let forged = challenge.replacen("8.", "1.", 1);
        let nonce = solve(&forged, "key-a", 1);
        let forged = Proof {
            challenge: forged,
            nonce,
        };
        assert_eq!(hub.check(Some(&forged), "key-a"), Err(Refusal::Forged));
        // Another hub's secret.
        let other = Challenges::new("other", 8);
        assert_eq!(other.check(Some(&proof), "key-a"), Err(Refusal::Forged));
        // A hub that raised its difficulty refuses older, easier challenges.
        let harder = Challenges::new("secret", 9);
        assert_eq!(harder.check(Some(&proof), "key-a"), Err(Refusal::TooEasy));
    }
}
