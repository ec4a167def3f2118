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
//! A communicator joined with [`NcclComm::init_rank_watched`] (NCCL ≥ [`NONBLOCKING_VERSION`]) is
//! NCCL's *non-blocking* kind: NCCL joins it, and connects it to a peer at its first send or
//! receive, in the background, and every call here waits for that to finish (polling, with a
//! bound) before it returns, so a call still returns with its work enqueued, as a blocking
//! communicator's does, and a peer that dies or stops meanwhile cannot block it for ever. An abort
//! is waited for at most [`ABORT_BOUND`] too: NCCL's waits for NCCL's own threads, and past the
//! bound the communicator is abandoned ([`NcclError::AbortStuck`]).
//!
//! Lifetime: the library stays loaded for the process; a [`NcclComm`] holds its device's context
//! and destroys the communicator when dropped. Threading: `NcclComm` is `Send + Sync`; a
//! [`group`] takes its operations as a list ([`P2p`]), so no other work runs inside it. A send or
//! receive posted into a stream capture while another thread of the process posted one (of any
//! communicator), or while an NCCL kernel of the process still ran, was seen to stall inside the
//! driver (NCCL 2.28.9, driver 580, two ranks sharing one GPU): every send, receive and group
//! here, and every launch of a graph holding one (`NcclComm::posting_launch`), holds one
//! process-wide lock shared and notes its stream in its communicator; the pipeline posts a
//! receive into a capture only while it holds that lock alone and an event recorded then at the
//! end of every such stream of every live communicator has completed (`PostingAlone`).

use std::cell::Cell;
use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockWriteGuard, TryLockError, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::{Error, LoadAttempt, Result};
use crate::safe::memory::{Tracked, ordered, ordered_with};
use crate::safe::ordering::{StreamEvent, Use};
use crate::safe::{
    Context, CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice, DeviceSliceMut, record_drop_error,
};
use crate::sys::nccl::{NcclApi, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclResult_t, ncclUniqueId};

/// Environment variable naming the NCCL library to load instead of the default candidates.
pub const LIBNCCL_PATH_VAR: &str = "PPNRT_LIBNCCL_PATH";

/// The oldest NCCL this crate uses: 2.7.0, the first with point-to-point send/recv and groups.
pub const MINIMUM_VERSION: NcclVersion = NcclVersion { major: 2, minor: 7, patch: 0 };

/// The oldest NCCL whose operations boundaries from other ranks capture into CUDA graphs
/// ([`PpConfig::nccl_recv_graphs`](crate::PpConfig::nccl_recv_graphs)): 2.13.0, the first that
/// documents mixing graph launches with ordinary calls on one communicator
/// (`NCCL_GRAPH_MIXING_SUPPORT`). With an older NCCL every receive is NCCL's call.
pub const GRAPH_MIXING_VERSION: NcclVersion = NcclVersion { major: 2, minor: 13, patch: 0 };

/// The oldest NCCL whose communicators can be joined without blocking (`ncclCommInitRankConfig`
/// with `blocking = 0`, and `ncclCommGetAsyncError` reporting `ncclInProgress` until the join
/// completed): 2.14.0. With an older one [`NcclComm::init_rank_watched`] joins blocking.
pub const NONBLOCKING_VERSION: NcclVersion = NcclVersion { major: 2, minor: 14, patch: 0 };

