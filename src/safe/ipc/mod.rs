//! Device memory and events shared with another process of the same host (CUDA IPC): what one
//! process exports and another imports, who owns each, and until when.
//!
//! # What lives here
//! - [`ExportedMemory`] (`memory.rs`): device memory this process allocates with `cuMemCreate`
//!   (its size rounded up to the allocation granularity), maps and may access in its own
//!   context, and exports as a POSIX file descriptor (an [`OwnedFd`](std::os::fd::OwnedFd) the
//!   caller passes to the other process over a Unix socket, `SCM_RIGHTS`).
//! - [`ImportedMemory`] (`memory.rs`): the same memory mapped into another process from that
//!   descriptor (`cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`,
//!   `cuMemSetAccess` for the importer's device).
//! - [`LegacyIpcHandle`] and [`LegacyImport`] (`legacy.rs`): the older 64-byte handle of a
//!   `cuMemAlloc` allocation ([`CudaSlice::alloc_persistent`](crate::CudaSlice::alloc_persistent)),
//!   for devices without POSIX-descriptor export ([`IpcSupport::fd_export`]).
//! - [`IpcEvent`] (`event.rs`): an interprocess event (`CU_EVENT_INTERPROCESS |
//!   CU_EVENT_DISABLE_TIMING`), its 64-byte [`IpcEventHandle`], and the event opened from it.
//! - [`IpcSupport`] (here): what a device supports of the above.
//!
//! # Ordering inside a process
//! Both sides' memory is the crate's device memory: each is a [`CudaSlice`](crate::CudaSlice)
//! built on a mapping (`CudaSlice::from_mapping`), so every copy, memset, launch and graph launch
//! orders it through the one door like any slice (a read waits for the last write, a write for
//! the last write and the reads since), and its release waits on the host for every use of it in
//! this process before it unmaps — as a `cuMemAlloc` allocation's free does. Kernels of other
//! devices of the process do not reach it (access is set for the mapping's own device only).
//!
//! # Ordering between processes
//! Nothing orders one process's work on the memory with the other's but the caller, through
//! interprocess events: the writer records an [`IpcEvent`] after its write, the reader's stream
//! waits on it before reading (and the other way round before the writer writes again). A wait
//! binds to the event's most recent record *at the time the wait is enqueued*: a wait enqueued
//! before the other process's record waits for the record before it (or for nothing, if none).
//! So a process enqueues a wait only once it knows the matching record was enqueued: the
//! boundary transport keeps a step counter per slot in shared host memory, written by the
//! recording process after each record and read before each wait. A query or synchronisation of
//! an event likewise sees only records made before it.
//!
//! # Who owns what, and when either side dies
//! - The exporting process owns the allocation: [`ExportedMemory`]'s drop waits for its own uses,
//!   unmaps, frees its address range and calls `cuMemRelease`, which only drops the exporter's
//!   reference. The driver frees the physical memory "when all outstanding mappings to the memory
//!   are unmapped and when all outstanding references to the handle (including its shareable
//!   counterparts) are also released" (CUDA Driver API, Virtual Memory Management, `cuMemRelease`;
//!   `cuMemUnmap`: "any backing memory allocations will be freed if there are no existing mappings
//!   and there are no unreleased memory handles"). So an importer's mapping keeps the memory
//!   alive: an exporter that drops its export or dies leaves the importer's mapping valid (its
//!   bytes are those last written), and the importer's own drop (unmap) frees the memory last. An
//!   importer releases its imported handle as soon as it has mapped it: the mapping holds it.
//! - An exported file descriptor is a reference too while it is open: whoever holds it (the
//!   caller, the socket in flight) should close it once imported or refused.
//! - The legacy path is different: the exporter's `cuMemFree` before the importer's
//!   `cuIpcCloseMemHandle` is undefined behaviour (CUDA Driver API, `cuIpcOpenMemHandle`:
//!   "Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in the
//!   importing context will result in undefined behavior"). A [`LegacyImport`] does not keep the
//!   memory alive: the exporter must keep its slice until every importer has closed (and a dead
//!   exporter's memory goes with its context). Use it only where descriptors are unsupported.
//! - An interprocess event is like the legacy memory: any operation on an opened event after the
//!   exporter destroyed its event is undefined behaviour (CUDA Driver API,
//!   `cuIpcOpenEventHandle`: "Performing operations on the imported event after the exported
//!   event has been freed with cuEventDestroy will result in undefined behavior"), and an
//!   exporter that exits destroys it. So [`IpcEvent::open`] and [`LegacyImport::open`] are
//!   `unsafe`: their callers promise the exporter outlives the import, which no process can check
//!   of another. Only [`ImportedMemory`] stays sound when its exporter dies; ordering across
//!   processes that must survive a dying peer goes through memory such an import maps (stream
//!   memory operations on it: [`CudaStream::wait_value_u64`](crate::CudaStream::wait_value_u64),
//!   released by this process's own [`write_value_u64`](crate::CudaStream::write_value_u64) when
//!   the writer died), not through interprocess events.
//!
//! # What each handle exposes on a shared host
//! - A POSIX file descriptor reaches only processes it is passed to (over a Unix socket whose
//!   peer's user the receiver can check with `SO_PEERCRED`): nothing else can open the memory.
//! - A legacy 64-byte memory handle is a capability by value: any process on the host, of any
//!   user, that learns the 64 bytes may open the memory with `cuIpcOpenMemHandle` and read or
//!   write it. So is an [`IpcEventHandle`] for the event. Send them only over a channel the peer
//!   was authenticated on, and prefer descriptors.

mod event;
mod flagged;
mod host_words;
mod legacy;
mod memory;

pub use event::{IpcEvent, IpcEventHandle};
pub(crate) use flagged::{FlagSteps, Releasable};
pub(crate) use host_words::{PrivateWords, register_control_block, register_private_words};
pub use legacy::{LegacyImport, LegacyIpcHandle};
pub use memory::{ExportedMemory, ImportedMemory};

use super::device::Device;
use crate::cuda_error::Result;
use crate::sys::CUdevice_attribute;

/// What a device supports of the interprocess calls.
///
/// ```no_run
/// use ppnrt::{Engine, IpcSupport};
///
/// # fn run() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let support = IpcSupport::of(engine.device())?;
/// if !support.fd_export() {
///     println!("descriptors unsupported: legacy handles only");
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcSupport {
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`: `cuMemCreate` and `cuMemMap`.
    pub virtual_memory: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`: export as a descriptor.
    pub posix_fd: bool,
    /// `CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`: interprocess events.
    pub events: bool,
}

impl IpcSupport {
    /// Queries `device`.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetAttribute")]
    pub fn of(device: &Device) -> Result<IpcSupport> {
        let attr = |a| device.attribute(a).map(|v| v != 0);
        Ok(IpcSupport {
            virtual_memory: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
            posix_fd: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
            events: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)?,
        })
    }

    /// Whether memory can be exported and imported as a POSIX file descriptor
    /// ([`ExportedMemory`], [`ImportedMemory`]); where not, the legacy handles serve.
    pub fn fd_export(&self) -> bool {
        self.virtual_memory && self.posix_fd
    }
}
