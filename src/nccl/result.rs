//! NCCL's result layer, as `result` is the driver's: [`NcclError`] and its [`Result`], the two
//! macros through which every NCCL entry point is called (`nccl_result!` gives the raw
//! `ncclResult_t` or the error of a missing entry point, `nccl_call!` maps it too), and the
//! mapping of an `ncclResult_t` to the typed error (NCCL's name, text and last error for the
//! code). It names nothing above the CUDA layers' error; the crate-wide
//! [`Error`](crate::Error) converts from it (an NCCL call's [`NcclError::Cuda`] becomes
//! `Error::Cuda`).

use std::time::Duration;

use super::NcclVersion;
use crate::cuda_error::{CudaError, LoadAttempt};
use crate::sys::nccl::ncclResult_t;

/// `Result` with [`NcclError`].
///
/// ```no_run
/// use ppnrt::nccl::{self, NcclVersion};
///
/// /// NCCL's version, or why it cannot be used.
/// fn nccl_version() -> nccl::Result<NcclVersion> {
///     Ok(nccl::nccl()?.version())
/// }
/// ```
pub type Result<T, E = NcclError> = std::result::Result<T, E>;

/// Why NCCL cannot be used, or an NCCL call's failure.
///
/// ```no_run
/// use ppnrt::NcclError;
///
/// match ppnrt::nccl::nccl() {
///     Ok(nccl) => println!("NCCL {}", nccl.version()),
///     Err(NcclError::NotFound { tried }) => {
///         eprintln!("no NCCL ({} places tried): pip install nvidia-nccl-cu12, or set PPNRT_LIBNCCL_PATH", tried.len())
///     }
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// A CUDA call or check around the NCCL call failed (ordering its buffers, binding the
    /// context, a buffer on another device): see [`CudaError`].
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// No candidate library could be opened; each attempt is listed.
    #[error("NCCL could not be loaded; tried: {}", tried.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    NotFound {
        /// Every candidate tried, with why it failed.
        tried: Vec<LoadAttempt>,
    },
    /// The library is older than [`MINIMUM_VERSION`](super::MINIMUM_VERSION).
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
    /// A [`group`](super::group) of more operations than [`MAX_GROUP_OPS`](super::MAX_GROUP_OPS).
    #[error("nccl::group: {ops} operations, more than the {max} one group takes")]
    GroupTooLarge {
        /// The operations given.
        ops: usize,
        /// The most one group takes.
        max: usize,
    },
    /// A call on a communicator that was aborted ([`NcclComm::abort_now`](super::NcclComm::abort_now)).
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

/// Calls the NCCL entry point `$name` with `$args`: its raw result, or the error of a missing
/// entry point.
macro_rules! nccl_result {
    ($nccl:expr, $name:ident($($arg:expr),* $(,)?)) => {{
        let nccl = $nccl;
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
        let nccl = $nccl;
        nccl_result!(nccl, $name($($arg),*)).and_then(|result| nccl.check(stringify!($name), result))
    }};
}

pub(super) fn result_name(result: ncclResult_t) -> &'static str {
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
