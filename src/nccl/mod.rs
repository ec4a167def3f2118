//! NCCL, loaded at run time like the driver, and the point-to-point calls a pipeline boundary
//! between processes needs: a unique id, a communicator per rank, `send`/`recv` on a stream
//! (ordered by the crate's ordering rule like any copy), groups, and error polling.
//!
//! The library is opened once per process, on first use, and never closed. Candidates, in order:
//! the path in `PPNRT_LIBNCCL_PATH` if it is set (then nothing else is tried); `libnccl.so.2` in the
//! PyPI wheel layout (`site-packages/nvidia/nccl/lib`) of the places Python looks for packages
//! (the virtual and conda environments, `PYTHONPATH`, the Pythons on `PATH`, the user's and the
//! system's directories; found by listing directories, never by running Python, see
//! [`WheelSearch`]); then `libnccl.so.2` from the system's library path. NCCL must be at least
//! [`MINIMUM_VERSION`] (2.7.0: point-to-point send/recv and groups): a candidate that is older,
//! does not load or lacks an entry point is skipped for the next one, and when none is usable
//! the typed [`NcclError`] names every candidate and why. Every entry point is a per-symbol
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
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockWriteGuard, TryLockError, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::cuda_error::{CudaError, LoadAttempt};
use crate::safe::memory::{Tracked, ordered_as};
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
///
/// ```
/// use ppnrt::nccl::NcclVersion;
///
/// let version = NcclVersion::from_code(22_005); // NCCL 2.20.5
/// assert_eq!((version.major, version.minor, version.patch), (2, 20, 5));
/// assert!(version >= NcclVersion { major: 2, minor: 13, patch: 0 });
/// ```
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

#[macro_use]
mod result;
mod comm;
mod library;
mod p2p;
mod posting;
mod search;
mod settle;

pub use comm::*;
pub use library::*;
pub use p2p::*;
pub(crate) use posting::PostingAlone;
use posting::*;
pub use result::{NcclError, Result};
pub use search::WheelSearch;
pub use settle::*;

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
