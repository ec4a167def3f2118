//! NCCL, loaded at run time like the driver, and the point-to-point calls a pipeline boundary
//! between processes needs: a unique id, a communicator per rank, `send`/`recv` on a stream
//! (ordered by the crate's ordering rule like any copy), groups, and error polling.
//!
//! The library is opened once per process, on first use, and never closed. Candidates, in order:
//! the path in `PPNRT_LIBNCCL_PATH` if it is set (then nothing else is tried); `libnccl.so.2` in the
//! PyPI wheel layout (`site-packages/nvidia/nccl/lib`) of the virtual environment (`VIRTUAL_ENV`),
//! of the user's and the system's Python directories, and of the directory `python3` reports;
//! then `libnccl.so.2` from the system's library path. NCCL must be at least
//! [`MINIMUM_VERSION`] (2.7.0: point-to-point send/recv and groups); an older library, a missing
//! library or a missing entry point is a typed [`NcclError`]. Every entry point is a per-symbol
//! `Result`, so an entry point an older NCCL lacks fails only the calls that need it.
//!
//! Lifetime: the library stays loaded for the process; a [`NcclComm`] holds its device's context
//! and destroys the communicator when dropped. Threading: `NcclComm` is `Send + Sync`; a
//! [`group`] is per thread, as NCCL's groups are.

use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, LoadAttempt, Result};
use crate::safe::memory::ordered;
use crate::safe::ordering::Use;
use crate::safe::{Context, CudaStream, DeviceRepr, DeviceSlice, DeviceSliceMut, record_drop_error};
use crate::sys::nccl::{NcclApi, ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId};

/// Environment variable naming the NCCL library to load instead of the default candidates.
pub const LIBNCCL_PATH_VAR: &str = "PPNRT_LIBNCCL_PATH";

/// The oldest NCCL this crate uses: 2.7.0, the first with point-to-point send/recv and groups.
pub const MINIMUM_VERSION: NcclVersion = NcclVersion { major: 2, minor: 7, patch: 0 };

/// The oldest NCCL whose operations boundaries from other ranks capture into CUDA graphs
/// ([`PpConfig::nccl_recv_graphs`](crate::PpConfig::nccl_recv_graphs)): 2.13.0, the first that
/// documents mixing graph launches with ordinary calls on one communicator
/// (`NCCL_GRAPH_MIXING_SUPPORT`). With an older NCCL every receive is NCCL's call.
pub const GRAPH_MIXING_VERSION: NcclVersion = NcclVersion { major: 2, minor: 13, patch: 0 };

/// An NCCL version, decoded from `ncclGetVersion`'s integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer: `major*1000 + minor*100 + patch` up to 2.8,
    /// `major*10000 + minor*100 + patch` from 2.9 on.
    pub fn from_code(code: i32) -> NcclVersion {
        let code = code.max(0) as u32;
        if code >= 10_000 {
            NcclVersion { major: code / 10_000, minor: (code % 10_000) / 100, patch: code % 100 }
        } else {
            NcclVersion { major: code / 1000, minor: (code % 1000) / 100, patch: code % 100 }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why NCCL cannot be used, or an NCCL call's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// No candidate library could be opened; each attempt is listed.
    #[error("NCCL could not be loaded; tried: {}", tried.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    NotFound {
        /// Every candidate tried, with why it failed.
        tried: Vec<LoadAttempt>,
    },
    /// The library is older than [`MINIMUM_VERSION`].
    #[error("{library} is NCCL {found}; ppnrt needs at least {required} (point-to-point send/recv and groups)")]
    TooOld {
        /// The library opened.
        library: String,
        /// Its version.
        found: NcclVersion,
        /// The minimum.
        required: NcclVersion,
    },
    /// The library lacks an entry point a call needs.
    #[error("{library} has no entry point `{symbol}`")]
    MissingEntryPoint {
        /// The library opened.
        library: String,
        /// The symbol.
        symbol: &'static str,
    },
    /// A rank or rank count outside what a communicator can have.
    #[error("{what}: rank {rank} is not in 0..{n_ranks}")]
    InvalidRank {
        /// The operation.
        what: &'static str,
        /// The rank given.
        rank: i32,
        /// The communicator's rank count.
        n_ranks: i32,
    },
    /// A call on a communicator that was aborted ([`NcclComm::abort_now`]).
    #[error("{what}: the communicator was aborted")]
    Aborted {
        /// The call.
        what: &'static str,
    },
    /// An NCCL call failed.
    #[error("{call} failed with {name} ({code}): {description}{}", if last_error.is_empty() { String::new() } else { format!(" ({last_error})") })]
    Call {
        /// The entry point.
        call: &'static str,
        /// The `ncclResult_t` code.
        code: u32,
        /// Its name.
        name: &'static str,
        /// NCCL's description of the code (`ncclGetErrorString`).
        description: String,
        /// NCCL's last error message (`ncclGetLastError`), when it has one.
        last_error: String,
    },
}

