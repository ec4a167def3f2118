//! The legacy interprocess memory handle (`cuIpcGetMemHandle`, 64 bytes) of a `cuMemAlloc`
//! allocation, and the memory opened from it in another process ([`LegacyImport`]). For devices
//! that cannot export POSIX descriptors only: the handle is a capability by value, and the
//! import does not keep the memory alive (the module doc above says what each exposes and who
//! must outlive whom).

use std::collections::HashSet;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

use crate::cuda_error::{CudaError, IpcError, Result};
use crate::result::ipc as raw;
use crate::safe::element::DeviceRepr;
use crate::safe::memory::{CudaSlice, CudaViewMut, DeviceSlice, ReleaseMapping, byte_size};
use crate::safe::stream::CudaStream;
use crate::sys::{CUcontext, CUdeviceptr, CUipcMemHandle};

/// A legacy 64-byte interprocess memory handle. Anyone on the host who learns these bytes may
/// open the memory (module doc).
///
/// ```no_run
/// use ppnrt::{Engine, LegacyIpcHandle};
///
/// # fn run() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let plain = engine.alloc_persistent::<u32>(1024)?; // `cuMemAlloc` memory
/// let handle = LegacyIpcHandle::of(&plain)?; // keep `plain` until every importer closed it
/// assert_eq!(format!("{handle:?}"), "LegacyIpcHandle(..)");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LegacyIpcHandle(pub [u8; 64]);

impl std::fmt::Debug for LegacyIpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A capability: its bytes are not printed.
        f.write_str("LegacyIpcHandle(..)")
    }
}

impl LegacyIpcHandle {
    /// The handle of `slice`'s allocation, which must be a `cuMemAlloc` allocation of its own
    /// ([`CudaSlice::alloc_persistent`]). The slice must outlive every importer's use: keep it
    /// until every importer has dropped its [`LegacyImport`].
    ///
    /// # Errors
    /// [`IpcError::ZeroSize`] for an empty slice; [`IpcError::NotShareable`] for pool memory,
    /// another library's memory or a mapping; the driver's error.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn of<T: DeviceRepr>(slice: &CudaSlice<T>) -> Result<LegacyIpcHandle> {
        const WHAT: &str = "LegacyIpcHandle::of";
        if slice.is_empty() {
            return Err(IpcError::ZeroSize { what: WHAT, len: 0, elem_size: std::mem::size_of::<T>() }.into());
        }
        if slice.is_pooled() {
            return Err(IpcError::NotShareable {
                what: WHAT,
                reason: "only a cuMemAlloc allocation (CudaSlice::alloc_persistent) has a legacy handle",
            }
            .into());
        }
        let _bound = slice.memory().owner().context().bind()?;
        // SAFETY: a slice that is not pooled is a live cuMemAlloc allocation of its own (pool,
        // foreign and mapped memory count as pooled), and its address is the allocation's base.
        let handle = unsafe { raw::get_mem_handle(slice.device_ptr())? };
        Ok(LegacyIpcHandle(handle.reserved.map(|c| c as u8)))
    }

    fn raw(&self) -> CUipcMemHandle {
        CUipcMemHandle { reserved: self.0.map(|b| b as std::os::raw::c_char) }
    }
}

/// Addresses opened from legacy handles in this process, per context: the driver hands out the
/// same address for a handle opened twice, and two slices must not cover one allocation.
static OPENED: Mutex<Option<HashSet<(usize, CUdeviceptr)>>> = Mutex::new(None);

fn opened() -> std::sync::MutexGuard<'static, Option<HashSet<(usize, CUdeviceptr)>>> {
    OPENED.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
struct LegacyMapping {
    ctx: usize,
}

impl ReleaseMapping for LegacyMapping {
    unsafe fn release(&mut self, ptr: CUdeviceptr) -> Result<()> {
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context, is closed once, and no use
        // is pending (the caller's contract).
        let closed = unsafe { raw::close_mem_handle(ptr) };
        if closed.is_ok() {
            opened().get_or_insert_with(HashSet::new).remove(&(self.ctx, ptr));
        }
        closed
    }
}

static_assertions::assert_impl_all!(LegacyImport<u32>: Send, Sync);

