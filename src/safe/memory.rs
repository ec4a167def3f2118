//! Device memory: owning slices, views, and the allocation they share.
//!
//! A [`CudaSlice`] is owned by one stream, its *owner*: stream-ordered slices come from the
//! device's memory pool and are freed on that stream; persistent slices are plain `cuMemAlloc`
//! allocations (reachable by peers through peer access, unlike pool memory), freed once every use
//! completed. Every copy, memset and kernel launch on any stream orders the slices it touches
//! through the crate's one ordering rule (see `ordering`, reached through the door every enqueue
//! passes, `enqueue`): a read waits for the last write, a write for the last write and the reads
//! since, and the free waits for every use. So a buffer produced on one stream can be consumed,
//! overwritten or dropped from any other without a join in user code, and a copy's source cannot
//! be freed or overwritten while the copy is in flight. The copies and memsets themselves are
//! `copy`'s; a free that a capture forbids now is held back (`capture`).
//!
//! Views ([`CudaView`], [`CudaViewMut`]) borrow their slice and share its ordering state.
//! Threading: slices are `Send + Sync`; reads from several threads at once are fine, a write
//! needs `&mut`.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use super::capture::free_blocked;
use super::element::DeviceRepr;
use super::ordering::{Access, Use};
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw;
use crate::sys::CUdeviceptr;

mod alloc;
mod mapping;
pub(crate) use mapping::ReleaseMapping;
mod retire;
pub(crate) use retire::Retired;

mod sealed {
    pub trait Sealed {}
}

/// Device memory usable as the source of a copy or kernel. Sealed: implemented by
/// [`CudaSlice`], [`CudaView`] and [`CudaViewMut`].
///
/// ```no_run
/// use ppnrt::{CudaResult, DeviceRepr, DeviceSlice, Engine};
/// /// The first `k` elements of any device array: a slice or a view of one.
/// fn head<T: DeviceRepr + Default>(engine: &Engine, x: &impl DeviceSlice<T>, k: usize) -> CudaResult<Vec<T>> {
///     engine.dtoh(&x.as_view().slice(..k.min(x.len()))?)
/// }
/// # fn main() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let x = engine.htod(&[1u32, 2, 3, 4])?;
/// assert_eq!(head(&engine, &x, 2)?, [1, 2]);
/// assert_eq!(head(&engine, &x.slice(2..)?, 8)?, [3, 4]);
/// # Ok(()) }
/// ```
pub trait DeviceSlice<T: DeviceRepr>: sealed::Sealed {
    /// The device address of the first element.
    fn device_ptr(&self) -> CUdeviceptr;
    /// Number of elements.
    fn len(&self) -> usize;
    /// The stream that owns the memory.
    fn stream(&self) -> &Arc<CudaStream>;
    /// Whether the memory came from a stream-ordered pool (not reachable by peers' kernels).
    fn is_pooled(&self) -> bool;
    /// A view of the whole range.
    fn as_view(&self) -> CudaView<'_, T>;
    /// Whether the slice has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device ordinal of the memory.
    fn ordinal(&self) -> i32 {
        self.stream().ordinal()
    }
    /// Size in bytes.
    fn byte_len(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
    /// Whether the first element's address is a multiple of `align` bytes.
    fn is_aligned_to(&self, align: usize) -> bool {
        align != 0 && self.device_ptr() % align as CUdeviceptr == 0
    }
}

/// Device memory usable as the destination of a copy or kernel.
///
/// ```no_run
/// use std::sync::Arc;
/// use ppnrt::{CudaResult, CudaStream, DeviceRepr, DeviceSliceMut};
/// /// Zeroes `x` from element `from` on: a slice or a mutable view of one.
/// fn zero_tail<T: DeviceRepr>(stream: &Arc<CudaStream>, x: &mut impl DeviceSliceMut<T>, from: usize) -> CudaResult<()> {
///     let n = x.len();
///     stream.memset_bytes(&mut x.as_view_mut().slice_mut(from..n)?, 0)
/// }
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let mut x = engine.htod(&[1u32, 2, 3, 4])?;
/// zero_tail(&engine.stream()?, &mut x, 2)?;
/// assert_eq!(engine.dtoh(&x)?, [1, 2, 0, 0]);
/// # Ok(()) }
/// ```
pub trait DeviceSliceMut<T: DeviceRepr>: DeviceSlice<T> {
    /// A mutable view of the whole range.
    fn as_view_mut(&mut self) -> CudaViewMut<'_, T>;
}

/// An owned array of `T` in device memory.
///
/// ```no_run
/// use ppnrt::CudaSlice;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let mut x: CudaSlice<f32> = engine.alloc_zeroed(1024)?;
/// engine.htod_into(&[1.0; 512], &mut x.slice_mut(..512)?)?; // the first half
/// let tail = x.slice(512..)?; // a view, no copy
/// assert_eq!(engine.dtoh(&tail)?, vec![0.0; 512]);
/// # Ok(()) } // dropped: freed after its last use, in stream order
/// ```
#[derive(Debug)]
pub struct CudaSlice<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    mem: Arc<DeviceMemory>,
    _marker: PhantomData<T>,
}

