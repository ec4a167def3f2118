//! Who belongs to a job: the job secret every rank shares, the keys derived from it, the
//! admission of a connection and the seals that protect every record on an admitted connection.
//!
//! Each end of a connection proves that it holds the job's key before either says anything
//! else, with fresh nonces on both sides so that a recorded exchange is worthless later; the
//! records that follow are sealed with keys derived from the job key and both nonces, so a
//! forged, altered, replayed, reordered or dropped record fails its check. Where each part lives:
//! - here: the job secret and the access a job has ([`JobSecret`], [`JobAccess`]), from the
//!   environment or from code (the secret's file is read by `secret_file.rs`);
//! - `seal.rs`: the job key, the keys derived from it, and the records' seals;
//! - `handshake.rs`: the handshake's steps and proofs, and the connecting end's side of it;
//! - `admission.rs`: the listening end's side, bounding what a stranger on the port can cost,
//!   and the connecting end's retries;
//! - `wire.rs`: what both need of a connection and a listener (TCP between hosts, a Unix
//!   socket between the ranks of one host, the local channel, `local_channel.rs`).
//!
//! Without a secret ([`JobAccess::SameHost`] or [`JobAccess::Unauthenticated`]) the same
//! exchange runs with a key everyone knows: it then proves nothing, and only the framing and the
//! checks of accidents (a stray connection, a corrupted record) remain. See `SECURITY.md`.
//!
//! The cryptography is the `hmac` and `sha2` crates' HMAC-SHA-256, compared in constant time by
//! `hmac`; nonces come from the operating system's generator (`getrandom`).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::config_error::ConfigError;

mod admission;
mod handshake;
mod seal;
mod secret_file;
mod wire;

pub(crate) use admission::{Admission, Admitted, connect_and_knock, connect_and_knock_with, write_by, write_each_by};
pub(crate) use handshake::{KnockError, answer_digest};
pub(crate) use seal::{JobKey, Opener, SEAL, Sealer};
pub(crate) use wire::{Listen, UnixWire};

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

/// The secret that the ranks of one job share. Shown as `JobSecret(<n bytes>)`, never its value.
///
/// ```
/// use ppnrt::{JobAccess, JobSecret, PpConfig};
///
/// let secret = JobSecret::new("a secret of sixteen bytes or more")?;
/// assert_eq!(secret.len(), 33);
/// assert!(JobSecret::new("short").is_err()); // fewer than `MIN_BYTES`
/// let config = PpConfig::new(2).with_job_access(JobAccess::Secret(secret));
/// assert!(config.job_access().authenticated());
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct JobSecret {
    bytes: Arc<[u8]>,
}

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
///
/// ```
/// use ppnrt::JobAccess;
/// use std::ffi::OsStr;
///
/// // What the environment asks for, here given by hand: no secret and no opt-out.
/// let access = JobAccess::parse(None, None, None)?;
/// assert_eq!(access, JobAccess::SameHost);
/// assert!(!access.authenticated());
/// let access = JobAccess::parse(Some(OsStr::new("a secret of sixteen bytes or more")), None, None)?;
/// assert!(access.authenticated());
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
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

#[cfg(test)]
mod tests {
    use super::*;

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
