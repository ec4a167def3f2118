//! Who belongs to a job: the job secret every rank shares, the keys derived from it, the
//! admission of a connection (each end proves it holds the job's key before either says
//! anything else) and the seals that protect every record on an admitted connection.
//!
//! The handshake; the listening end is the *host*, the connecting end the *guest*:
//! 1. host → guest: the protocol's magic and a fresh 32-byte nonce `h`;
//! 2. guest → host: a fresh nonce `g` and `HMAC(key, "knock" ‖ magic ‖ h ‖ g)`;
//! 3. host → guest: `HMAC(key, "welcome" ‖ magic ‖ h ‖ g)`, only when step 2 proved the key: a
//!    connection that does not is closed without a word, and the host goes on;
//! 4. guest → host: its message and `HMAC(key, "message" ‖ magic ‖ h ‖ g ‖ message)`;
//! 5. host → guest: its answer and `HMAC(key, "answer" ‖ magic ‖ h ‖ g ‖ SHA-256(answer))` (the
//!    answer's digest: one answer, such as a rendezvous's member table, goes to many guests, and
//!    is hashed once for all of them).
//!
//! Neither end sends anything but nonces and proofs before it knows that the other holds the
//! key, and fresh nonces on both sides make a recorded exchange worthless later. The records
//! that follow on a connection are sealed with keys derived from the job key and both nonces
//! (the handshake's record keys): a tag over a running sequence number and the record, so a
//! forged, altered, replayed, reordered or dropped record fails its check.
//!
//! Without a secret ([`JobAccess::SameHost`] or [`JobAccess::Unauthenticated`]) the same
//! exchange runs with a key everyone knows: it then proves nothing, and only the framing and the
//! checks of accidents (a stray connection, a corrupted record) remain. See `SECURITY.md`.
//!
//! The cryptography is the `hmac` and `sha2` crates' HMAC-SHA-256, compared in constant time by
//! `hmac`; nonces come from the operating system's generator (`getrandom`).

use std::fmt;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config_error::ConfigError;

mod admission;
pub(crate) use admission::{Admission, Admitted, connect_and_knock, write_by, write_each_by};

/// Variable holding the job secret (at least [`JobSecret::MIN_BYTES`] bytes of text; for example
/// `export PPNRT_JOB_SECRET=$(openssl rand -hex 32)` once per job, on every rank).
pub const JOB_SECRET_VAR: &str = "PPNRT_JOB_SECRET";
/// Variable naming a file that holds the job secret (instead of [`JOB_SECRET_VAR`]; one trailing
/// line break is ignored): a regular file of at most [`JobSecret::MAX_BYTES`] bytes that only its
/// owner may read (`chmod 600`), see [`JobSecret::from_file`].
pub const JOB_SECRET_FILE_VAR: &str = "PPNRT_JOB_SECRET_FILE";
/// Variable that, set to `1`, lets the ranks of a job without a secret meet across hosts (no
/// authentication at all: anyone who reaches the ports can join or inject; see `SECURITY.md`).
pub const ALLOW_UNAUTHENTICATED_VAR: &str = "PPNRT_ALLOW_UNAUTHENTICATED";

/// Bytes of a handshake nonce.
pub(crate) const NONCE: usize = 32;
/// Bytes of a handshake proof.
pub(crate) const PROOF: usize = 32;
/// Bytes of a record's seal (HMAC-SHA-256 truncated to 128 bits).
pub(crate) const SEAL: usize = 16;

/// The secret that the ranks of one job share. Shown as `JobSecret(<n bytes>)`, never its value.
#[derive(Clone)]
pub struct JobSecret {
    bytes: Arc<[u8]>,
}

mod secret_file;

impl JobSecret {
    /// The fewest bytes a secret may have.
    pub const MIN_BYTES: usize = 16;
    /// The most bytes a secret may have.
    pub const MAX_BYTES: usize = 4096;