/// One device allocation: its address, owning stream and ordering state. Shared by its
/// [`CudaSlice`] and by the graphs that captured work on it (which keep it alive while they can
/// run); freed when the last holder goes, after every use.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    ptr: CUdeviceptr,
    stream: Arc<CudaStream>,
    pooled: bool,
    /// Memory another library owns ([`CudaSlice::from_foreign`]): never freed here; its drop
    /// makes the owner stream wait for every use instead.
    foreign: bool,
    /// Memory lent for a scope only (the cudarc interop's lends): no capture may take it, since a
    /// graph would keep it past the lend.
    lent: bool,
    /// Memory mapped from an export (`ipc`): released by this, not freed, after every use.
    mapping: Option<Box<dyn ReleaseMapping>>,
    access: Access,
}

impl DeviceMemory {
    /// The allocation's ordering state.
    pub(crate) fn access(&self) -> &Access {
        &self.access
    }

    /// Whether the memory is lent for a scope only (no capture may take it).
    #[inline]
    pub(crate) fn lent(&self) -> bool {
        self.lent
    }

    /// The stream that owns the allocation.
    pub(crate) fn owner(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether the allocation is stream-ordered pool memory.
    pub(crate) fn is_pooled(&self) -> bool {
        self.pooled
    }
}

/// A borrowed range of a device array.
///
/// ```no_run
/// use ppnrt::{CudaView, DeviceSlice};
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let x = engine.htod(&[1u32, 2, 3, 4])?;
/// let middle: CudaView<'_, u32> = x.slice(1..3)?;
/// assert_eq!(engine.dtoh(&middle)?, [2, 3]);
/// assert_eq!(middle.into_bytes().len(), 8); // the same memory as bytes
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a, T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    mem: &'a Arc<DeviceMemory>,
    _marker: PhantomData<&'a T>,
}

/// A mutably borrowed range of a device array.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let mut x = engine.alloc_zeroed::<u32>(4)?;
/// let mut first_half = x.slice_mut(..2)?;
/// engine.htod_into(&[7, 7], &mut first_half)?;
/// assert_eq!(engine.dtoh(&x)?, [7, 7, 0, 0]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CudaViewMut<'a, T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    mem: &'a Arc<DeviceMemory>,
    _marker: PhantomData<&'a mut T>,
}

// SAFETY: the slice owns a device allocation (an address, not host memory) and an Arc to a
// Send + Sync stream; T is plain data.
unsafe impl<T: DeviceRepr> Send for CudaSlice<T> {}
// SAFETY: &CudaSlice only reads the address and length; device access goes through streams.
unsafe impl<T: DeviceRepr> Sync for CudaSlice<T> {}

pub(crate) fn byte_size<T>(what: &'static str, count: usize) -> Result<usize> {
    // A match, not `ok_or`: the error is built only when it is returned (this is on every
    // allocation's path).
    match count.checked_mul(std::mem::size_of::<T>()) {
        Some(bytes) => Ok(bytes),
        None => Err(CudaError::SizeOverflow { what, count, elem_size: std::mem::size_of::<T>() }),
    }
}

impl<T: DeviceRepr> CudaSlice<T> {
    /// Blocks until every use of the slice enqueued so far has completed.
    ///
    /// # Errors
    /// The error of the work waited for.
    pub fn synchronize(&self) -> Result<()> {
        self.mem.access.wait_on_host("CudaSlice::synchronize", Use::Write)
    }

    /// The slice's ordering state.
    pub(crate) fn access(&self) -> &Access {
        &self.mem.access
    }

    /// The slice's allocation.
    pub(crate) fn memory(&self) -> &Arc<DeviceMemory> {
        &self.mem
    }

    #[inline]
    fn new(ptr: CUdeviceptr, len: usize, stream: &Arc<CudaStream>, pooled: bool, eager: bool) -> CudaSlice<T> {
        Self::of_memory(ptr, len, stream, pooled, false, eager)
    }

