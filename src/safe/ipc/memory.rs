//! [`ExportedMemory`] (allocated with `cuMemCreate`, exported as a POSIX file descriptor) and
//! [`ImportedMemory`] (that descriptor mapped in another process): each a
//! [`CudaSlice`] on a mapping, ordered and released like any slice (see the module doc above).

use std::ops::Deref;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use super::IpcSupport;
use crate::cuda_error::{CudaError, IpcError, Result};
use crate::result::ipc as raw;
use crate::safe::element::DeviceRepr;
use crate::safe::memory::{CudaSlice, CudaViewMut, ReleaseMapping, byte_size};
use crate::safe::stream::CudaStream;
use crate::sys::{CUdeviceptr, CUmemGenericAllocationHandle, CUresult};

/// A mapping of `bytes` at its address, and (for an export) the allocation's handle: released
/// in reverse order of its making.
#[derive(Debug)]
struct VmmMapping {
    bytes: usize,
    handle: Option<CUmemGenericAllocationHandle>,
}

impl ReleaseMapping for VmmMapping {
    unsafe fn release(&mut self, ptr: CUdeviceptr) -> Result<()> {
        // SAFETY: `ptr`/`bytes` is the whole mapping and reservation made by `map_new`, with no
        // use pending (the caller's contract); each is undone once.
        unsafe { undo(ptr, self.bytes, true, self.handle.take()) }
    }
}

/// Unmaps (when `mapped`), frees the reservation and releases `handle`, in that order; the first
/// error is returned after every step was tried.
///
/// # Safety
/// - `ptr`/`bytes` is a whole reservation of `raw::address_reserve` (mapped by `raw::map` when
///   `mapped`) with no use pending; `handle` is live and released once.
unsafe fn undo(
    ptr: CUdeviceptr,
    bytes: usize,
    mapped: bool,
    handle: Option<CUmemGenericAllocationHandle>,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let unmapped = if mapped { unsafe { raw::unmap(ptr, bytes) } } else { Ok(()) };
    // SAFETY: the caller's contract; nothing stays mapped in the range once the unmap succeeded
    // (a failed unmap leaves the range reserved rather than free a mapped range).
    let freed = if unmapped.is_ok() { unsafe { raw::address_free(ptr, bytes) } } else { Ok(()) };
    // SAFETY: the caller's contract.
    let released = handle.map_or(Ok(()), |handle| unsafe { raw::release(handle) });
    unmapped.and(freed).and(released)
}

/// Reserves `bytes` of address space, maps `handle` there and gives `stream`'s device read and
/// write access; on failure undoes what it did (the handle stays the caller's).
fn map_new(stream: &CudaStream, bytes: usize, handle: CUmemGenericAllocationHandle) -> Result<CUdeviceptr> {
    let ptr = raw::address_reserve(bytes, 0)?;
    // SAFETY: the range is a fresh reservation of `bytes`; the handle is live.
    if let Err(e) = unsafe { raw::map(ptr, bytes, handle) } {
        // SAFETY: the reservation is whole and unmapped.
        let _ = unsafe { undo(ptr, bytes, false, None) };
        return Err(e);
    }
    // SAFETY: the range is mapped just above.
    if let Err(e) = unsafe { raw::set_access_read_write(ptr, bytes, stream.context().device().raw()) } {
        // SAFETY: mapped above, never used.
        let _ = unsafe { undo(ptr, bytes, true, None) };
        return Err(e);
    }
    Ok(ptr)
}