    /// A secret from its bytes (text or not).
    ///
    /// # Errors
    /// A [`ConfigError`] on [`JOB_SECRET_VAR`] when it is empty, shorter than
    /// [`MIN_BYTES`](Self::MIN_BYTES) or longer than [`MAX_BYTES`](Self::MAX_BYTES); the error
    /// states the length, never the value.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<JobSecret, ConfigError> {
        JobSecret::checked(bytes.as_ref(), JOB_SECRET_VAR, "(hidden)")
    }

    /// The secret held in the file at `path` (one trailing line break is not part of it). The
    /// file is read as a key file is: it must be a regular file (not a FIFO or a device) of at
    /// most [`MAX_BYTES`](Self::MAX_BYTES) bytes, not empty, and on Unix accessible by its owner
    /// only (`chmod 600`, as OpenSSH requires of a private key).
    ///
    /// # Errors
    /// A [`ConfigError`] on [`JOB_SECRET_FILE_VAR`] naming the path: unreadable, not a regular
    /// file, too large, empty, readable or writable by others (the error says `chmod 600 PATH`),
    /// or a secret of the wrong length.
    pub fn from_file(path: impl AsRef<Path>) -> Result<JobSecret, ConfigError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let mut bytes = secret_file::read(path)?;
        if bytes.ends_with(b"\n") {
            bytes.pop();
            if bytes.ends_with(b"\r") {
                bytes.pop();
            }
        }
        JobSecret::checked(&bytes, JOB_SECRET_FILE_VAR, &shown)
    }

    /// A fresh secret of 32 random bytes (for a launcher that starts every rank itself).
    ///
    /// # Errors
    /// The operating system's generator failed (a [`ConfigError`] saying so).
    pub fn random() -> Result<JobSecret, ConfigError> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| ConfigError {
            setting: JOB_SECRET_VAR,
            value: String::new(),
            reason: format!("the operating system's random generator failed: {e}"),
        })?;
        Ok(JobSecret { bytes: Arc::from(&bytes[..]) })
    }

    /// The secret's length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Always false (a secret has at least [`MIN_BYTES`](Self::MIN_BYTES)); for symmetry with
    /// [`len`](Self::len).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn checked(bytes: &[u8], setting: &'static str, shown: &str) -> Result<JobSecret, ConfigError> {
        if bytes.is_empty() {
            return Err(ConfigError { setting, value: shown.to_string(), reason: EMPTY_SECRET.into() });
        }
        if !(JobSecret::MIN_BYTES..=JobSecret::MAX_BYTES).contains(&bytes.len()) {
            return Err(ConfigError {
                setting,
                value: shown.to_string(),
                reason: format!(
                    "a job secret of {} byte(s): it must have {} to {} (for example `openssl rand -hex 32`)",
                    bytes.len(),
                    JobSecret::MIN_BYTES,
                    JobSecret::MAX_BYTES
                ),
            });
        }
        Ok(JobSecret { bytes: Arc::from(bytes) })
    }
}

/// Why an empty secret is refused: set but empty is a mistake, never "no secret".
const EMPTY_SECRET: &str = "the job secret is empty: set a secret (for example `openssl rand -hex 32`), \
                            or unset the variable for no secret";

/// Equal when the bytes are (a comparison of configurations within one process).
impl PartialEq for JobSecret {
    fn eq(&self, other: &JobSecret) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for JobSecret {}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret(<{} bytes>)", self.bytes.len())
    }
}

/// How the ranks of a job that spans processes recognise each other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum JobAccess {
    /// Every connection between ranks proves the job secret, and every record is sealed with
    /// keys derived from it. Required across hosts.
    Secret(JobSecret),
    /// No secret: the ranks meet only on loopback addresses (every rank on this host, listeners
    /// bound to loopback). Any process of this host that can reach the ports is trusted.
    #[default]
    SameHost,
    /// No secret, across hosts: no authentication at all (anyone who reaches the ports can join,
    /// read the NCCL ids or inject records). Only on a network nobody else reaches; an explicit
    /// choice ([`ALLOW_UNAUTHENTICATED_VAR`]).
    Unauthenticated,
}

impl JobAccess {
    /// The access the environment asks for: [`JOB_SECRET_VAR`] or [`JOB_SECRET_FILE_VAR`] (not
    /// both), else [`ALLOW_UNAUTHENTICATED_VAR`]`=1`, else [`SameHost`](Self::SameHost). A secret
    /// variable that is set is used even when empty (an error): an empty secret never means "no
    /// secret".
    ///
    /// # Errors
    /// A [`ConfigError`] naming the variable: both secrets set, an empty, bad or unreadable secret
    /// or file, or an opt-out that is not `0` or `1`.
    pub fn from_env() -> Result<JobAccess, ConfigError> {
        JobAccess::parse(
            std::env::var_os(JOB_SECRET_VAR).as_deref(),
            std::env::var_os(JOB_SECRET_FILE_VAR).as_deref(),
            std::env::var_os(ALLOW_UNAUTHENTICATED_VAR).as_deref(),
        )
    }