/// `NCCL_API_MAGIC` of nccl.h: marks an `ncclConfig_t` as initialised.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` of nccl.h: a configuration field NCCL chooses itself.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;

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
    /// A call NCCL completes in the background (a non-blocking communicator's first send or
    /// receive to a peer, its finalization) did not complete within the bound; the communicator
    /// was aborted.
    #[error("{what}: NCCL did not complete it within {waited:?}; the communicator was aborted")]
    TimedOut {
        /// The call.
        what: &'static str,
        /// How long it was waited for.
        waited: Duration,
    },
    /// NCCL's abort of a communicator did not return within the bound (NCCL waits in it for a
    /// thread of its own, which may be stuck inside the driver). The communicator is abandoned:
    /// refused to every later call, never destroyed, its memory left to NCCL; the abort goes on
    /// in a thread of its own.
    #[error("{what}: ncclCommAbort did not return within {waited:?}; the communicator was abandoned")]
    AbortStuck {
        /// The call that aborted.
        what: &'static str,
        /// How long the abort was waited for.
        waited: Duration,
    },
    /// A [`group`] of more operations than [`MAX_GROUP_OPS`].
    #[error("nccl::group: {ops} operations, more than the {max} one group takes")]
    GroupTooLarge {
        /// The operations given.
        ops: usize,
        /// The most one group takes.
        max: usize,
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

/// Calls the NCCL entry point `$name` with `$args`: its raw result, or the error of a missing
/// entry point.
macro_rules! nccl_result {
    ($nccl:expr, $name:ident($($arg:expr),* $(,)?)) => {{
        let nccl: &Nccl = $nccl;
        match nccl.api.$name.as_ref() {
            Ok(entry) => {
                // SAFETY: the entry point has the C signature bindgen generated from nccl.h, and
                // the arguments meet its contract, stated in a `Contract:` comment at each call.
                Ok(unsafe { entry($($arg),*) })
            }
            Err(_) => Err(nccl.missing(stringify!($name))),
        }
    }};
}

/// Calls the NCCL entry point `$name` with `$args` and maps its result.
macro_rules! nccl_call {
    ($nccl:expr, $name:ident($($arg:expr),* $(,)?)) => {{
        let nccl: &Nccl = $nccl;
        nccl_result!(nccl, $name($($arg),*)).and_then(|result| nccl.check(stringify!($name), result))
    }};
}

/// Polls the communicator `raw` until what NCCL does for it in the background is done: `Ok`
/// when it completed, NCCL's error when it failed, `keep_waiting`'s error (checked between
/// polls, paced by [`poll_pause`]) when the caller stops waiting.
fn poll_until_settled(nccl: &Nccl, raw: ncclComm_t, mut keep_waiting: impl FnMut() -> Result<()>) -> Result<()> {
    let mut polls = 0u32;
    loop {
        let mut state = ncclResult_t::ncclInProgress;
        // Contract: the communicator is live (joined, not destroyed); writes one result.
        nccl_call!(nccl, ncclCommGetAsyncError(raw, &mut state))?;
        if state != ncclResult_t::ncclInProgress {
            return nccl.check("ncclCommGetAsyncError (a call completing in the background)", state);
        }
        keep_waiting()?;
        poll_pause(&mut polls);
    }
}

/// The pause between two polls of something that usually completes within microseconds and may
/// take seconds: yields for the first 100 polls, then sleeps 200 µs per poll.
pub(crate) fn poll_pause(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    if *polls < 100 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The longest wait for NCCL's abort of a communicator ([`NcclError::AbortStuck`] after it).
pub const ABORT_BOUND: Duration = Duration::from_secs(10);

/// A communicator handle sent to the thread that aborts it.
struct AbortedHandle(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread; the handle moves to the thread that
// aborts it, and nothing else uses it from then on (its owner refuses every later call).
unsafe impl Send for AbortedHandle {}

/// Calls `ncclCommAbort(raw)` (in `ctx`) and waits for it at most `bound`: NCCL's abort waits for
/// its own threads, and one stuck inside the driver would keep the caller for ever. The abort
/// runs on a thread of its own, which is left to finish when the bound passes
/// ([`NcclError::AbortStuck`], for `what`); where no thread can be started, on the caller's.
/// `raw` must be live and this its last use.
fn abort_within(
    nccl: &'static Nccl,
    ctx: &Arc<Context>,
    raw: ncclComm_t,
    bound: Duration,
    what: &'static str,
) -> Result<ncclResult_t> {
    let abort = move |handle: AbortedHandle, ctx: Arc<Context>| {
        let _bound = ctx.bind()?;
        // Contract: the communicator is live and this is its last use (the caller's).
        nccl_result!(nccl, ncclCommAbort(handle.0))
    };
    let (done, result) = std::sync::mpsc::channel();
    let (handle, thread_ctx) = (AbortedHandle(raw), Arc::clone(ctx));
    let started = std::thread::Builder::new().name("ppnrt-nccl-abort".into()).spawn(move || {
        let _ = done.send(abort(handle, thread_ctx));
    });
    if started.is_err() {
        return abort(AbortedHandle(raw), Arc::clone(ctx));
    }
    match result.recv_timeout(bound) {
        Ok(aborted) => aborted,
        Err(_) => Err(Error::Nccl(NcclError::AbortStuck { what, waited: bound })),
    }
}

/// A communicator being joined: aborted when dropped unless its handle was taken (the join
/// succeeded); the abort is waited for at most `bound` ([`abort_within`]).
struct JoinInProgress<'c> {
    nccl: &'static Nccl,
    ctx: &'c Arc<Context>,
    raw: ncclComm_t,
    bound: Duration,
}

impl Drop for JoinInProgress<'_> {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // The communicator was made by the join, nothing else holds it, and this is its last use.
        let aborted = abort_within(self.nccl, self.ctx, self.raw, self.bound, "NcclComm::init_rank_watched");
        if let Err(e) = aborted {
            record_drop_error(e);
        }
    }
}