/// Checks that `stream`'s device can export or import as a descriptor, and returns the byte size
/// of `len` elements of `T` and that size rounded up to the device's granularity.
fn sizes<T: DeviceRepr>(what: &'static str, stream: &CudaStream, len: usize) -> Result<(usize, usize)> {
    let bytes = byte_size::<T>(what, len)?;
    if bytes == 0 {
        return Err(IpcError::ZeroSize { what, len, elem_size: std::mem::size_of::<T>() }.into());
    }
    let device = stream.context().device();
    let support = IpcSupport::of(device)?;
    let missing = if !support.virtual_memory {
        Some("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
    } else if !support.posix_fd {
        Some("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
    } else {
        None
    };
    if let Some(missing) = missing {
        return Err(IpcError::Unsupported { what, device: device.ordinal(), missing }.into());
    }
    let granularity = raw::granularity(&raw::exportable_prop(device.raw()))?.max(1);
    let mapped = bytes.div_ceil(granularity).checked_mul(granularity);
    let mapped = mapped.ok_or(CudaError::SizeOverflow { what, count: len, elem_size: std::mem::size_of::<T>() })?;
    Ok((bytes, mapped))
}

/// Device memory of this process that another process may map: `len` elements of `T` allocated
/// with `cuMemCreate` on the owner stream's device, exportable as a POSIX file descriptor
/// ([`export_fd`](Self::export_fd)). This process owns the allocation; dropping it drops this
/// process's mapping and reference only — importers' mappings keep the memory (module doc).
///
/// Reads go through [`Deref`] to the [`CudaSlice`]; writes through [`as_view_mut`](Self::as_view_mut).
/// Every use is ordered like any slice's.
///
/// ```no_run
/// use ppnrt::{Engine, ExportedMemory};
///
/// # fn run() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let stream = engine.stream()?;
/// let slots = ExportedMemory::<u32>::alloc(&stream, 1 << 16)?;
/// let fd = slots.export_fd()?; // pass it over a local channel; close it once sent
/// println!("{} bytes mapped, exported as descriptor {fd:?}", slots.mapped_bytes());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ExportedMemory<T: DeviceRepr> {
    slice: CudaSlice<T>,
    handle: CUmemGenericAllocationHandle,
    mapped: usize,
}

// Both sides may be used from any thread, as their slice (the handle is a plain integer).
static_assertions::assert_impl_all!(ExportedMemory<u32>: Send, Sync);
static_assertions::assert_impl_all!(ImportedMemory<u32>: Send, Sync);

impl<T: DeviceRepr> ExportedMemory<T> {
    /// Allocates `len` elements on `stream`'s device (the size rounded up to the allocation
    /// granularity: [`mapped_bytes`](Self::mapped_bytes)), mapped readable and writable there;
    /// `stream` owns it. The contents are unspecified (any bit pattern, valid for `T`).
    ///
    /// # Errors
    /// [`IpcError::ZeroSize`] for no bytes; [`IpcError::Unsupported`] on a device without
    /// virtual memory management or POSIX-descriptor export; [`CudaError::SizeOverflow`];
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing stream;
    /// the driver's error.
    #[doc(alias = "cuMemCreate")]
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<ExportedMemory<T>> {
        Self::alloc_with(stream, len, false)
    }

    /// [`alloc`](Self::alloc), for memory whose every use records its completion event at once
    /// (a boundary's slots, as `CudaSlice::alloc_persistent_eager`).
    pub(crate) fn alloc_with(stream: &Arc<CudaStream>, len: usize, eager: bool) -> Result<ExportedMemory<T>> {
        const WHAT: &str = "ExportedMemory::alloc";
        let (_, mapped) = sizes::<T>(WHAT, stream, len)?;
        stream.refuse_in_capture("ExportedMemory::alloc (cuMemCreate)")?;
        let _bound = stream.context().bind()?;
        let handle = raw::create(mapped, &raw::exportable_prop(stream.context().device().raw()))?;
        let ptr = match map_new(stream, mapped, handle) {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: the handle was created just above and nothing maps it.
                let _ = unsafe { raw::release(handle) };
                return Err(e);
            }
        };
        let mapping = Box::new(VmmMapping { bytes: mapped, handle: Some(handle) });
        // SAFETY: `ptr` is mapped readable and writable for the stream's device for `mapped >=
        // len * size_of::<T>()` bytes until the mapping's release, which only the slice's drop
        // calls; the range is fresh, so no other slice covers it.
        let slice = unsafe { CudaSlice::from_mapping(ptr, len, stream, mapping, eager) };
        Ok(ExportedMemory { slice, handle, mapped })
    }

    /// The elements an allocation of at least `len` elements on `stream`'s device holds: `len`
    /// rounded up to the allocation granularity (what [`alloc`](Self::alloc) maps anyway).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), before anything is allocated.
    pub(crate) fn rounded_len(stream: &CudaStream, len: usize) -> Result<usize> {
        let (_, mapped) = sizes::<T>("ExportedMemory::alloc", stream, len)?;
        Ok(mapped / std::mem::size_of::<T>().max(1))
    }

    /// A new POSIX file descriptor for the allocation (each call makes another), owned by the
    /// caller: pass it to the importing process (`SCM_RIGHTS`) and close it. While open it is a
    /// reference to the memory. It is close-on-exec: a program this process starts never
    /// inherits it (whatever the driver handed out).
    ///
    /// # Errors
    /// The driver's error (`CUDA_ERROR_NOT_SUPPORTED` where the platform cannot export);
    /// [`IpcError::NotShareable`] for a descriptor that cannot be made close-on-exec.
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let _bound = self.slice.memory().owner().context().bind()?;
        // SAFETY: the handle lives as long as the slice, which `self` holds; it was created with
        // the POSIX-descriptor handle type.
        let fd = unsafe { raw::export_fd(self.handle)? };
        // SAFETY: the driver returned a new open descriptor that this process owns and nothing
        // else closes.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // A capability reaches another process only when passed, never across an `exec`.
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC).map_err(|_| IpcError::NotShareable {
            what: "ExportedMemory::export_fd",
            reason: "the driver's descriptor cannot be made close-on-exec",
        })?;
        Ok(fd)
    }

    /// A mutable view of the whole memory (a copy's or kernel's destination).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// The bytes mapped: the element bytes rounded up to the allocation granularity. An importer
    /// maps no more than this.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// The slice alone, once every descriptor the owner needs was exported: the memory lives
    /// as long as the slice (its mapping holds the allocation), and no further descriptor can be
    /// made of it.
    pub(crate) fn into_slice(self) -> CudaSlice<T> {
        self.slice
    }
}