/// The loaded NCCL: its entry points, version and the library it came from.
pub struct Nccl {
    api: NcclApi,
    version: NcclVersion,
    library: String,
}

static NCCL: OnceLock<std::result::Result<Nccl, NcclError>> = OnceLock::new();

/// The process's NCCL, loaded on first use.
///
/// # Errors
/// [`NcclError`] when no library loads or it is too old; the same error on every call.
pub fn nccl() -> Result<&'static Nccl> {
    match NCCL.get_or_init(|| Nccl::load(&default_candidates())) {
        Ok(nccl) => Ok(nccl),
        Err(e) => Err(Error::Nccl(e.clone())),
    }
}

/// The candidates [`nccl`] tries, in order (see the [module docs](self)).
pub fn default_candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(LIBNCCL_PATH_VAR).filter(|path| !path.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    let mut sites: Vec<PathBuf> = Vec::new();
    let mut python_dirs = |base: PathBuf, leaf: &str| {
        if let Ok(entries) = std::fs::read_dir(&base) {
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("python3")))
                .map(|path| path.join(leaf))
                .collect();
            found.sort();
            sites.extend(found);
        }
    };
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        python_dirs(PathBuf::from(venv).join("lib"), "site-packages");
    }
    if let Some(home) = std::env::var_os("HOME") {
        python_dirs(PathBuf::from(home).join(".local/lib"), "site-packages");
    }
    python_dirs(PathBuf::from("/usr/local/lib"), "dist-packages");
    python_dirs(PathBuf::from("/usr/local/lib"), "site-packages");
    sites.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .stderr(std::process::Stdio::null())
        .output()
    {
        if out.status.success() {
            sites.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    let mut candidates: Vec<String> = Vec::new();
    for site in sites {
        let library = site.join("nvidia/nccl/lib/libnccl.so.2");
        let library = library.to_string_lossy().into_owned();
        if std::path::Path::new(&library).is_file() && !candidates.contains(&library) {
            candidates.push(library);
        }
    }
    candidates.push("libnccl.so.2".to_string());
    candidates
}

impl Nccl {
    /// Opens the first candidate that loads and checks its version. Does not touch the process's
    /// NCCL; [`nccl`] calls this once.
    ///
    /// # Errors
    /// [`NcclError::NotFound`], [`NcclError::MissingEntryPoint`] (`ncclGetVersion`),
    /// [`NcclError::TooOld`].
    pub fn load(candidates: &[String]) -> std::result::Result<Nccl, NcclError> {
        let mut tried = Vec::new();
        for candidate in candidates {
            // SAFETY: opening NCCL runs its initialisers, which have no preconditions on the
            // caller; the handle moves into the entry-point table and stays open.
            let library = match unsafe { libloading::Library::new(candidate) } {
                Ok(library) => library,
                Err(e) => {
                    tried.push(LoadAttempt { candidate: candidate.clone(), reason: e.to_string() });
                    continue;
                }
            };
            // SAFETY: `from_library` resolves symbols by name and stores function pointers whose
            // types bindgen derived from nccl.h; a missing symbol is kept as an error.
            let api = unsafe { NcclApi::from_library(library) }
                .map_err(|_| NcclError::MissingEntryPoint { library: candidate.clone(), symbol: "(library handle)" })?;
            let get_version = api
                .ncclGetVersion
                .as_ref()
                .map_err(|_| NcclError::MissingEntryPoint { library: candidate.clone(), symbol: "ncclGetVersion" })?;
            let mut code: c_int = 0;
            // SAFETY: ncclGetVersion writes one int through a valid pointer.
            let result = unsafe { get_version(&mut code) };
            if result != ncclResult_t::ncclSuccess {
                tried.push(LoadAttempt {
                    candidate: candidate.clone(),
                    reason: format!("ncclGetVersion failed ({})", result.0),
                });
                continue;
            }
            let version = NcclVersion::from_code(code);
            if version < MINIMUM_VERSION {
                return Err(NcclError::TooOld {
                    library: candidate.clone(),
                    found: version,
                    required: MINIMUM_VERSION,
                });
            }
            return Ok(Nccl { api, version, library: candidate.clone() });
        }
        Err(NcclError::NotFound { tried })
    }

    /// The raw entry points.
    pub fn api(&self) -> &NcclApi {
        &self.api
    }

    /// The library's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The library name or path that was opened.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Maps an NCCL result of `call` to `Ok(())` or the typed error.
    fn check(&self, call: &'static str, result: ncclResult_t) -> Result<()> {
        if result == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        let text = |ptr: *const std::ffi::c_char| {
            if ptr.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated static (or communicator-owned) strings.
                unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
            }
        };
        let description = match self.api.ncclGetErrorString.as_ref() {
            // SAFETY: takes any result code, returns a static string.
            Ok(entry) => text(unsafe { entry(result) }),
            Err(_) => String::new(),
        };
        let last_error = match self.api.ncclGetLastError.as_ref() {
            // SAFETY: a null communicator asks for the calling thread's last error.
            Ok(entry) => text(unsafe { entry(std::ptr::null_mut()) }),
            Err(_) => String::new(),
        };
        Err(Error::Nccl(NcclError::Call { call, code: result.0, name: result_name(result), description, last_error }))
    }

    fn missing(&self, symbol: &'static str) -> Error {
        Error::Nccl(NcclError::MissingEntryPoint { library: self.library.clone(), symbol })
    }
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl").field("library", &self.library).field("version", &self.version).finish()
    }
}