/// A `keep_waiting` of [`poll_until_settled`] that stops waiting for `what` after `waited`.
fn for_at_most(what: &'static str, waited: Duration) -> impl FnMut() -> Result<()> {
    let deadline = Instant::now().checked_add(waited);
    move || match deadline {
        Some(deadline) if Instant::now() >= deadline => Err(Error::Nccl(NcclError::TimedOut { what, waited })),
        _ => Ok(()),
    }
}

/// An `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` makes it (every choice left to NCCL), with
/// `blocking` set.
fn config(blocking: bool) -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: crate::sys::nccl::NCCL_VERSION_CODE,
        blocking: c_int::from(blocking),
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
        graphUsageMode: CONFIG_UNDEF_INT,
        numRmaCtx: CONFIG_UNDEF_INT,
        maxP2pPeers: CONFIG_UNDEF_INT,
        graphStreamOrdering: CONFIG_UNDEF_INT,
        launchOrderImplicit: CONFIG_UNDEF_INT,
        numRmaSig: CONFIG_UNDEF_INT,
        rmaEagerInit: CONFIG_UNDEF_INT,
        hostCftMode: CONFIG_UNDEF_INT,
        nvlsHostMode: CONFIG_UNDEF_INT,
    }
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
    /// For a non-blocking communicator (joined by [`init_rank_watched`](Self::init_rank_watched)),
    /// whose calls NCCL may complete in the background: how long such a call is waited for
    /// before the communicator is aborted. `None` for a blocking one.
    background_bound: Option<Duration>,
    /// Its work that may still run, looked at before a receive is captured ([`PostingAlone`]).
    in_flight: Arc<InFlight>,
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
        Ok(NcclComm::joined(raw, ctx, rank, n_ranks, None))
    }

    fn joined(
        raw: ncclComm_t,
        ctx: &Arc<Context>,
        rank: i32,
        n_ranks: i32,
        background_bound: Option<Duration>,
    ) -> NcclComm {
        NcclComm {
            raw,
            ctx: Arc::clone(ctx),
            rank,
            n_ranks,
            calls: std::sync::Mutex::new(false),
            background_bound,
            in_flight: InFlight::registered(),
        }
    }

    /// Whether NCCL may complete this communicator's calls in the background.
    fn nonblocking(&self) -> bool {
        self.background_bound.is_some()
    }

    /// Joins the communicator `id` as `rank` of `n_ranks`, on `ctx`'s device, without blocking
    /// for longer than the caller allows: NCCL joins in the background while this call polls
    /// it, calling `keep_waiting` between polls (about every 200 µs); when `keep_waiting` fails
    /// (a deadline passed, a peer was seen gone), the join is aborted and that error returned.
    /// A rank that never joins (it died or stopped after the id was handed out) therefore costs
    /// the caller what `keep_waiting` allows, not a hang: with [`init_rank`](Self::init_rank)
    /// NCCL waits for it for ever.
    ///
    /// The communicator is NCCL's non-blocking kind (see the [module docs](self)): a later call
    /// that NCCL completes in the background (the first send or receive to a peer connects it)
    /// is waited for, at most `settle_within`; past that the communicator is aborted and the
    /// call fails with [`NcclError::TimedOut`].
    ///
    /// With an NCCL older than [`NONBLOCKING_VERSION`] this is `init_rank`: it blocks until
    /// every rank joined, whatever `keep_waiting` says.
    ///
    /// # Errors
    /// As [`init_rank`](Self::init_rank); `keep_waiting`'s error.
    pub fn init_rank_watched(
        ctx: &Arc<Context>,
        n_ranks: i32,
        id: &NcclUniqueId,
        rank: i32,
        settle_within: Duration,
        keep_waiting: impl FnMut() -> Result<()>,
    ) -> Result<NcclComm> {
        let nccl = nccl()?;
        if nccl.version() < NONBLOCKING_VERSION || nccl.api.ncclCommInitRankConfig.is_err() {
            return NcclComm::init_rank(ctx, n_ranks, id, rank);
        }
        if n_ranks < 1 || !(0..n_ranks).contains(&rank) {
            return Err(Error::Nccl(NcclError::InvalidRank { what: "NcclComm::init_rank_watched", rank, n_ranks }));
        }
        let _bound = ctx.bind()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        let mut config = config(false);
        // Contract: writes the handle through a valid pointer; the rank is in 0..n_ranks
        // (checked), the configuration is initialised as NCCL_CONFIG_INITIALIZER does and lives
        // through the call (NCCL copies it), and the device's context is current (bound above).
        let started = nccl_result!(nccl, ncclCommInitRankConfig(&mut raw, n_ranks, id.0, rank, &mut config))?;
        // Aborted on every way out but success: an error, or `keep_waiting` panicking.
        let mut joining = JoinInProgress { nccl, ctx, raw, bound: settle_within.min(ABORT_BOUND) };
        match started {
            ncclResult_t::ncclSuccess => {}
            ncclResult_t::ncclInProgress if !raw.is_null() => poll_until_settled(nccl, raw, keep_waiting)?,
            other => nccl.check("ncclCommInitRankConfig", other)?,
        }
        joining.raw = std::ptr::null_mut();
        Ok(NcclComm::joined(raw, ctx, rank, n_ranks, Some(settle_within)))
    }

    /// Maps the result of `call`, which the caller made holding the call lock (`aborted`): a
    /// non-blocking communicator's `ncclInProgress` is waited for, at most `settle_within`;
    /// past that the communicator is aborted.
    fn settle(
        &self,
        nccl: &Nccl,
        aborted: &mut MutexGuard<'_, bool>,
        call: &'static str,
        result: ncclResult_t,
    ) -> Result<()> {
        let Some(bound) = self.background_bound.filter(|_| result == ncclResult_t::ncclInProgress) else {
            return nccl.check(call, result);
        };
        let settled = poll_until_settled(nccl, self.raw, for_at_most(call, bound));
        if matches!(settled, Err(Error::Nccl(NcclError::TimedOut { .. }))) {
            if let Err(e) = self.abort_locked(aborted) {
                record_drop_error(e);
            }
        }
        settled
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
        self.alone(&P2p::send(self, stream, buf, peer), "NcclComm::send")
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
        self.alone(&P2p::recv(self, stream, buf, peer), "NcclComm::recv")
    }

    /// Issues `op`, a send or receive of this communicator, outside a group, ordered like a copy
    /// of its buffer; when NCCL completes it in the background, it is waited for (bounded)
    /// before the ordering rule notes the use.
    fn alone(&self, op: &P2p<'_>, what: &'static str) -> Result<()> {
        let nccl = nccl()?;
        posting(|| {
            let mut one_call = self.one_call(what)?;
            let posted = ordered(op.stream(), [op.ordered_use()], || {
                let result = op.raw_call(nccl)?;
                // Enqueued once settled: the ordering rule marks the buffer after this returns.
                self.settle(nccl, &mut one_call, op.call_name(), result)
            });
            // Noted whatever the call returned: a failed call may have enqueued work.
            self.in_flight.note(op.stream());
            posted
        })
    }

    /// Launches work that holds an operation of this communicator (a graph that captured a send
    /// or receive of it) on `stream` as a send or receive is posted: holding the process's
    /// posting lock shared, with an event after the work noted as this communicator's work that
    /// may still run (see [`PostingAlone`]).
    ///
    /// # Errors
    /// `launch`'s error.
    pub(crate) fn posting_launch(&self, stream: &Arc<CudaStream>, launch: impl FnOnce() -> Result<()>) -> Result<()> {
        posting(|| {
            launch()?;
            self.in_flight.note(stream);
            Ok(())
        })
    }

    /// The communicator's asynchronous error, if any (a peer that failed or vanished, a network
    /// error): `Ok(())` while none occurred (and while a non-blocking communicator completes a
    /// call in the background).
    ///
    /// # Errors
    /// The asynchronous error as [`NcclError::Call`], or the query's own failure.
    pub fn async_error(&self) -> Result<()> {
        let nccl = nccl()?;
        let one_call = self.one_call("NcclComm::async_error")?;
        self.async_error_locked(nccl, &one_call)
    }

    /// [`async_error`](Self::async_error) unless another thread's call holds the communicator
    /// (a call a non-blocking communicator completes in the background may hold it until its
    /// bound): then `Ok(())` at once, and the next look checks. For a watchdog, which must not
    /// wait on the calls it watches.
    ///
    /// # Errors
    /// As [`async_error`](Self::async_error).
    pub fn async_error_if_idle(&self) -> Result<()> {
        let nccl = nccl()?;
        let one_call = match self.calls.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        if *one_call {
            return Err(Error::Nccl(NcclError::Aborted { what: "NcclComm::async_error_if_idle" }));
        }
        self.async_error_locked(nccl, &one_call)
    }

    fn async_error_locked(&self, nccl: &Nccl, _one_call: &MutexGuard<'_, bool>) -> Result<()> {
        let mut state = ncclResult_t::ncclSuccess;
        // Contract: the communicator is live while self is; writes one result.
        nccl_call!(nccl, ncclCommGetAsyncError(self.raw, &mut state))?;
        if state == ncclResult_t::ncclInProgress {
            return Ok(());
        }
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
        self.abort_locked(&mut aborted)
    }

    /// [`abort_now`](Self::abort_now) with the call lock (`aborted`) held.
    fn abort_locked(&self, aborted: &mut MutexGuard<'_, bool>) -> Result<()> {
        if **aborted {
            return Ok(());
        }
        **aborted = true;
        let nccl = nccl()?;
        // The communicator is live (not aborted before, checked under the lock every call holds)
        // and this is its last use: the flag set above refuses every later call, and the drop.
        let result = abort_within(nccl, &self.ctx, self.raw, self.abort_bound(), "NcclComm::abort_now")?;
        self.check_teardown(nccl, "ncclCommAbort", result)
    }

    /// How long an abort of this communicator is waited for: its background bound, at most
    /// [`ABORT_BOUND`].
    fn abort_bound(&self) -> Duration {
        self.background_bound.map_or(ABORT_BOUND, |bound| bound.min(ABORT_BOUND))
    }

    /// Maps the result of the abort or destroy `call`: a non-blocking communicator may finish
    /// either in the background (`ncclInProgress`), which is no error, as it is not used again.
    fn check_teardown(&self, nccl: &Nccl, call: &'static str, result: ncclResult_t) -> Result<()> {
        if result == ncclResult_t::ncclInProgress && self.nonblocking() {
            return Ok(());
        }
        nccl.check(call, result)
    }
}

