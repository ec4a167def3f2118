//! Safe, owning wrappers over the driver.
//!
//! Lifetime model: every handle owns what it created and holds an `Arc` to what it depends on
//! (a stream keeps its context alive, a slice its owning stream), so drop order cannot free a
//! context under live work. Threading: handles are `Send + Sync` where the driver makes the
//! underlying object usable from any thread; each call binds the context it needs on the calling
//! thread first and never relies on what another call left current. Drops never panic; failures
//! in `Drop` are kept for [`take_drop_errors`].
//!
//! Ordering: every copy, memset and kernel launch orders the device and pinned buffers it touches
//! itself — a read waits for the buffer's last write, a write for the last write and the reads
//! since, a free for every use — through events from a per-context pool, recorded and waited on
//! only when work crosses streams (the `ordering` module). So a buffer produced on one stream
//! can be consumed, overwritten or dropped on any other with no join in user code. Kernel
//! parameters that are slices and views are ordered the same way; only the kernel's indexing
//! stays the caller's `unsafe` promise.

mod ambient;
mod capture;
mod context;
mod copy;
mod device;
mod drop_errors;
mod element;
pub(crate) mod enqueue;
mod event;
pub(crate) mod event_pool;
mod graph;
mod helpers;
mod host;
mod ipc;
mod launch;
pub(crate) mod memory;
mod module;
pub(crate) mod ordering;
mod peer;
mod reaper;
mod stream;
mod stream_memops;

pub(crate) use ambient::with_ambient_stream;
pub use ambient::{StreamOverride, ambient_stream};
pub use capture::CaptureMode;
pub use context::{BoundContext, Context};
pub use device::{Device, PeerInfo};
pub(crate) use drop_errors::record_drop_error;
pub use drop_errors::{DropError, take_drop_errors};
pub use element::DeviceRepr;
pub use event::CudaEvent;
pub(crate) use graph::KeptMemory;
pub use graph::{CudaGraph, GraphExec, StreamCapture};
#[cfg(feature = "testing")]
pub use helpers::TestKernels;
pub use helpers::{HelperKernels, ToyModel};
pub use host::PinnedHostBuffer;
pub use ipc::{ExportedMemory, ImportedMemory, IpcEvent, IpcEventHandle, IpcSupport, LegacyImport, LegacyIpcHandle};
pub(crate) use ipc::{FlagSteps, PrivateWords, Releasable, register_control_block, register_private_words};
pub use launch::{
    BufferUse, BufferUses, ByValue, KernelArgList, KernelArgs, KernelParam, LaunchConfig, MAX_KERNEL_PARAMS, by_value,
};
pub use memory::{CudaSlice, CudaView, CudaViewMut, DeviceSlice, DeviceSliceMut};
pub use module::{Function, Module};
pub use peer::enable_peer_access;
pub use stream::CudaStream;
pub(crate) use stream::EnqueueGate;
pub use stream_memops::{MemOpsSupport, WaitCondition};
