//! The handshake that admits a connection, and the connecting end's side of it. The listening
//! end is the *host*, the connecting end the *guest*:
//! 1. host → guest: the protocol's magic and a fresh 32-byte nonce `h`;
//! 2. guest → host: a fresh nonce `g` and `HMAC(key, "knock" ‖ magic ‖ h ‖ g)`;
//! 3. host → guest: `HMAC(key, "welcome" ‖ magic ‖ h ‖ g)`, only when step 2 proved the key: a
//!    connection that does not is closed without a word, and the host goes on;
//! 4. guest → host: its message and `HMAC(key, "message" ‖ magic ‖ h ‖ g ‖ message)`;
//! 5. host → guest: its answer and `HMAC(key, "answer" ‖ magic ‖ h ‖ g ‖ SHA-256(answer))` (the
//!    answer's digest: one answer, such as a rendezvous's member table, goes to many guests, and
//!    is hashed once for all of them).
//!
//! Here: [`Handshake`] (the two nonces and the magic, the proofs of each step, the record keys it
//! derives), the guest's steps 1–3 ([`knock`]), 4 ([`Handshake::send_message`]) and its reading
//! of step 5 ([`Handshake::read_answer`]), every read bounded by a deadline. The host's side, with
//! its bounds on what a stranger can cost, is the admission (`admission.rs`); the keys and seals
//! are in `seal.rs`. Nonces come from the operating system's generator (`getrandom`).

use std::fmt;
use std::io::ErrorKind;
use std::time::Instant;

use sha2::Sha256;

use super::admission::write_by;
use super::seal::{JobKey, PROOF};
use super::wire::Wire;

/// Bytes of a handshake nonce.
pub(crate) const NONCE: usize = 32;

/// A fresh nonce from the operating system's generator.
pub(super) fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut bytes = [0u8; NONCE];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(format!("the random generator failed: {e}")))?;
    Ok(bytes)
}

/// The two nonces of an admitted connection and its protocol's magic.
#[derive(Clone)]
pub(crate) struct Handshake {
    pub(super) magic: [u8; 8],
    pub(super) host: [u8; NONCE],
    pub(super) guest: [u8; NONCE],
}

impl Handshake {
    pub(super) fn prove(&self, key: &JobKey, what: &[u8], message: &[u8]) -> [u8; PROOF] {
        key.prove(&[what, &self.magic, &self.host, &self.guest, message])
    }

    pub(super) fn verify(&self, key: &JobKey, what: &[u8], message: &[u8], proof: &[u8]) -> bool {
        key.verify(&[what, &self.magic, &self.host, &self.guest, message], proof)
    }

    /// The keys of the records on this connection, `(guest to host, host to guest)`, for
    /// `context` (what the connection is for).
    pub(crate) fn record_keys(&self, key: &JobKey, context: &[u8]) -> (JobKey, JobKey) {
        let derive =
            |direction: &[u8]| key.derive(&[b"records", direction, &self.magic, &self.host, &self.guest, context]);
        (derive(b"guest to host"), derive(b"host to guest"))
    }

    /// The guest's step 4: sends `message` with its proof, by `deadline`.
    pub(crate) fn send_message(
        &self,
        stream: &mut impl Wire,
        key: &JobKey,
        message: &[u8],
        deadline: Instant,
    ) -> std::io::Result<()> {
        let mut bytes = message.to_vec();
        bytes.extend_from_slice(&self.prove(key, b"message", message));
        write_by(stream, &bytes, deadline)
    }

    /// The host's step 5: `answer` with its proof, as written to the guest (see
    /// [`write_by`] and [`write_each_by`]).
    pub(crate) fn answer(&self, key: &JobKey, answer: &[u8]) -> Vec<u8> {
        let mut bytes = answer.to_vec();
        bytes.extend_from_slice(&self.answer_proof(key, &answer_digest(answer)));
        bytes
    }

    /// The proof that follows an answer whose digest ([`answer_digest`]) is `digest`.
    pub(crate) fn answer_proof(&self, key: &JobKey, digest: &[u8; 32]) -> [u8; PROOF] {
        self.prove(key, b"answer", digest)
    }

    /// The guest reads the host's answer: `length_of` tells from the bytes read so far how long
    /// the answer is (`Ok(None)`: not yet known; an error: malformed), then its proof is read and
    /// checked. Waits until `deadline`.
    pub(crate) fn read_answer(
        &self,
        stream: &mut impl Wire,
        key: &JobKey,
        deadline: Instant,
        length_of: impl Fn(&[u8]) -> Result<Option<usize>, String>,
    ) -> Result<Vec<u8>, KnockError> {
        let mut read = Vec::new();
        let length = loop {
            if let Some(length) = length_of(&read).map_err(KnockError::Malformed)? {
                break length;
            }
            read_some(stream, &mut read, deadline)?;
        };
        while read.len() < length + PROOF {
            read_some(stream, &mut read, deadline)?;
        }
        if read.len() > length + PROOF {
            return Err(KnockError::Malformed(format!("{} byte(s) past the answer", read.len() - length - PROOF)));
        }
        if !self.verify(key, b"answer", &answer_digest(&read[..length]), &read[length..]) {
            return Err(KnockError::Unproven("the answer's proof is wrong".into()));
        }
        read.truncate(length);
        Ok(read)
    }
}