    /// A slice of the whole of the memory at `ptr`, owned by `stream`, whose allocation (or, for
    /// `foreign` memory, the owner's pending work) is its last write.
    #[inline(always)]
    fn of_memory(
        ptr: CUdeviceptr,
        len: usize,
        stream: &Arc<CudaStream>,
        pooled: bool,
        foreign: bool,
        eager: bool,
    ) -> CudaSlice<T> {
        CudaSlice {
            ptr,
            len,
            mem: Arc::new(DeviceMemory {
                ptr,
                stream: Arc::clone(stream),
                pooled,
                foreign,
                lent: false,
                mapping: None,
                access: Access::new(Some(stream), eager),
            }),
            _marker: PhantomData,
        }
    }

    /// Device memory another library owns (an engine's activation buffer: a cudarc slice, a
    /// tensor's storage), as a slice of this crate: no copy, not freed here. Its uses through this
    /// crate follow the ordering rule with `stream`, the stream that orders the memory in the
    /// owner's code, as the owner: the first use on another stream waits for the work `stream`
    /// holds at that point (the owner's writes before this call included), and dropping the slice
    /// makes `stream` wait for every use the crate made of it, so the owner's later work on
    /// `stream` (a read, a reuse, its stream-ordered free) comes after them.
    ///
    /// Memory of unknown origin is treated as pool memory: a kernel on another device does not
    /// read it through peer access (copies between devices still do).
    ///
    /// # Safety
    /// - `ptr` is the address of `len` initialised elements of `T` in device memory of `stream`'s
    ///   device, and stays valid (not freed, not reused) until the slice is dropped and every
    ///   use ordered before that on `stream` has run: the owner frees or reuses it only through
    ///   work on `stream` enqueued after the drop, or after waiting for that.
    /// - While the slice lives, the owner's own work touches the memory only on `stream`.
    /// - No other slice of this crate covers the same memory (two would not order each other).
    ///
    /// A graph that captured work on the slice keeps its memory in use after the slice drops (its
    /// launches use it): the owner's stream waits for every use only when the last such graph
    /// goes too.
    pub unsafe fn from_foreign(ptr: CUdeviceptr, len: usize, stream: &Arc<CudaStream>) -> CudaSlice<T> {
        Self::of_memory(ptr, len, stream, true, true, false)
    }

    /// [`from_foreign`](Self::from_foreign) of memory lent for a scope only: no stream capture
    /// may take the slice's memory (the capture is refused, `CaptureError::IllegalCall`), so
    /// nothing of this crate uses it after the slice drops.
    ///
    /// # Safety
    /// As [`from_foreign`](Self::from_foreign).
    #[cfg(feature = "cudarc-interop")]
    pub(crate) unsafe fn lent_foreign(ptr: CUdeviceptr, len: usize, stream: &Arc<CudaStream>) -> CudaSlice<T> {
        let mut slice = Self::of_memory(ptr, len, stream, true, true, false);
        Arc::get_mut(&mut slice.mem).expect("a new slice's memory is its own").lent = true;
        slice
    }

    /// Waits on the host for every use of the slice's memory so far (a lend's end on a stream
    /// that another library captures, where no wait can be enqueued).
    #[cfg(feature = "cudarc-interop")]
    pub(crate) fn wait_for_uses_on_host(&self) -> Result<()> {
        self.mem.access.wait_on_host_off(&self.mem.stream)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal of the memory.
    pub fn ordinal(&self) -> i32 {
        self.mem.stream.ordinal()
    }

    /// A view of the whole slice.
    pub fn as_view(&self) -> CudaView<'_, T> {
        DeviceSlice::as_view(self)
    }

    /// A mutable view of the whole slice.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        CudaViewMut { ptr: self.ptr, len: self.len, mem: &self.mem, _marker: PhantomData }
    }

    /// A view of `range`.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for a range outside the slice.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'_, T>> {
        self.as_view().slice(range)
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for a range outside the slice.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<CudaViewMut<'_, T>> {
        self.as_view_mut().slice_mut(range)
    }

    /// Hands ownership to `stream`: the slice will be freed there (after every use, as always).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for a stream of another device; [`CudaError::HeldByGraph`] while a
    /// graph that captured work on the slice lives (it may free the memory last).
    pub fn set_stream(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if stream.ordinal() != self.mem.stream.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "CudaSlice::set_stream: the new owner must be on the slice's device",
                expected: self.mem.stream.ordinal(),
                found: stream.ordinal(),
            });
        }
        // A match, not `ok_or`: the error is built only when it is returned (the readback's path).
        let Some(mem) = Arc::get_mut(&mut self.mem) else {
            return Err(CudaError::HeldByGraph { what: "CudaSlice::set_stream" });
        };
        mem.stream = Arc::clone(stream);
        Ok(())
    }
}