    /// [`from_env`](Self::from_env) from the three values (`None` = unset; `Some("")`, set but
    /// empty, is an error for either secret).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn parse(
        secret: Option<&std::ffi::OsStr>,
        secret_file: Option<&std::ffi::OsStr>,
        allow_unauthenticated: Option<&std::ffi::OsStr>,
    ) -> Result<JobAccess, ConfigError> {
        let open = match allow_unauthenticated.map(|value| value.to_string_lossy().trim().to_string()).as_deref() {
            None | Some("0") | Some("") => false,
            Some("1") => true,
            Some(other) => {
                return Err(ConfigError {
                    setting: ALLOW_UNAUTHENTICATED_VAR,
                    value: other.to_string(),
                    reason: "expected 0 or 1".into(),
                });
            }
        };
        let empty = |setting: &'static str, what: &str| ConfigError {
            setting,
            value: String::new(),
            reason: format!("{setting} is set but empty: {what}, or unset it for no secret"),
        };
        if secret.is_some_and(|secret| secret.is_empty()) {
            return Err(empty(JOB_SECRET_VAR, "set the secret (for example `openssl rand -hex 32`)"));
        }
        if secret_file.is_some_and(|file| file.is_empty()) {
            return Err(empty(JOB_SECRET_FILE_VAR, "name the secret's file"));
        }
        match (secret, secret_file) {
            (Some(_), Some(file)) => Err(ConfigError {
                setting: JOB_SECRET_FILE_VAR,
                value: file.to_string_lossy().into_owned(),
                reason: format!("set either {JOB_SECRET_VAR} or {JOB_SECRET_FILE_VAR}, not both"),
            }),
            (Some(secret), None) => Ok(JobAccess::Secret(JobSecret::new(secret.as_encoded_bytes())?)),
            (None, Some(file)) => Ok(JobAccess::Secret(JobSecret::from_file(file)?)),
            (None, None) if open => Ok(JobAccess::Unauthenticated),
            (None, None) => Ok(JobAccess::SameHost),
        }
    }

    /// Whether the ranks prove a secret.
    pub fn authenticated(&self) -> bool {
        matches!(self, JobAccess::Secret(_))
    }

    /// The key every proof and seal of the job is made with.
    pub(crate) fn key(&self) -> JobKey {
        match self {
            JobAccess::Secret(secret) => JobKey::new(&secret.bytes),
            // A key everyone knows: the framing without any proof.
            JobAccess::SameHost | JobAccess::Unauthenticated => JobKey::new(b"ppnrt: a job without a secret"),
        }
    }
}

/// A key, kept as HMAC-SHA-256's state after the key (each use clones it).
#[derive(Clone)]
pub(crate) struct JobKey {
    keyed: Hmac<Sha256>,
}

impl JobKey {
    fn new(key: &[u8]) -> JobKey {
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

/// A fresh nonce from the operating system's generator.
fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut bytes = [0u8; NONCE];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(format!("the random generator failed: {e}")))?;
    Ok(bytes)
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

/// The two nonces of an admitted connection and its protocol's magic.
#[derive(Clone)]
pub(crate) struct Handshake {
    magic: [u8; 8],
    host: [u8; NONCE],
    guest: [u8; NONCE],
}

impl Handshake {
    fn prove(&self, key: &JobKey, what: &[u8], message: &[u8]) -> [u8; PROOF] {
        key.prove(&[what, &self.magic, &self.host, &self.guest, message])
    }

    fn verify(&self, key: &JobKey, what: &[u8], message: &[u8], proof: &[u8]) -> bool {
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
        stream: &mut TcpStream,
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
        stream: &mut TcpStream,
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
fn read_some(stream: &mut TcpStream, read: &mut Vec<u8>, deadline: Instant) -> Result<(), KnockError> {
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
fn read_exactly(stream: &mut TcpStream, n: usize, deadline: Instant) -> Result<Vec<u8>, KnockError> {
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
    stream: &mut TcpStream,
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
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Duration;

    use super::*;

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

    #[test]
    fn secrets_are_checked_and_never_shown() {
        let err = JobSecret::new("short").unwrap_err();
        assert!(err.to_string().contains("5 byte(s)") && !err.to_string().contains("short"), "{err}");
        let secret = JobSecret::new("a secret of enough bytes").unwrap();
        assert_eq!(format!("{secret:?}"), "JobSecret(<24 bytes>)");
        let dir = std::env::temp_dir().join(format!("ppnrt-secret-{}", std::process::id()));
        std::fs::write(&dir, "a secret of enough bytes\n").unwrap();
        #[cfg(unix)]
        std::fs::set_permissions(&dir, <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600))
            .unwrap();
        assert_eq!(JobSecret::from_file(&dir).unwrap().len(), 24);
        std::fs::remove_file(&dir).unwrap();
        let err = JobSecret::from_file(&dir).unwrap_err();
        assert_eq!(err.setting, JOB_SECRET_FILE_VAR);
        assert!(err.value.contains("ppnrt-secret"), "{err}");
        let os = |s: &'static str| Some(std::ffi::OsStr::new(s));
        assert!(matches!(JobAccess::parse(None, None, None).unwrap(), JobAccess::SameHost));
        assert!(matches!(JobAccess::parse(None, None, os("1")).unwrap(), JobAccess::Unauthenticated));
        assert!(matches!(
            JobAccess::parse(os("a secret of enough bytes"), None, os("1")).unwrap(),
            JobAccess::Secret(_)
        ));
        assert_eq!(JobAccess::parse(None, None, os("yes")).unwrap_err().setting, ALLOW_UNAUTHENTICATED_VAR);
        let both = JobAccess::parse(os("a secret of enough bytes"), os("/x"), None).unwrap_err();
        assert!(both.reason.contains("not both"), "{both}");
        assert_ne!(JobSecret::random().unwrap().bytes, JobSecret::random().unwrap().bytes);
    }
}