fn result_name(result: ncclResult_t) -> &'static str {
    match result {
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        ncclResult_t::ncclTimeout => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// Calls the NCCL entry point `$name` with `$args` and maps its result.
macro_rules! nccl_call {
    ($nccl:expr, $name:ident($($arg:expr),* $(,)?)) => {{
        let nccl: &Nccl = $nccl;
        match nccl.api.$name.as_ref() {
            Ok(entry) => {
                // SAFETY: the entry point has the C signature bindgen generated from nccl.h, and
                // the arguments meet its contract, stated in a `Contract:` comment at each call.
                let result = unsafe { entry($($arg),*) };
                nccl.check(stringify!($name), result)
            }
            Err(_) => Err(nccl.missing(stringify!($name))),
        }
    }};
}

/// A communicator's unique id: made by one rank ([`NcclUniqueId::new`]) and handed to every
/// other rank (as [`to_bytes`](Self::to_bytes), over any channel) before they join.
#[derive(Clone, Copy)]
pub struct NcclUniqueId(ncclUniqueId);

impl NcclUniqueId {
    /// Number of bytes in an id.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; it also starts NCCL's bootstrap listener on this host).
    ///
    /// # Errors
    /// [`NcclError`] when NCCL cannot be loaded or the call fails.
    pub fn new() -> Result<NcclUniqueId> {
        let nccl = nccl()?;
        let mut id = ncclUniqueId::default();
        // Contract: writes one id through a valid pointer.
        nccl_call!(nccl, ncclGetUniqueId(&mut id))?;
        Ok(NcclUniqueId(id))
    }

    /// The id as bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// An id received from the rank that made it.
    pub fn from_bytes(bytes: &[u8; Self::BYTES]) -> NcclUniqueId {
        NcclUniqueId(ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) })
    }
}

impl fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NcclUniqueId(..)")
    }
}