fn bounds(what: &'static str, range: &impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(CudaError::OutOfBounds { what, start, end, len });
    }
    Ok((start, end))
}

impl<'a, T: DeviceRepr> CudaView<'a, T> {
    /// The stream that owns the viewed slice.
    pub(crate) fn owner(&self) -> &'a Arc<CudaStream> {
        &self.mem.stream
    }

    /// The viewed allocation.
    pub(crate) fn memory(&self) -> &'a Arc<DeviceMemory> {
        self.mem
    }

    /// `len` elements of `U` from `byte_offset` bytes into this view; the caller checked that
    /// they lie inside it and are aligned for `U`.
    fn part<U: DeviceRepr>(&self, byte_offset: usize, len: usize) -> CudaView<'a, U> {
        CudaView { ptr: self.ptr + byte_offset as CUdeviceptr, len, mem: self.mem, _marker: PhantomData }
    }

    /// The same memory as bytes.
    pub fn into_bytes(self) -> CudaView<'a, u8> {
        self.part(0, self.byte_len())
    }

    /// The view's first `len` elements of `U` (any size, zero-sized types too): `what` names the
    /// call in the errors, [`CudaError::OutOfBounds`] when they do not fit and [`CudaError::Misaligned`]
    /// when the address is not aligned for `U`.
    pub(crate) fn first_as<U: DeviceRepr>(&self, what: &'static str, len: usize) -> Result<CudaView<'a, U>> {
        let bytes = byte_size::<U>(what, len)?;
        if bytes > self.byte_len() {
            return Err(CudaError::OutOfBounds { what, start: 0, end: bytes, len: self.byte_len() });
        }
        let align = std::mem::align_of::<U>();
        if self.ptr % align as CUdeviceptr != 0 {
            return Err(CudaError::Misaligned { what, address: self.ptr, align });
        }
        Ok(self.part(0, len))
    }

    /// A view of `range` of this view.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for a range outside the view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'a, T>> {
        let (start, end) = bounds("CudaView::slice", &range, self.len)?;
        Ok(self.part(start * std::mem::size_of::<T>(), end - start))
    }

    /// The same bytes viewed as `U` elements.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] when the byte length is not a multiple of `U`'s size, or `U`
    /// has no size (no element count would fit); [`CudaError::Misaligned`] when the address is not
    /// aligned for `U`.
    pub fn reinterpret<U: DeviceRepr>(&self) -> Result<CudaView<'a, U>> {
        let bytes = self.len * std::mem::size_of::<T>();
        let size = std::mem::size_of::<U>();
        if size == 0 {
            return Err(CudaError::LengthMismatch {
                what: "CudaView::reinterpret: the target type's size (a zero-sized type)",
                expected: 1,
                found: 0,
            });
        }
        if bytes % size != 0 {
            return Err(CudaError::LengthMismatch {
                what: "CudaView::reinterpret: bytes must be a whole number of target elements",
                expected: bytes.div_ceil(size) * size,
                found: bytes,
            });
        }
        self.first_as::<U>("CudaView::reinterpret", bytes / size)
    }
}

macro_rules! device_slice_impls {
    ($($ty:ident $(<$lt:lifetime>)?),*) => {$(
        impl<$($lt,)? T: DeviceRepr> sealed::Sealed for $ty<$($lt,)? T> {}
        impl<$($lt,)? T: DeviceRepr> DeviceSlice<T> for $ty<$($lt,)? T> {
            #[inline]
            fn device_ptr(&self) -> CUdeviceptr {
                self.ptr
            }
            #[inline]
            fn len(&self) -> usize {
                self.len
            }
            #[inline]
            fn stream(&self) -> &Arc<CudaStream> {
                &self.memory().stream
            }
            #[inline]
            fn is_pooled(&self) -> bool {
                self.memory().pooled
            }
            #[inline]
            fn as_view(&self) -> CudaView<'_, T> {
                CudaView {
                    ptr: self.ptr,
                    len: self.len,
                    mem: self.memory(),
                    _marker: PhantomData,
                }
            }
        }
    )*};
}
device_slice_impls!(CudaSlice, CudaView<'a>, CudaViewMut<'a>);
impl<T: DeviceRepr> DeviceSliceMut<T> for CudaSlice<T> {
    fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        CudaSlice::as_view_mut(self)
    }
}
impl<T: DeviceRepr> DeviceSliceMut<T> for CudaViewMut<'_, T> {
    fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        CudaViewMut { ptr: self.ptr, len: self.len, mem: self.mem, _marker: PhantomData }
    }
}