/// One send or receive of a [`group`].
#[derive(Debug)]
pub enum P2p<'a> {
    /// Sends the bytes of `buf` to rank `peer` on `stream`.
    Send {
        /// The communicator.
        comm: &'a NcclComm,
        /// The stream of the send (of the communicator's device).
        stream: &'a Arc<CudaStream>,
        /// What is sent.
        buf: CudaView<'a, u8>,
        /// The receiving rank.
        peer: i32,
    },
    /// Receives from rank `peer` into the bytes of `buf` on `stream`.
    Recv {
        /// The communicator.
        comm: &'a NcclComm,
        /// The stream of the receive (of the communicator's device).
        stream: &'a Arc<CudaStream>,
        /// Where it lands.
        buf: CudaViewMut<'a, u8>,
        /// The sending rank.
        peer: i32,
    },
}

impl<'a> P2p<'a> {
    /// A send of `buf` to `peer` on `stream`.
    pub fn send<T: DeviceRepr, S: DeviceSlice<T>>(
        comm: &'a NcclComm,
        stream: &'a Arc<CudaStream>,
        buf: &'a S,
        peer: i32,
    ) -> P2p<'a> {
        P2p::Send { comm, stream, buf: buf.as_view().into_bytes(), peer }
    }

    /// A receive from `peer` into `buf` on `stream`.
    pub fn recv<T: DeviceRepr, D: DeviceSliceMut<T>>(
        comm: &'a NcclComm,
        stream: &'a Arc<CudaStream>,
        buf: &'a mut D,
        peer: i32,
    ) -> P2p<'a> {
        P2p::Recv { comm, stream, buf: buf.as_view_mut().into_bytes(), peer }
    }

    fn comm(&self) -> &'a NcclComm {
        match self {
            P2p::Send { comm, .. } | P2p::Recv { comm, .. } => comm,
        }
    }

    fn stream(&self) -> &'a Arc<CudaStream> {
        match self {
            P2p::Send { stream, .. } | P2p::Recv { stream, .. } => stream,
        }
    }

    fn peer(&self) -> i32 {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }

    fn ordered_use(&self) -> (Tracked<'_>, Use) {
        match self {
            P2p::Send { buf, .. } => (buf.tracked(), Use::Read),
            P2p::Recv { buf, .. } => (buf.tracked(), Use::Write),
        }
    }

    fn device(&self) -> i32 {
        match self {
            P2p::Send { buf, .. } => buf.ordinal(),
            P2p::Recv { buf, .. } => buf.ordinal(),
        }
    }

    /// The NCCL entry point of the operation.
    fn call_name(&self) -> &'static str {
        if matches!(self, P2p::Send { .. }) { "ncclSend" } else { "ncclRecv" }
    }

    /// Issues the operation inside the open group.
    fn issue(&self, nccl: &Nccl) -> Result<()> {
        let result = self.raw_call(nccl)?;
        let call = if matches!(self, P2p::Send { .. }) { "ncclSend (in a group)" } else { "ncclRecv (in a group)" };
        nccl.check(call, result)
    }

    /// Calls NCCL's send or receive: its raw result.
    fn raw_call(&self, nccl: &Nccl) -> Result<ncclResult_t> {
        let comm = self.comm();
        Ok(match self {
            // Contract: the buffer is valid for its byte length and ordered on `stream` (waits
            // enqueued by the caller, `group` or `NcclComm::alone`); the communicator and stream
            // are live and of this device (checked by the caller); the communicator's call lock
            // is held by the caller.
            P2p::Send { stream, buf, peer, .. } => nccl_result!(
                nccl,
                ncclSend(
                    buf.device_ptr() as *const c_void,
                    buf.byte_len(),
                    ncclDataType_t::ncclUint8,
                    *peer,
                    comm.raw,
                    stream.raw().cast()
                )
            )?,
            // Contract: as the send's; the buffer is exclusively borrowed.
            P2p::Recv { stream, buf, peer, .. } => nccl_result!(
                nccl,
                ncclRecv(
                    buf.device_ptr() as *mut c_void,
                    buf.byte_len(),
                    ncclDataType_t::ncclUint8,
                    *peer,
                    comm.raw,
                    stream.raw().cast()
                )
            )?,
        })
    }
}