/// The digest an answer's proof covers (SHA-256).
pub(crate) fn answer_digest(answer: &[u8]) -> [u8; 32] {
    <Sha256 as sha2::Digest>::digest(answer).into()
}

/// Why a guest's handshake failed.
#[derive(Debug)]
pub(crate) enum KnockError {
    /// The connection failed, or the deadline passed (`TimedOut` / `WouldBlock`).
    Io(std::io::Error),
    /// The host closed the connection (after step 2: it did not accept this guest's proof).
    Closed { after_knock: bool },
    /// The host speaks another protocol.
    NotOurs,
    /// The host does not prove the key.
    Unproven(String),
    /// The host's answer is malformed.
    Malformed(String),
    /// The deadline passed before any attempt got through the handshake (the last attempt's
    /// failure).
    Unreached(String),
}

impl fmt::Display for KnockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KnockError::Io(e) => write!(f, "{e}"),
            KnockError::Closed { after_knock: true } => f.write_str(
                "the listener closed the connection after this rank's proof: it holds another job secret \
                 (is the same secret set on every rank?)",
            ),
            KnockError::Closed { after_knock: false } => f.write_str("the listener closed the connection"),
            KnockError::NotOurs => f.write_str("the listener does not speak this protocol"),
            KnockError::Unproven(what) => {
                write!(f, "the listener does not prove the job secret ({what}): not a rank of this job")
            }
            KnockError::Malformed(what) => write!(f, "a malformed answer: {what}"),
            KnockError::Unreached(last) => write!(f, "no handshake by the deadline (the last attempt: {last})"),
        }
    }
}

impl KnockError {
    /// Whether the deadline passed.
    pub(crate) fn timed_out(&self) -> bool {
        matches!(self, KnockError::Unreached(_))
            || matches!(self, KnockError::Io(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock))
    }
}

/// Reads what `stream` has into `read`, waiting until `deadline` for at least one byte.
fn read_some(stream: &mut impl Wire, read: &mut Vec<u8>, deadline: Instant) -> Result<(), KnockError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(KnockError::Io(ErrorKind::TimedOut.into()));
    }
    stream.set_read_timeout(Some(left)).map_err(KnockError::Io)?;
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return Err(KnockError::Closed { after_knock: false }),
            Ok(n) => {
                read.extend_from_slice(&chunk[..n]);
                return Ok(());
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(KnockError::Io(e)),
        }
    }
}

/// Reads exactly `n` bytes by `deadline`.
fn read_exactly(stream: &mut impl Wire, n: usize, deadline: Instant) -> Result<Vec<u8>, KnockError> {
    let mut read = Vec::with_capacity(n);
    while read.len() < n {
        read_some(stream, &mut read, deadline)?;
    }
    if read.len() > n {
        return Err(KnockError::Malformed("the listener sent more than the handshake".into()));
    }
    Ok(read)
}

/// The guest's steps 1–3 on a fresh connection: reads the host's challenge, proves the key, and
/// checks the host's proof. Nothing else is sent: a host that does not prove the key learns
/// only a nonce.
pub(crate) fn knock(
    stream: &mut impl Wire,
    key: &JobKey,
    magic: &[u8; 8],
    deadline: Instant,
) -> Result<Handshake, KnockError> {
    let challenge = read_exactly(stream, 8 + NONCE, deadline)?;
    if challenge[..8] != magic[..] {
        return Err(KnockError::NotOurs);
    }
    let handshake = Handshake {
        magic: *magic,
        host: challenge[8..].try_into().expect("sliced to a nonce"),
        guest: nonce().map_err(KnockError::Io)?,
    };
    let mut knock = handshake.guest.to_vec();
    knock.extend_from_slice(&handshake.prove(key, b"knock", &[]));
    write_by(stream, &knock, deadline).map_err(KnockError::Io)?;
    let welcome = read_exactly(stream, PROOF, deadline).map_err(|e| match e {
        KnockError::Closed { .. } => KnockError::Closed { after_knock: true },
        other => other,
    })?;
    if !handshake.verify(key, b"welcome", &[], &welcome) {
        return Err(KnockError::Unproven("its welcome's proof is wrong".into()));
    }
    Ok(handshake)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    use super::*;
    use crate::auth::{JobAccess, JobSecret};

    const MAGIC: &[u8; 8] = b"PPNRTT01";

    fn access(secret: &str) -> JobAccess {
        JobAccess::Secret(JobSecret::new(secret).unwrap())
    }

    #[test]
    fn a_host_without_the_secret_learns_only_a_nonce_and_is_found_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // A squatter that answers every knock with a made-up welcome and records what it gets.
        let squatter = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut challenge = MAGIC.to_vec();
            challenge.extend_from_slice(&[7; NONCE]);
            stream.write_all(&challenge).unwrap();
            let mut knock = [0u8; NONCE + PROOF];
            stream.read_exact(&mut knock).unwrap();
            stream.write_all(&[1; PROOF]).unwrap();
            stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut more = Vec::new();
            let _ = stream.read_to_end(&mut more);
            more
        });
        let key = access("the job's secret, 32 bytes long.").key();
        let mut guest = TcpStream::connect(addr).unwrap();
        let err = knock(&mut guest, &key, MAGIC, Instant::now() + Duration::from_secs(2)).err().unwrap();
        assert!(matches!(err, KnockError::Unproven(_)), "{err}");
        drop(guest);
        assert!(squatter.join().unwrap().is_empty(), "the guest sent nothing past its knock");
    }
}
