//! Keys and seals: the job key (HMAC-SHA-256 keyed with the job secret, or with a key everyone
//! knows when there is none), the keys derived from it, and the seals on every record of an
//! admitted connection.
//!
//! A proof is an HMAC over length-prefixed parts, so no two different lists of parts give one
//! input. The records that follow a handshake on a connection are sealed with keys derived from
//! the job key and both of the handshake's nonces (see `handshake.rs`): a tag over a running
//! sequence number and the record, truncated to [`SEAL`] bytes, so a forged, altered, replayed,
//! reordered or dropped record fails its check. Tags are compared in constant time by `hmac`.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a handshake proof.
pub(crate) const PROOF: usize = 32;
/// Bytes of a record's seal (HMAC-SHA-256 truncated to 128 bits).
pub(crate) const SEAL: usize = 16;

/// A key, kept as HMAC-SHA-256's state after the key (each use clones it).
#[derive(Clone)]
pub(crate) struct JobKey {
    keyed: Hmac<Sha256>,
}

impl JobKey {
    pub(super) fn new(key: &[u8]) -> JobKey {
        JobKey { keyed: <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length") }
    }

    fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The proof of `parts` (each length-prefixed, so no two different lists give one input).
    pub(crate) fn prove(&self, parts: &[&[u8]]) -> [u8; PROOF] {
        self.mac(parts).finalize().into_bytes().into()
    }

    /// Whether `proof` is the proof of `parts`, compared in constant time.
    pub(crate) fn verify(&self, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(parts).verify_slice(proof).is_ok()
    }

    /// A key derived from this one for `parts`.
    pub(crate) fn derive(&self, parts: &[&[u8]]) -> JobKey {
        JobKey::new(&self.prove(parts))
    }
}

/// Seals the records one end of a connection writes: each seal covers the record and its
/// position in the stream.
pub(crate) struct Sealer {
    key: JobKey,
    sequence: u64,
}

impl Sealer {
    pub(crate) fn new(key: JobKey) -> Sealer {
        Sealer { key, sequence: 0 }
    }

    /// Appends `record`'s seal to it (the next position).
    pub(crate) fn seal(&mut self, record: &mut Vec<u8>) {
        let tag = self.key.mac(&[&self.sequence.to_le_bytes(), record]).finalize().into_bytes();
        record.extend_from_slice(&tag[..SEAL]);
        self.sequence += 1;
    }
}

/// Checks the seals of the records the other end wrote, in order.
pub(crate) struct Opener {
    key: JobKey,
    sequence: u64,
}

impl Opener {
    pub(crate) fn new(key: JobKey) -> Opener {
        Opener { key, sequence: 0 }
    }

    /// Whether `seal` is the seal of `record` at the next position (which it then takes).
    pub(crate) fn open(&mut self, record: &[u8], seal: &[u8]) -> bool {
        let fine = self.key.mac(&[&self.sequence.to_le_bytes(), record]).verify_truncated_left(seal).is_ok()
            && seal.len() == SEAL;
        self.sequence += u64::from(fine);
        fine
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{JobAccess, JobSecret};

    fn access(secret: &str) -> JobAccess {
        JobAccess::Secret(JobSecret::new(secret).unwrap())
    }

    #[test]
    fn seals_catch_forged_altered_replayed_and_reordered_records() {
        let key = access("the job's secret, 32 bytes long.").key().derive(&[b"link"]);
        let mut sealer = Sealer::new(key.clone());
        let records: Vec<Vec<u8>> = (0..3u8)
            .map(|i| {
                let mut record = vec![i; 40];
                sealer.seal(&mut record);
                record
            })
            .collect();
        fn split(record: &[u8]) -> (&[u8], &[u8]) {
            record.split_at(record.len() - SEAL)
        }
        // In order: every one opens.
        let mut opener = Opener::new(key.clone());
        for record in &records {
            let (body, seal) = split(record);
            assert!(opener.open(body, seal));
        }
        // Reordered, replayed, altered, forged with another key: each fails.
        let mut opener = Opener::new(key.clone());
        let (body, seal) = split(&records[1]);
        assert!(!opener.open(body, seal), "a record out of order");
        let (body, seal) = split(&records[0]);
        assert!(opener.open(body, seal));
        assert!(!opener.open(body, seal), "a replayed record");
        let mut altered = records[1].clone();
        altered[3] ^= 1;
        let (body, seal) = split(&altered);
        assert!(!opener.open(body, seal), "an altered record");
        let mut forger = Sealer::new(access("another job's secret, also long").key().derive(&[b"link"]));
        forger.sequence = 1;
        let mut forged = vec![1u8; 40];
        forger.seal(&mut forged);
        let (body, seal) = split(&forged);
        assert!(!opener.open(body, seal), "a record sealed with another key");
        let (body, seal) = split(&records[1]);
        assert!(opener.open(body, seal), "the real next record still opens");
        assert!(!opener.open(body, &seal[..8]), "a short seal");
    }
}