/// The most operations one [`group`] takes.
pub const MAX_GROUP_OPS: usize = 256;

/// Issues `ops` as one NCCL group (`ncclGroupStart`, the sends and receives,
/// `ncclGroupEnd`): they are launched together, so a rank may send to and receive from a peer
/// in one step without deadlock. Each operation is ordered by the crate's rule like a copy
/// that reads (a send) or writes (a receive) its buffer: its stream waits for what the buffer's
/// use conflicts with before the group, and the use is noted once the group ended, when NCCL
/// has enqueued its work. Nothing but these operations runs inside the group (NCCL launches a
/// group's work only at its end, so other work on those buffers issued inside it would be
/// ordered before work that is not yet enqueued). With non-blocking communicators
/// ([`NcclComm::init_rank_watched`]) the group's end is waited for when NCCL completes it in
/// the background (each communicator at most its bound).
///
/// # Errors
/// [`NcclError::InvalidRank`] and [`Error::WrongDevice`] as [`NcclComm::send`], checked for
/// every operation before anything is issued; [`NcclError::Aborted`] for an aborted
/// communicator; [`NcclError::GroupTooLarge`] beyond [`MAX_GROUP_OPS`]; NCCL's error.
pub fn group(ops: &[P2p<'_>]) -> Result<()> {
    if ops.len() > MAX_GROUP_OPS {
        return Err(Error::Nccl(NcclError::GroupTooLarge { ops: ops.len(), max: MAX_GROUP_OPS }));
    }
    for op in ops {
        let what = if matches!(op, P2p::Send { .. }) { "nccl::group (a send)" } else { "nccl::group (a receive)" };
        op.comm().check_peer(what, op.peer(), op.stream(), op.device())?;
    }
    let nccl = nccl()?;
    // Every communicator's call lock, once each, in address order, from the first call to the
    // group's end.
    let mut comms: Vec<&NcclComm> = ops.iter().map(P2p::comm).collect();
    comms.sort_by_key(|comm| std::ptr::from_ref::<NcclComm>(comm) as usize);
    comms.dedup_by_key(|comm| std::ptr::from_ref::<NcclComm>(comm) as usize);
    posting(|| {
        let mut locks = comms.iter().map(|comm| comm.one_call("nccl::group")).collect::<Result<Vec<_>>>()?;
        let posted = ordered_from(nccl, ops, 0, &comms, &mut locks);
        // Noted whatever the group returned: a failed group may have enqueued work.
        for op in ops {
            op.comm().in_flight.note(op.stream());
        }
        posted
    })
}

/// Held shared by every send, receive and group of this process while it posts (from before the
/// communicators' call locks until NCCL has enqueued the work), and exclusively by a thread
/// posting into a stream capture ([`PostingAlone`]): NCCL's launch into a capture and another
/// thread's launch were seen to deadlock inside the driver (`docs/NCCL-BOUNDARY.md`, Tests).
static POSTING: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds [`POSTING`] exclusively (its own calls then take nothing).
    static POSTING_ALONE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `post` holding [`POSTING`] shared, unless this thread holds it alone.
fn posting<R>(post: impl FnOnce() -> R) -> R {
    if POSTING_ALONE.get() {
        return post();
    }
    let _shared = POSTING.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    post()
}

/// The NCCL work one communicator posted that may still run: each stream that carried one of
/// its sends, receives or launches of a graph holding one, whether it did since the stream's
/// event was last recorded, and that event. Noting a post costs no driver call: the event is
/// recorded only when a capture asks ([`settled`](Self::settled)), at the end of the stream then
/// (after the post, and after whatever the stream was given since, which only makes the answer
/// later). Written under [`POSTING`] (shared), read under it exclusively.
#[derive(Default)]
struct InFlight {
    streams: Mutex<Vec<PostedOn>>,
}

/// One stream of a communicator's [`InFlight`]. A released entry (`stream` taken, see
/// [`InFlight::note`]) was recorded after its last post: its `posted` is false and its `event`
/// set.
struct PostedOn {
    stream: Option<Arc<CudaStream>>,
    /// Posted on since `event` was recorded (or never recorded).
    posted: bool,
    event: Option<StreamEvent>,
}

impl PostedOn {
    /// Records the event at the end of the stream if it was posted on since the last record
    /// (while the stream is captured, the capture's own event before it: captured work runs only
    /// when launched, and a launch is noted itself).
    fn record(&mut self) -> Result<()> {
        if let (true, Some(stream)) = (self.posted, &self.stream) {
            stream.record_after_enqueued(None, &mut self.event)?;
            self.posted = false;
        }
        Ok(())
    }

    /// Lets go of the stream when nothing else holds it (its caller dropped it), once its event
    /// is recorded (a failed record keeps it, for the next look).
    fn release_if_unheld(&mut self) {
        if self.stream.as_ref().is_some_and(|held| Arc::strong_count(held) == 1) && self.record().is_ok() {
            self.stream = None;
        }
    }

    /// Whether the work posted on the stream has completed (queried, never waited for).
    fn complete(&self) -> Result<bool> {
        match &self.event {
            Some(event) if !self.posted => event.is_complete(),
            _ => Ok(false),
        }
    }
}

/// How many streams a communicator's [`InFlight`] holds before a new one makes it let go of
/// those nothing else holds.
const IN_FLIGHT_STREAMS: usize = 8;

/// Every live communicator's [`InFlight`] (weakly: a communicator's drop takes its streams and
/// events, and the contexts they hold, with it); the dead ones are taken out when one is added.
static COMMUNICATORS_IN_FLIGHT: Mutex<Vec<Weak<InFlight>>> = Mutex::new(Vec::new());

impl InFlight {
    /// A new one, registered in [`COMMUNICATORS_IN_FLIGHT`].
    fn registered() -> Arc<InFlight> {
        let in_flight = Arc::new(InFlight::default());
        let mut all = COMMUNICATORS_IN_FLIGHT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        all.retain(|weak| weak.strong_count() > 0);
        all.push(Arc::downgrade(&in_flight));
        in_flight
    }

    /// Notes that work was just enqueued on `stream`. A stream new to this communicator, past
    /// [`IN_FLIGHT_STREAMS`] of them, first makes it let go of the streams only it holds (their
    /// callers dropped them), and the released entries whose event completed are taken out. So a
    /// caller that posts on a new stream each time keeps no stream alive here.
    fn note(&self, stream: &Arc<CudaStream>) {
        let mut streams = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let noted = streams.iter_mut().find(|on| on.stream.as_ref().is_some_and(|held| held.id() == stream.id()));
        if let Some(on) = noted {
            on.posted = true;
            return;
        }
        if streams.len() >= IN_FLIGHT_STREAMS {
            streams.iter_mut().for_each(PostedOn::release_if_unheld);
            streams.retain(|on| on.stream.is_some() || !on.complete().unwrap_or(false));
        }
        streams.push(PostedOn { stream: Some(Arc::clone(stream)), posted: true, event: None });
    }

    /// Whether all the work noted has completed: an event recorded at the end of each stream
    /// posted on since its last one ([`PostedOn::record`]), then every stream's event queried.
    /// The streams whose event completed are taken out.
    ///
    /// # Errors
    /// An event record's or query's error.
    fn settled(&self) -> Result<bool> {
        let mut streams = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        streams.iter_mut().try_for_each(PostedOn::record)?;
        let mut settled = true;
        let mut failed = None;
        streams.retain(|on| {
            let complete = failed.is_none()
                && on.complete().unwrap_or_else(|e| {
                    failed = Some(e);
                    false
                });
            settled &= complete;
            !complete
        });
        failed.map_or(Ok(settled), Err)
    }
}

/// Whether every live communicator's NCCL work has completed (see [`InFlight::settled`]).
///
/// # Errors
/// An event query's error.
fn all_settled() -> Result<bool> {
    // Taken out of the list first: the list is not held across the driver calls below.
    let all: SmallVec<[Arc<InFlight>; 8]> = COMMUNICATORS_IN_FLIGHT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for in_flight in all {
        if !in_flight.settled()? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// [`POSTING`] held exclusively by this thread: while it lives, no other send or receive of the
/// process is in progress, and this thread's own go ahead (for posting into a capture).
pub(crate) struct PostingAlone {
    _exclusive: RwLockWriteGuard<'static, ()>,
}

impl PostingAlone {
    /// The lock, if no send or receive of the process is being posted now and every one a live
    /// communicator posted before has completed on its GPU (no NCCL kernel of the process is
    /// running, which may wait for a peer that waits for this process); `None` else. Never waits
    /// (a call in progress may be waiting for a peer).
    ///
    /// # Errors
    /// An event query's error.
    pub(crate) fn try_settled() -> Result<Option<PostingAlone>> {
        let exclusive = match POSTING.try_write() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        if !all_settled()? {
            return Ok(None);
        }
        POSTING_ALONE.set(true);
        Ok(Some(PostingAlone { _exclusive: exclusive }))
    }
}

impl Drop for PostingAlone {
    fn drop(&mut self) {
        POSTING_ALONE.set(false);
    }
}

/// Orders `ops[at]` and, inside that, the rest in turn; the innermost issues the group. Each
/// operation's use is noted when its `ordered_with` returns, after the group ended.
fn ordered_from(
    nccl: &Nccl,
    ops: &[P2p<'_>],
    at: usize,
    comms: &[&NcclComm],
    locks: &mut [MutexGuard<'_, bool>],
) -> Result<()> {
    match ops.get(at) {
        // Unlocked between the waits and the notes: two operations may share a buffer (one
        // buffer sent to two peers).
        Some(op) => {
            ordered_with(op.stream(), [op.ordered_use()], false, || ordered_from(nccl, ops, at + 1, comms, locks))
        }
        None => issue_group(nccl, ops, comms, locks),
    }
}

/// The group itself: every operation issued, then the group ended (and waited for where NCCL
/// completes it in the background).
fn issue_group(nccl: &Nccl, ops: &[P2p<'_>], comms: &[&NcclComm], locks: &mut [MutexGuard<'_, bool>]) -> Result<()> {
    // Contract: no arguments; the group is ended below on this thread, whatever the calls return.
    nccl_call!(nccl, ncclGroupStart())?;
    let issued = ops.iter().try_for_each(|op| op.issue(nccl));
    // Contract: ends the group started above, on this thread.
    let ended = nccl_result!(nccl, ncclGroupEnd()).and_then(|ended| {
        if ended != ncclResult_t::ncclInProgress {
            return nccl.check("ncclGroupEnd", ended);
        }
        comms
            .iter()
            .zip(locks.iter_mut())
            .filter(|(comm, _)| comm.nonblocking())
            .try_for_each(|(comm, lock)| comm.settle(nccl, lock, "ncclGroupEnd", ended))
    });
    issued?;
    ended
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
            // A non-blocking communicator is finalized first (in the background, waited for at
            // most its bound; an abort if it does not finish), as NCCL asks of that kind.
            let finalized = healthy && self.background_bound.is_none_or(|bound| self.finalize(nccl, bound).is_ok());
            let (call, result) = if finalized {
                ("ncclCommDestroy", nccl_result!(nccl, ncclCommDestroy(self.raw))?)
            } else {
                ("ncclCommAbort", abort_within(nccl, &self.ctx, self.raw, self.abort_bound(), "NcclComm::drop")?)
            };
            self.check_teardown(nccl, call, result)
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl NcclComm {
    /// Finalizes a non-blocking communicator (its drop), waiting at most `bound`; the
    /// error is recorded as a drop error.
    fn finalize(&self, nccl: &Nccl, bound: Duration) -> Result<()> {
        // Contract: the communicator is live and its drop is its only user now.
        let result = nccl_result!(nccl, ncclCommFinalize(self.raw)).and_then(|result| {
            if result != ncclResult_t::ncclInProgress {
                return nccl.check("ncclCommFinalize", result);
            }
            poll_until_settled(nccl, self.raw, for_at_most("ncclCommFinalize", bound))
        });
        if let Err(e) = &result {
            record_drop_error(e.clone());
        }
        result
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