/// Memory of another process opened from its [`LegacyIpcHandle`]: `len` elements of `T`,
/// owned by the importing stream, ordered like any slice, closed (`cuIpcCloseMemHandle`) after
/// every use when dropped. It does not keep the memory alive: the exporter must keep it until
/// this drops.
///
/// Reads go through [`Deref`] to the [`CudaSlice`]; writes through [`as_view_mut`](Self::as_view_mut).
///
/// ```no_run
/// use ppnrt::{Engine, LegacyImport, LegacyIpcHandle};
///
/// # fn run(from_the_exporter: LegacyIpcHandle) -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let stream = engine.stream()?;
/// // SAFETY: the exporter keeps the allocation until this process reports it closed.
/// let imported = unsafe { LegacyImport::<u32>::open(&stream, &from_the_exporter, 1024)? };
/// let values = engine.dtoh(&*imported)?;
/// println!("{} values", values.len());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct LegacyImport<T: DeviceRepr> {
    slice: CudaSlice<T>,
}

impl<T: DeviceRepr> LegacyImport<T> {
    /// Opens `handle` in `stream`'s context as `len` elements of `T` (the exporter's allocation,
    /// as the driver reports its range, must hold at least that many bytes; the element type and
    /// count are the caller's to check against what the exporter announced).
    ///
    /// # Errors
    /// [`IpcError::ZeroSize`]; [`IpcError::NotAnExport`] for a handle the driver cannot open (of
    /// this process, of freed memory, or garbage); [`IpcError::SizeMismatch`] when the
    /// allocation is smaller; [`IpcError::NotShareable`] for a handle already open in this
    /// context; the driver's error.
    ///
    /// # Safety
    /// The exporting process must keep the allocation (not free it, and not exit) until this
    /// import is dropped: the exporter's `cuMemFree` before the importer's `cuIpcCloseMemHandle`
    /// is undefined behaviour (CUDA Driver API, `cuIpcOpenMemHandle`), and nothing in this process
    /// can check it. [`ImportedMemory`](super::ImportedMemory) has no such condition: its mapping
    /// keeps the memory alive.
    #[doc(alias = "cuIpcOpenMemHandle")]
    pub unsafe fn open(stream: &Arc<CudaStream>, handle: &LegacyIpcHandle, len: usize) -> Result<LegacyImport<T>> {
        const WHAT: &str = "LegacyImport::open";
        let bytes = byte_size::<T>(WHAT, len)?;
        if bytes == 0 {
            return Err(IpcError::ZeroSize { what: WHAT, len, elem_size: std::mem::size_of::<T>() }.into());
        }
        stream.refuse_in_capture("LegacyImport::open (cuIpcOpenMemHandle)")?;
        let _bound = stream.context().bind()?;
        let ptr = raw::open_mem_handle(handle.raw()).map_err(|e| match e {
            CudaError::Driver(source) => {
                IpcError::NotAnExport { what: WHAT, fd: None, source: Box::new(source) }.into()
            }
            other => other,
        })?;
        let ctx = stream.context().raw() as CUcontext as usize;
        let close = |e: CudaError| {
            // SAFETY: opened just above, never used.
            let _ = unsafe { raw::close_mem_handle(ptr) };
            Err(e)
        };
        let fresh = opened().get_or_insert_with(HashSet::new).insert((ctx, ptr));
        if !fresh {
            // The driver counted a second reference to the first opening: drop it again.
            // SAFETY: one reference of the two is this call's.
            let _ = unsafe { raw::close_mem_handle(ptr) };
            let reason = "the handle is already open in this context (one LegacyImport per handle and context)";
            return Err(IpcError::NotShareable { what: WHAT, reason }.into());
        }
        let range = raw::address_range(ptr);
        let exported = match range {
            Ok((_, size)) => size,
            Err(e) => {
                opened().get_or_insert_with(HashSet::new).remove(&(ctx, ptr));
                return close(e);
            }
        };
        if exported < bytes {
            opened().get_or_insert_with(HashSet::new).remove(&(ctx, ptr));
            let mismatch =
                IpcError::SizeMismatch { what: WHAT, fd: None, bytes, mapped: bytes, exported: Some(exported) };
            return close(mismatch.into());
        }
        // SAFETY: `ptr` is the base of `bytes` of device memory open in this context until the
        // mapping's release (only the slice's drop); `OPENED` shows no other slice covers it.
        let slice = unsafe { CudaSlice::from_mapping(ptr, len, stream, Box::new(LegacyMapping { ctx }), false) };
        Ok(LegacyImport { slice })
    }

    /// A mutable view of the whole memory (a copy's or kernel's destination).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }
}

impl<T: DeviceRepr> Deref for LegacyImport<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}