/// One rank's NCCL communicator, on one device. Dropping it destroys the communicator (after its
/// queued operations); [`abort`](Self::abort) ends it at once.
pub struct NcclComm {
    raw: ncclComm_t,
    ctx: Arc<Context>,
    rank: i32,
    n_ranks: i32,
    /// NCCL communicators are not to be used by two threads at once: every call on this one
    /// holds this lock. It guards whether the communicator was aborted ([`abort_now`]
    /// (Self::abort_now)): no call reaches an aborted communicator.
    calls: std::sync::Mutex<bool>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; every call on it
// holds `calls`.
unsafe impl Send for NcclComm {}
// SAFETY: as above: `&NcclComm` only reaches the communicator through those calls.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `n_ranks`, on `ctx`'s device. Blocks until every
    /// rank has joined (`ncclCommInitRank`).
    ///
    /// # Errors
    /// [`NcclError::InvalidRank`] for a rank outside `0..n_ranks` or `n_ranks < 1`; NCCL's error.
    pub fn init_rank(ctx: &Arc<Context>, n_ranks: i32, id: &NcclUniqueId, rank: i32) -> Result<NcclComm> {
        if n_ranks < 1 || !(0..n_ranks).contains(&rank) {
            return Err(Error::Nccl(NcclError::InvalidRank { what: "NcclComm::init_rank", rank, n_ranks }));
        }
        let nccl = nccl()?;
        let _bound = ctx.bind()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // Contract: writes the handle through a valid pointer; the rank is in 0..n_ranks (checked)
        // and the device's context is current (bound above).
        nccl_call!(nccl, ncclCommInitRank(&mut raw, n_ranks, id.0, rank))?;
        Ok(NcclComm { raw, ctx: Arc::clone(ctx), rank, n_ranks, calls: std::sync::Mutex::new(false) })
    }

    /// This rank.
    pub fn rank(&self) -> i32 {
        self.rank
    }

    /// The number of ranks.
    pub fn n_ranks(&self) -> i32 {
        self.n_ranks
    }

    /// The lock of every call, refusing an aborted communicator.
    fn one_call(&self, what: &'static str) -> Result<std::sync::MutexGuard<'_, bool>> {
        let aborted = self.calls.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if *aborted {
            return Err(Error::Nccl(NcclError::Aborted { what }));
        }
        Ok(aborted)
    }

    fn check_peer(&self, what: &'static str, peer: i32, stream: &CudaStream, device: i32) -> Result<()> {
        if !(0..self.n_ranks).contains(&peer) {
            return Err(Error::Nccl(NcclError::InvalidRank { what, rank: peer, n_ranks: self.n_ranks }));
        }
        let device_of = |what, found| {
            if found == self.ctx.ordinal() {
                Ok(())
            } else {
                Err(Error::WrongDevice { what, expected: self.ctx.ordinal(), found })
            }
        };
        device_of("NcclComm: the stream must be on the communicator's device", stream.ordinal())?;
        device_of("NcclComm: the buffer must be on the communicator's device", device)?;
        Ok(())
    }

    /// Sends `buf` to rank `peer` on `stream`, ordered like a copy that reads `buf`. The matching
    /// [`recv`](Self::recv) of as many bytes must be issued by `peer` (a rank sending to itself
    /// issues both inside one [`group`]).
    ///
    /// # Errors
    /// [`NcclError::InvalidRank`]; [`Error::WrongDevice`] for a stream or buffer of another
    /// device; NCCL's error.
    pub fn send<T: DeviceRepr, S: DeviceSlice<T>>(&self, stream: &Arc<CudaStream>, buf: &S, peer: i32) -> Result<()> {
        self.check_peer("NcclComm::send", peer, stream, buf.ordinal())?;
        let nccl = nccl()?;
        let view = buf.as_view();
        let _one_call = self.one_call("NcclComm::send")?;
        ordered(stream, [(view.tracked(), Use::Read)], || {
            // Contract: the buffer is valid for its byte length and ordered on `stream`; the
            // communicator and stream are live and of this device; one call at a time (locked).
            nccl_call!(
                nccl,
                ncclSend(
                    view.device_ptr() as *const c_void,
                    view.byte_len(),
                    ncclDataType_t::ncclUint8,
                    peer,
                    self.raw,
                    stream.raw().cast()
                )
            )
        })
    }

    /// Receives from rank `peer` into `buf` on `stream`, ordered like a copy that writes `buf`.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn recv<T: DeviceRepr, D: DeviceSliceMut<T>>(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut D,
        peer: i32,
    ) -> Result<()> {
        self.check_peer("NcclComm::recv", peer, stream, buf.ordinal())?;
        let nccl = nccl()?;
        let view = buf.as_view_mut();
        let _one_call = self.one_call("NcclComm::recv")?;
        ordered(stream, [(view.tracked(), Use::Write)], || {
            // Contract: the buffer is valid for its byte length, exclusively borrowed and ordered on
            // `stream`; the communicator and stream are live and of this device; one call at a
            // time (locked).
            nccl_call!(
                nccl,
                ncclRecv(
                    view.device_ptr() as *mut c_void,
                    view.byte_len(),
                    ncclDataType_t::ncclUint8,
                    peer,
                    self.raw,
                    stream.raw().cast()
                )
            )
        })
    }

