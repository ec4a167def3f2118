//! The double tier: tests through the CUDA driver double (`tests/driver_double/cuda_double.c`):
//! the soundness scenarios of `common/soundness.rs`, and error injection on each call that
//! protects work already enqueued; with the NCCL double (`tests/driver_double/nccl_double.c`)
//! too, two ranks of one pipeline as threads of this process, each driver and NCCL call of their
//! steps, setup and teardown failed in turn; the slot ring across ranks (`ring`), the teardown of
//! boundaries between ranks (`teardown_ranks`), bounded
//! waits and frees (`bounded`), an engine's own buffers and streams (`foreign`) and, with the
//! `cudarc` feature, cudarc's (`cudarc_double`, `cudarc_attacks`). They run on every machine
//! with a C compiler (CI sets `PPNRT_REQUIRE_DOUBLE` so that a missing compiler fails rather
//! than skips).
//!
//! Beside this binary, in this folder, the double-tier tests that must be processes of their
//! own: `nccl` and `processes` (through the doubles where no driver loads, on the GPUs and NCCL
//! where they are; both run child processes of themselves) and `campaign` (the fault campaign
//! across ranks, which CI also runs in a release build).
//!
//! The double runs queued work only when something synchronises, and then only what that needs:
//! work left unordered runs as late as possible, so a missing wait shows up deterministically as
//! a wrong value or a counted access to freed memory (a "violation").

#[path = "../common/mod.rs"]
mod common;

#[path = "../common/double.rs"]
mod double;
#[path = "../common/gated_kernels.rs"]
mod gated_kernels;
#[path = "../common/graphs.rs"]
mod graphs;
#[path = "../common/ipc_fd.rs"]
mod ipc_fd;
#[path = "../common/ordering.rs"]
mod ordering;
#[path = "../common/ranks.rs"]
mod ranks;
#[path = "../common/raw_driver.rs"]
mod raw_driver;
#[path = "../common/soundness.rs"]
mod soundness;
#[path = "../common/threads.rs"]
mod threads;

use std::process::Command;
use std::sync::Arc;

use double::with_double;
use ranks::two_ranks;
use raw_driver::raw;

use ppnrt::{
    CudaError, CudaSlice, CudaStream, DeviceSlice, Engine, Error, PinnedHostBuffer, PpConfig, PpNRt, StreamOverride,
    TransportPolicy,
};

/// The errors raised in `Drop` since the last call ([`ppnrt::take_drop_errors`]), each as the
/// crate's [`Error`] (they are kept as the error of the layer that dropped).
fn typed_drop_errors() -> Vec<Error> {
    ppnrt::take_drop_errors()
        .into_iter()
        .map(|e| {
            let e = match e.downcast::<Error>() {
                Ok(top) => return *top,
                Err(e) => e,
            };
            let e = match e.downcast::<CudaError>() {
                Ok(cuda) => return Error::from(*cuda),
                Err(e) => e,
            };
            match e.downcast::<ppnrt::nccl::NcclError>() {
                Ok(nccl) => Error::from(*nccl),
                Err(other) => panic!("a drop error of no layer of the crate: {other}"),
            }
        })
        .collect()
}

/// Cases of each property test: 256 in a debug build (`cargo test`, where they run beside this
/// binary's fault sweeps, whose runs across ranks are timed, on a machine of two cores), 1,024 in a
/// release build.
const PROPTEST_CASES: u32 = if cfg!(debug_assertions) { 256 } else { 1024 };

const OUT_OF_MEMORY: i32 = 2;
/// `ncclInternalError`.
const NCCL_INTERNAL_ERROR: i32 = 3;

mod bounded;
mod cudarc_attacks;
mod cudarc_double;
mod foreign;
mod graphs_mode;
mod ipc;
mod ipc_announcements;
mod ipc_boundary;
mod ipc_gated;
mod ipc_host_flags;
mod ipc_memops;
mod process_transport;
mod protocol;
mod readback;
mod ring;
mod rule;
mod scenarios;
mod sweep_graph;
mod sweep_lifetime;
mod sweep_ranks;
mod sweep_step;
mod teardown_ranks;

use scenarios::*;
use sweep_ranks::*;
use sweep_step::*;
