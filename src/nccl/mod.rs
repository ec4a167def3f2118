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
use crate::safe::enqueue::{Tracked, ordered_as};
use crate::safe::event_pool::StreamEvent;
use crate::safe::ordering::Use;
use crate::safe::{
    Context, CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice, DeviceSliceMut, record_drop_error,
};
use crate::sys::nccl::{NcclApi, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclResult_t, ncclUniqueId};

/// Environment variable naming the NCCL library to load instead of the default candidates.
pub const LIBNCCL_PATH_VAR: &str = "PPNRT_LIBNCCL_PATH";

/// `NCCL_API_MAGIC` of nccl.h: marks an `ncclConfig_t` as initialised.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` of nccl.h: a configuration field NCCL chooses itself.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;

#[macro_use]
mod result;
mod comm;
mod library;
mod p2p;
mod posting;
mod search;
mod settle;
mod version;

pub use comm::*;
pub use library::*;
pub use p2p::*;
pub(crate) use posting::PostingAlone;
use posting::*;
pub use result::{NcclError, Result};
pub use search::WheelSearch;
pub use settle::*;
pub use version::*;