    /// The communicator's asynchronous error, if any (a peer that failed or vanished, a network
    /// error): `Ok(())` while none occurred.
    ///
    /// # Errors
    /// The asynchronous error as [`NcclError::Call`], or the query's own failure.
    pub fn async_error(&self) -> Result<()> {
        let nccl = nccl()?;
        let _one_call = self.one_call("NcclComm::async_error")?;
        let mut state = ncclResult_t::ncclSuccess;
        // Contract: the communicator is live while self is; writes one result.
        nccl_call!(nccl, ncclCommGetAsyncError(self.raw, &mut state))?;
        nccl.check("ncclCommGetAsyncError (asynchronous error)", state)
    }

    /// Ends the communicator at once, abandoning its queued operations (after a peer failed).
    ///
    /// # Errors
    /// NCCL's error.
    pub fn abort(self) -> Result<()> {
        self.abort_now()
    }

    /// Ends the communicator at once from any thread, abandoning its queued operations (their
    /// kernels return, so the streams they sit on drain): the way out when a peer failed while
    /// other threads still hold the communicator. Every later call on it returns
    /// [`NcclError::Aborted`]; a second abort does nothing.
    ///
    /// # Errors
    /// NCCL's error.
    pub fn abort_now(&self) -> Result<()> {
        let mut aborted = self.calls.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if *aborted {
            return Ok(());
        }
        *aborted = true;
        let nccl = nccl()?;
        let _bound = self.ctx.bind()?;
        // Contract: the communicator is live (not aborted before, checked under the lock every
        // call holds) and this is its last use: the flag set above refuses every later call.
        nccl_call!(nccl, ncclCommAbort(self.raw))
    }
}

/// Runs `f` inside an NCCL group (`ncclGroupStart`/`ncclGroupEnd`): the sends and receives it
/// issues are launched together, so a rank may send to and receive from a peer in one step
/// without deadlock. The group is ended even when `f` fails.
///
/// # Errors
/// `f`'s error, else NCCL's.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let nccl = nccl()?;
    // Contract: no arguments; the group is ended below on this thread, whatever `f` returns.
    nccl_call!(nccl, ncclGroupStart())?;
    let result = f();
    let ended = nccl_call!(nccl, ncclGroupEnd());
    let value = result?;
    ended?;
    Ok(value)
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if *self.calls.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()) {
            return;
        }
        let result = nccl().and_then(|nccl| {
            let _bound = self.ctx.bind()?;
            // A communicator whose peer failed is aborted (destroying it would wait for
            // operations that never complete); a healthy one is destroyed after its work.
            // Contract (all three calls): the communicator is live and this drop is its last use.
            let mut state = ncclResult_t::ncclSuccess;
            let healthy = nccl_call!(nccl, ncclCommGetAsyncError(self.raw, &mut state)).is_ok()
                && matches!(state, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress);
            if healthy {
                nccl_call!(nccl, ncclCommDestroy(self.raw))
            } else {
                nccl_call!(nccl, ncclCommAbort(self.raw))
            }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("n_ranks", &self.n_ranks)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(2708), NcclVersion { major: 2, minor: 7, patch: 8 });
        assert_eq!(NcclVersion::from_code(23203), NcclVersion { major: 2, minor: 32, patch: 3 });
        assert_eq!(NcclVersion::from_code(21805).to_string(), "2.18.5");
        assert!(NcclVersion::from_code(2608) < MINIMUM_VERSION);
        assert!(NcclVersion::from_code(2700) >= MINIMUM_VERSION);
    }

    #[test]
    fn a_missing_library_is_a_typed_error_listing_each_attempt() {
        let candidates = vec!["/nonexistent/libnccl.so.2".to_string()];
        match Nccl::load(&candidates) {
            Err(NcclError::NotFound { tried }) => {
                assert_eq!(tried.len(), 1);
                assert_eq!(tried[0].candidate, candidates[0]);
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
    }
}