impl<'a, T: DeviceRepr> CudaViewMut<'a, T> {
    /// The viewed allocation.
    pub(crate) fn memory(&self) -> &'a Arc<DeviceMemory> {
        self.mem
    }

    /// `len` elements of `U` from `byte_offset` bytes into this view; the caller checked that
    /// they lie inside it and are aligned for `U`.
    fn part<U: DeviceRepr>(self, byte_offset: usize, len: usize) -> CudaViewMut<'a, U> {
        CudaViewMut { ptr: self.ptr + byte_offset as CUdeviceptr, len, mem: self.mem, _marker: PhantomData }
    }

    /// The same memory as bytes (writing bytes is sound: every bit pattern is a valid `T`, see
    /// [`DeviceRepr`]).
    pub fn into_bytes(self) -> CudaViewMut<'a, u8> {
        let bytes = self.byte_len();
        self.part(0, bytes)
    }

    /// A mutable view of `range` of this view.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for a range outside the view.
    pub fn slice_mut(self, range: impl RangeBounds<usize>) -> Result<CudaViewMut<'a, T>> {
        let (start, end) = bounds("CudaViewMut::slice_mut", &range, self.len)?;
        Ok(self.part(start * std::mem::size_of::<T>(), end - start))
    }
}

/// Makes the owner's stream wait for every use of memory another library owns (its ordering
/// state `access`).
fn release_to_owner(access: &mut Access, owner: &Arc<CudaStream>) -> Result<()> {
    access.order_exclusive(owner, Use::Write)
}

impl Drop for DeviceMemory {
    #[inline]
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // The owner's capture state holds still from the look below to the free.
        let _gate = self.stream.enqueue_gate();
        if self.lent {
            // A scoped lend ends here, and the lender's own end (the other library's record of
            // its buffer's use) follows at once on the owner's stream: the owner waits for every
            // use now, whatever capture is active elsewhere. The owner's stream is not capturing
            // (no capture of it begins during a lend, `CudaStream::lend_scope`), and the waits
            // are on events recorded outside any capture (no capture may use the memory).
            if let Err(e) = release_to_owner(&mut self.access, &self.stream) {
                super::record_drop_error(e);
            }
            return;
        }
        if let Some(blocked) = free_blocked(|| self.stream.capture()) {
            // A free now would be captured (or break a capture): hand the allocation to the
            // capture, which frees it when it ends, or to a thread the capture leaves free.
            let held = DeviceMemory {
                ptr: std::mem::take(&mut self.ptr),
                stream: Arc::clone(&self.stream),
                pooled: self.pooled,
                foreign: self.foreign,
                lent: self.lent,
                mapping: self.mapping.take(),
                access: std::mem::replace(&mut self.access, Access::new(None, false)),
            };
            blocked.hold(Box::new(held));
            return;
        }
        let result = if self.foreign {
            // Not ours to free: the owner's stream waits for every use, and the owner frees it
            // in its stream's order.
            release_to_owner(&mut self.access, &self.stream)
        } else if self.pooled && self.mapping.is_none() {
            // The owner waits for every use, then frees in stream order.
            self.access.order_exclusive(&self.stream, Use::Write).and_then(|()| {
                let _bound = self.stream.context().bind()?;
                // SAFETY: the pointer came from alloc_async and is freed once; every use of it is
                // ordered before this point on the owning stream (just above).
                unsafe { raw::free_async(self.ptr, self.stream.raw()) }
            })
        } else {
            // cuMemFree and an unmap do not wait for streams: wait on the host for every use first.
            self.access.wait_on_host("CudaSlice::drop", Use::Write).and_then(|()| {
                let _bound = self.stream.context().bind()?;
                match self.mapping.as_mut() {
                    // SAFETY: every use has completed (just above), the context is bound, and
                    // the drop runs once.
                    Some(mapping) => unsafe { mapping.release(self.ptr) },
                    // SAFETY: the pointer came from cuMemAlloc, is freed once, and every use of
                    // it has completed (just above).
                    None => unsafe { raw::free(self.ptr) },
                }
            })
        };
        if let Err(e) = result {
            // Ordering or waiting failed (the context is lost, or out of resources): the memory
            // may still be in use, so it is not freed.
            super::record_drop_error(e);
        }
    }
}

#[cfg(test)]
mod tests;
