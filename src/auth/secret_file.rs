//! Reading a job secret's file ([`JobSecret::from_file`],
//! `PPNRT_JOB_SECRET_FILE`) as a key file is read: only a regular file (never a FIFO, which would
//! block the read for ever, nor a device such as `/dev/zero`, which never ends), of at most
//! [`JobSecret::MAX_BYTES`] bytes (read with that bound, whatever the file grows to meanwhile),
//! not empty, and on Unix readable and writable by its owner only, as OpenSSH requires of a
//! private key: a secret that other users can read is no secret, and the error says how to
//! protect it (`chmod 600`).
//!
//! The file's kind is checked before it is opened (opening a FIFO for reading waits for a writer)
//! and again on the opened file, so a path that changed in between is refused too.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use super::{JOB_SECRET_FILE_VAR, JobSecret};
use crate::config_error::ConfigError;

/// The bytes of the job secret's file at `path`, checked as the [module](self) says (the
/// secret's own length is checked by the caller).
///
/// # Errors
/// A [`ConfigError`] on [`JOB_SECRET_FILE_VAR`] naming the path: it cannot be read, is not a
/// regular file, is larger than [`JobSecret::MAX_BYTES`], is empty, or can be read or written by
/// others than its owner.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let refuse =
        |reason: String| ConfigError { setting: JOB_SECRET_FILE_VAR, value: path.display().to_string(), reason };
    let before = std::fs::metadata(path).map_err(|e| refuse(format!("the job secret's file cannot be read: {e}")))?;
    check(path, &before).map_err(refuse)?;
    let file = File::open(path).map_err(|e| refuse(format!("the job secret's file cannot be read: {e}")))?;
    let opened = file.metadata().map_err(|e| refuse(format!("the job secret's file cannot be read: {e}")))?;
    check(path, &opened).map_err(refuse)?;
    let mut bytes = Vec::with_capacity(JobSecret::MAX_BYTES + 1);
    // One byte past the bound tells a file that grew since it was looked at.
    file.take(JobSecret::MAX_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| refuse(format!("the job secret's file cannot be read: {e}")))?;
    if bytes.len() > JobSecret::MAX_BYTES {
        return Err(refuse(too_large(bytes.len() as u64, true)));
    }
    if bytes.is_empty() {
        return Err(refuse(EMPTY.into()));
    }
    Ok(bytes)
}

/// Why an empty secret's file is refused.
const EMPTY: &str = "the job secret's file is empty: it must hold the secret (for example \
                     `openssl rand -hex 32 > FILE`); an empty secret is not \"no secret\"";

fn too_large(bytes: u64, at_least: bool) -> String {
    format!(
        "the job secret's file has {}{bytes} bytes: a job secret has at most {} (for example `openssl rand -hex 32`)",
        if at_least { "at least " } else { "" },
        JobSecret::MAX_BYTES
    )
}

/// Why the file described by `meta` is not a job secret's file, if it is not.
fn check(path: &Path, meta: &Metadata) -> Result<(), String> {
    if !meta.is_file() {
        return Err(format!(
            "the job secret's file is not a regular file (a {}): it must be a file of at most {} bytes",
            kind(meta),
            JobSecret::MAX_BYTES
        ));
    }
    if meta.len() > JobSecret::MAX_BYTES as u64 {
        return Err(too_large(meta.len(), false));
    }
    check_private(path, meta)
}

/// The kind of a file that is not a regular one, for an error.
fn kind(meta: &Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let kind = meta.file_type();
        if kind.is_fifo() {
            return "FIFO";
        }
        if kind.is_char_device() {
            return "character device";
        }
        if kind.is_block_device() {
            return "block device";
        }
        if kind.is_socket() {
            return "socket";
        }
    }
    if meta.is_dir() { "directory" } else { "special file" }
}