impl<T: DeviceRepr> Deref for ExportedMemory<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

/// Another process's [`ExportedMemory`], mapped into this one from its file descriptor: `len`
/// elements of `T` on the importing stream's device, which owns the mapping. The descriptor says
/// nothing about the element type or count: the caller checks them against what the exporter
/// announced. Dropping it unmaps, after every use of it in this process; the memory itself goes
/// when the last mapping and reference anywhere go (module doc).
///
/// Reads go through [`Deref`] to the [`CudaSlice`]; writes through [`as_view_mut`](Self::as_view_mut).
///
/// ```no_run
/// use std::os::fd::OwnedFd;
/// use ppnrt::{Engine, ImportedMemory};
///
/// # fn run(from_the_exporter: OwnedFd) -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let stream = engine.stream()?;
/// let mut slots = ImportedMemory::<u32>::import(&stream, from_the_exporter, 1 << 16)?;
/// let data = engine.htod(&vec![7u32; 1 << 16])?;
/// stream.memcpy_dtod(&data, &mut slots.as_view_mut())?; // ordered like any copy
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ImportedMemory<T: DeviceRepr> {
    slice: CudaSlice<T>,
    mapped: usize,
}

impl<T: DeviceRepr> ImportedMemory<T> {
    /// Maps the allocation behind `fd` (closed when this returns) as `len` elements of `T`,
    /// readable and writable for `stream`'s device, owned by `stream`.
    ///
    /// # Errors
    /// [`IpcError::ZeroSize`] for no bytes; [`IpcError::Unsupported`] on a device without
    /// virtual memory management or POSIX descriptors; [`IpcError::NotAnExport`] for a
    /// descriptor the driver cannot import; [`IpcError::SizeMismatch`] when the allocation is
    /// smaller than `len` elements (rounded to the granularity); the driver's error.
    #[doc(alias = "cuMemImportFromShareableHandle")]
    #[doc(alias = "cuMemMap")]
    pub fn import(stream: &Arc<CudaStream>, fd: OwnedFd, len: usize) -> Result<ImportedMemory<T>> {
        Self::import_with(stream, fd, len, false)
    }

    /// [`import`](Self::import), for memory whose every use records its completion event at once.
    pub(crate) fn import_with(
        stream: &Arc<CudaStream>,
        fd: OwnedFd,
        len: usize,
        eager: bool,
    ) -> Result<ImportedMemory<T>> {
        const WHAT: &str = "ImportedMemory::import";
        let (bytes, mapped) = sizes::<T>(WHAT, stream, len)?;
        stream.refuse_in_capture("ImportedMemory::import (cuMemMap)")?;
        let _bound = stream.context().bind()?;
        let named = Some(fd.as_raw_fd());
        let handle = raw::import_fd(fd.as_raw_fd()).map_err(|e| match e {
            CudaError::Driver(source) => {
                IpcError::NotAnExport { what: WHAT, fd: named, source: Box::new(source) }.into()
            }
            other => other,
        })?;
        let too_small = |e: CudaError| match e {
            CudaError::Driver(d) if d.code == CUresult::CUDA_ERROR_INVALID_VALUE => {
                IpcError::SizeMismatch { what: WHAT, fd: named, bytes, mapped, exported: None }.into()
            }
            other => other,
        };
        let mapping = map_new(stream, mapped, handle);
        // The mapping holds the memory: this process's imported reference goes now.
        // SAFETY: the handle was imported just above and is released once.
        let released = unsafe { raw::release(handle) };
        let ptr = mapping.map_err(too_small)?;
        if let Err(e) = released {
            // SAFETY: mapped just above, never used.
            let _ = unsafe { undo(ptr, mapped, true, None) };
            return Err(e);
        }
        drop(fd);
        let release = Box::new(VmmMapping { bytes: mapped, handle: None });
        // SAFETY: `ptr` is mapped readable and writable for the stream's device for `mapped >=
        // bytes` bytes until the release, which only the slice's drop calls; the reservation is
        // this import's own, so no other slice of this process covers it.
        let slice = unsafe { CudaSlice::from_mapping(ptr, len, stream, release, eager) };
        Ok(ImportedMemory { slice, mapped })
    }

    /// A mutable view of the whole memory (a copy's or kernel's destination).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// The bytes mapped (the element bytes rounded up to the allocation granularity).
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// The slice alone: the mapping lives as long as the slice.
    pub(crate) fn into_slice(self) -> CudaSlice<T> {
        self.slice
    }
}

impl<T: DeviceRepr> Deref for ImportedMemory<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}