/// Refuses a file others than its owner may read or write (`mode & 0o077`).
#[cfg(unix)]
fn check_private(path: &Path, meta: &Metadata) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the job secret's file is accessible by others than its owner (mode {mode:04o}), so the secret is \
             not secret: protect it with `chmod 600 {}` (it must be readable by its owner only)",
            path.display()
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_path: &Path, _meta: &Metadata) -> Result<(), String> {
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    use super::*;

    /// A fresh directory of this test process.
    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ppnrt-secret-file-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A file holding `bytes`, with `mode`.
    fn file(dir: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        let path = dir.join("secret");
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn refused(path: &Path) -> ConfigError {
        let err = JobSecret::from_file(path).unwrap_err();
        assert_eq!(err.setting, JOB_SECRET_FILE_VAR, "{err}");
        assert_eq!(err.value, path.display().to_string(), "{err}");
        err
    }

    #[test]
    fn a_private_regular_file_is_read_and_its_line_break_dropped() {
        let dir = dir("good");
        let path = file(&dir, b"a secret of enough bytes\n", 0o600);
        let secret = JobSecret::from_file(&path).unwrap();
        assert_eq!(secret, JobSecret::new("a secret of enough bytes").unwrap());
        let path = file(&dir, &[b's'; JobSecret::MAX_BYTES], 0o400);
        assert_eq!(JobSecret::from_file(&path).unwrap().len(), JobSecret::MAX_BYTES);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_file_others_can_read_is_refused_with_how_to_protect_it() {
        let dir = dir("shared");
        for mode in [0o644, 0o640, 0o604, 0o620, 0o660] {
            let path = file(&dir, b"a secret of enough bytes\n", mode);
            let err = refused(&path);
            let text = err.to_string();
            assert!(text.contains(&format!("chmod 600 {}", path.display())), "{text}");
            assert!(text.contains(&format!("mode {mode:04o}")), "{text}");
            assert!(!text.contains("a secret of enough"), "the secret shown: {text}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_empty_or_oversized_file_is_refused() {
        let dir = dir("sizes");
        let err = refused(&file(&dir, b"", 0o600));
        assert!(err.reason.contains("file is empty"), "{err}");
        let err = refused(&file(&dir, b"\n", 0o600));
        assert!(err.reason.contains("empty"), "{err}");
        let err = refused(&file(&dir, &[b's'; 5000], 0o600));
        assert!(err.reason.contains("5000 bytes") && err.reason.contains("at most 4096"), "{err}");
        let err = refused(&file(&dir, &[b's'; JobSecret::MAX_BYTES + 1], 0o600));
        assert!(err.reason.contains("4097 bytes"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A FIFO nobody writes to would block an unbounded read for ever: refused at once.
    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = dir("fifo");
        let path = dir.join("secret");
        let made = std::process::Command::new("mkfifo").arg("-m").arg("600").arg(&path).status();
        if !made.is_ok_and(|status| status.success()) {
            eprintln!("skipped: mkfifo is not available");
            return;
        }
        let (done, outcome) = std::sync::mpsc::channel();
        let reading = path.clone();
        std::thread::spawn(move || {
            let _ = done.send(JobSecret::from_file(&reading).map(|_| ()));
        });
        let start = Instant::now();
        let err = match outcome.recv_timeout(Duration::from_secs(5)) {
            Ok(result) => result.unwrap_err(),
            Err(_) => {
                // Unblock the reader, so the process can end.
                let _ = std::fs::write(&path, b"x");
                panic!("reading a FIFO blocked for {:?}", start.elapsed());
            }
        };
        assert!(err.reason.contains("not a regular file (a FIFO)"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// `/dev/zero` never ends: refused before anything is read.
    #[test]
    fn a_device_is_refused_before_it_is_read() {
        let zero = Path::new("/dev/zero");
        if !zero.exists() {
            return;
        }
        let err = refused(zero);
        assert!(err.reason.contains("not a regular file (a character device)"), "{err}");
    }

    #[test]
    fn a_missing_file_or_a_directory_is_refused_naming_the_path() {
        let dir = dir("missing");
        let err = refused(&dir.join("absent"));
        assert!(err.reason.contains("cannot be read"), "{err}");
        let err = refused(&dir);
        assert!(err.reason.contains("(a directory)"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
