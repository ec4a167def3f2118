//! Device memory: element types, owning slices, views and copies.
//!
//! A [`CudaSlice`] is owned by one stream. Stream-ordered slices come from the device's memory
//! pool and are freed on that stream; persistent slices are plain `cuMemAlloc` allocations
//! (reachable by peers through peer access, unlike pool memory) freed after that stream drains.
//! Work that uses a slice on another stream is ordered after the owner's earlier work, and the
//! owner's later work (its free, or a write) after it; so a copy's source cannot be freed or
//! overwritten while the copy is in flight.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use super::stream::CudaStream;
use crate::error::{Error, Result};
use crate::result::memory as raw;
use crate::sys::CUdeviceptr;

mod sealed {
    pub trait Sealed {}
}

/// Element types that may live in device memory and cross the FFI boundary as raw bytes.
///
/// Implemented for the integers, `f32`, `f64`, and `half`'s [`bf16`](half::bf16) and
/// [`f16`](half::f16). Implement it for your own plain-old-data types (a `#[repr(C)]` struct of
/// such fields, say) to move them with this crate.
///
/// # Safety
/// - Every bit pattern of `size_of::<Self>()` bytes is a valid `Self` (copies and kernels write
///   arbitrary bytes, and fresh device memory holds arbitrary bytes).
/// - `Self` has no padding, no pointers or references, and no drop glue (`Copy` ensures the
///   last), so its bytes may be read and compared.
/// - `NAME` names the type unambiguously: `rx` compares it with the type `tx` sent.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {
    /// The type's name, used in error messages and to match `rx` with `tx`.
    const NAME: &'static str;
}

macro_rules! device_repr {
    ($($t:ty => $name:literal),*) => {$(
        // SAFETY: a primitive numeric type: no padding, every bit pattern valid, no pointers.
        unsafe impl DeviceRepr for $t {
            const NAME: &'static str = $name;
        }
    )*};
}
device_repr!(
    u8 => "u8", i8 => "i8", u16 => "u16", i16 => "i16", u32 => "u32", i32 => "i32", u64 => "u64", i64 => "i64",
    f32 => "f32", f64 => "f64", half::bf16 => "bf16", half::f16 => "f16"
);

/// Device memory usable as the source of a copy or kernel. Sealed: implemented by
/// [`CudaSlice`], [`CudaView`] and [`CudaViewMut`].
pub trait DeviceSlice<T: DeviceRepr>: sealed::Sealed {
    /// The device address of the first element.
    fn device_ptr(&self) -> CUdeviceptr;
    /// Number of elements.
    fn len(&self) -> usize;
    /// The stream that owns the memory.
    fn stream(&self) -> &Arc<CudaStream>;
    /// Whether the memory came from a stream-ordered pool (not reachable by peers' kernels).
    fn is_pooled(&self) -> bool;
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
}

/// Device memory usable as the destination of a copy or kernel.
pub trait DeviceSliceMut<T: DeviceRepr>: DeviceSlice<T> {}

/// An owned array of `T` in device memory.
#[derive(Debug)]
pub struct CudaSlice<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    pooled: bool,
    _marker: PhantomData<T>,
}

/// A borrowed range of a device array.
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a, T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    pooled: bool,
    stream: &'a Arc<CudaStream>,
    _marker: PhantomData<&'a T>,
}

/// A mutably borrowed range of a device array.
#[derive(Debug)]
pub struct CudaViewMut<'a, T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    pooled: bool,
    stream: &'a Arc<CudaStream>,
    _marker: PhantomData<&'a mut T>,
}

// SAFETY: the slice owns a device allocation (an address, not host memory) and an Arc to a
// Send + Sync stream; T is plain data.
unsafe impl<T: DeviceRepr> Send for CudaSlice<T> {}
// SAFETY: &CudaSlice only reads the address and length; device access goes through streams.
unsafe impl<T: DeviceRepr> Sync for CudaSlice<T> {}

pub(crate) fn check_host_copy_device(what: &'static str, stream: &CudaStream, memory_device: i32) -> Result<()> {
    check_same_device(what, stream, memory_device)
}

pub(crate) fn byte_size<T>(what: &'static str, count: usize) -> Result<usize> {
    count.checked_mul(std::mem::size_of::<T>()).ok_or(Error::SizeOverflow {
        what,
        count,
        elem_size: std::mem::size_of::<T>(),
    })
}

impl<T: DeviceRepr> CudaSlice<T> {
    /// Allocates `len` elements from the device's memory pool, ordered on `stream`, which owns the
    /// slice. The contents are unspecified (any bit pattern, valid for `T`). On a device without
    /// memory pools ([`Context::memory_pools_supported`](crate::Context::memory_pools_supported))
    /// this is [`alloc_persistent`](Self::alloc_persistent).
    ///
    /// # Errors
    /// [`Error::SizeOverflow`]; the driver's error (`CUDA_ERROR_OUT_OF_MEMORY`).
    #[doc(alias = "cuMemAllocAsync")]
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        if !stream.context().memory_pools_supported() {
            return Self::alloc_persistent(stream, len);
        }
        let bytes = byte_size::<T>("CudaSlice::alloc", len)?;
        let ptr = if bytes == 0 {
            0
        } else {
            let _bound = stream.context().bind()?;
            // SAFETY: the stream is live; the memory is used only by work ordered after this on
            // `stream` or joined to it (see the module doc).
            unsafe { raw::alloc_async(bytes, stream.raw())? }
        };
        Ok(CudaSlice { ptr, len, stream: Arc::clone(stream), pooled: true, _marker: PhantomData })
    }

    /// Allocates `len` elements with `cuMemAlloc` (not from a pool: peers with peer access can
    /// reach it), owned by `stream`. The contents are unspecified (any bit pattern, valid for `T`).
    ///
    /// # Errors
    /// [`Error::SizeOverflow`]; the driver's error.
    #[doc(alias = "cuMemAlloc")]
    pub fn alloc_persistent(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        let bytes = byte_size::<T>("CudaSlice::alloc_persistent", len)?;
        let ptr = if bytes == 0 {
            0
        } else {
            let _bound = stream.context().bind()?;
            raw::alloc(bytes)?
        };
        Ok(CudaSlice { ptr, len, stream: Arc::clone(stream), pooled: false, _marker: PhantomData })
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
        self.stream.ordinal()
    }

    /// A view of the whole slice.
    pub fn as_view(&self) -> CudaView<'_, T> {
        CudaView { ptr: self.ptr, len: self.len, pooled: self.pooled, stream: &self.stream, _marker: PhantomData }
    }

    /// A mutable view of the whole slice.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        CudaViewMut { ptr: self.ptr, len: self.len, pooled: self.pooled, stream: &self.stream, _marker: PhantomData }
    }

    /// A view of `range`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside the slice.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'_, T>> {
        self.as_view().slice(range)
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside the slice.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<CudaViewMut<'_, T>> {
        let (start, end) = bounds("CudaSlice::slice_mut", &range, self.len)?;
        Ok(CudaViewMut {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as CUdeviceptr,
            len: end - start,
            pooled: self.pooled,
            stream: &self.stream,
            _marker: PhantomData,
        })
    }

    /// Hands ownership to `stream`: `stream` is ordered after the old owner's work, and the slice
    /// will be freed there.
    ///
    /// # Errors
    /// The driver's error.
    pub fn set_stream(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if stream.ordinal() != self.stream.ordinal() {
            return Err(Error::WrongDevice {
                what: "CudaSlice::set_stream: the new owner must be on the slice's device",
                expected: self.stream.ordinal(),
                found: stream.ordinal(),
            });
        }
        stream.join(&self.stream)?;
        self.stream = Arc::clone(stream);
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
        return Err(Error::OutOfBounds { what, start, end, len });
    }
    Ok((start, end))
}

impl<'a, T: DeviceRepr> CudaView<'a, T> {
    /// A view of `range` of this view.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside the view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'a, T>> {
        let (start, end) = bounds("CudaView::slice", &range, self.len)?;
        Ok(CudaView {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as CUdeviceptr,
            len: end - start,
            pooled: self.pooled,
            stream: self.stream,
            _marker: PhantomData,
        })
    }

    /// The same bytes viewed as `U` elements.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the byte length is not a multiple of `U`'s size;
    /// [`Error::Misaligned`] when the address is not aligned for `U`.
    pub fn reinterpret<U: DeviceRepr>(&self) -> Result<CudaView<'a, U>> {
        let bytes = self.len * std::mem::size_of::<T>();
        let size = std::mem::size_of::<U>();
        if bytes % size != 0 {
            return Err(Error::LengthMismatch {
                what: "CudaView::reinterpret: bytes must be a whole number of target elements",
                expected: bytes.div_ceil(size) * size,
                found: bytes,
            });
        }
        let align = std::mem::align_of::<U>();
        if self.ptr % align as CUdeviceptr != 0 {
            return Err(Error::Misaligned { what: "CudaView::reinterpret", address: self.ptr, align });
        }
        Ok(CudaView {
            ptr: self.ptr,
            len: bytes / size,
            pooled: self.pooled,
            stream: self.stream,
            _marker: PhantomData,
        })
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
                &self.stream
            }
            #[inline]
            fn is_pooled(&self) -> bool {
                self.pooled
            }
        }
    )*};
}
device_slice_impls!(CudaSlice, CudaView<'a>, CudaViewMut<'a>);
impl<T: DeviceRepr> DeviceSliceMut<T> for CudaSlice<T> {}
impl<T: DeviceRepr> DeviceSliceMut<T> for CudaViewMut<'_, T> {}

impl<T: DeviceRepr> Drop for CudaSlice<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let result = self.stream.context().bind().and_then(|_bound| {
            if self.pooled {
                // SAFETY: the pointer came from alloc_async and is freed once; every use of it is
                // ordered before this point on the owning stream (see the module doc).
                unsafe { raw::free_async(self.ptr, self.stream.raw()) }
            } else {
                // cuMemFree does not wait for other streams: drain the owner first (uses on other
                // streams were joined into it).
                // SAFETY: the stream is live; the pointer came from cuMemAlloc, freed once, and no
                // work uses it after the owner drained.
                unsafe { crate::result::stream::synchronize(self.stream.raw()).and_then(|()| raw::free(self.ptr)) }
            }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

/// Orders `stream` after every owner in `owners` that differs from it.
fn join_owners(stream: &CudaStream, owners: &[&Arc<CudaStream>]) -> Result<()> {
    for owner in owners {
        stream.join(owner)?;
    }
    Ok(())
}

/// Orders every owner that differs from `stream` after the work just enqueued on `stream`.
fn release_owners(stream: &CudaStream, owners: &[&Arc<CudaStream>]) -> Result<()> {
    for owner in owners {
        owner.join(stream)?;
    }
    Ok(())
}

/// Host-device copies run on a stream of the device memory's own device (the driver refuses
/// others).
fn check_same_device(what: &'static str, stream: &CudaStream, memory_device: i32) -> Result<()> {
    if stream.ordinal() == memory_device {
        Ok(())
    } else {
        Err(Error::WrongDevice { what, expected: stream.ordinal(), found: memory_device })
    }
}

fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(Error::LengthMismatch { what, expected, found }) }
}

impl CudaStream {
    /// Copies host `src` into `dst` on this stream. `src` may be dropped or overwritten as soon
    /// as this returns: pageable memory is staged by the driver during the call, and memory the
    /// driver reads later (pinned, registered or managed host memory, such as a
    /// [`PinnedHostBuffer`](crate::PinnedHostBuffer)'s contents) is waited for before returning.
    /// For an asynchronous copy from pinned memory use
    /// [`memcpy_htod_pinned`](Self::memcpy_htod_pinned).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless the lengths agree; [`Error::WrongDevice`] when `dst` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn memcpy_htod<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, src: &[T], dst: &mut D) -> Result<()> {
        check_len("CudaStream::memcpy_htod", dst.len(), src.len())?;
        check_same_device("CudaStream::memcpy_htod: dst must be on the stream's device", self, dst.ordinal())?;
        if src.is_empty() {
            return Ok(());
        }
        let read_later = raw::memory_type(src.as_ptr() as CUdeviceptr)?.is_some();
        join_owners(self, &[dst.stream()])?;
        let _bound = self.context().bind()?;
        // SAFETY: dst is valid for byte_len bytes and ordered after its owner's work; src is
        // pageable (staged before the call returns) or memory the driver reads later, which is
        // waited for below before the borrow of src ends.
        unsafe { raw::memcpy_htod_async(dst.device_ptr(), src.as_ptr().cast(), dst.byte_len(), self.raw())? };
        if read_later {
            // On failure the context is lost and the copy will not run.
            self.synchronize()?;
        }
        self.settle(release_owners(self, &[dst.stream()]))
    }

    /// Copies device `src` into host `dst` on this stream and returns once `dst` holds the data.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless the lengths agree; [`Error::WrongDevice`] when `src` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn memcpy_dtoh<T: DeviceRepr, S: DeviceSlice<T>>(&self, src: &S, dst: &mut [T]) -> Result<()> {
        check_len("CudaStream::memcpy_dtoh", dst.len(), src.len())?;
        check_same_device("CudaStream::memcpy_dtoh: src must be on the stream's device", self, src.ordinal())?;
        if dst.is_empty() {
            return Ok(());
        }
        join_owners(self, &[src.stream()])?;
        let _bound = self.context().bind()?;
        // SAFETY: src is valid and ordered after its owner's work; dst is writable for byte_len
        // bytes and exclusively borrowed; it is read only after the synchronisation below.
        unsafe { raw::memcpy_dtoh_async(dst.as_mut_ptr().cast(), src.device_ptr(), src.byte_len(), self.raw())? };
        // A failed wait means the context is lost: the copy will not run after dst is gone.
        self.synchronize()?;
        release_owners(self, &[src.stream()])
    }

    /// Copies `src` into `dst` on this stream; the two may be on different devices (with peer
    /// access the copy engines move it over NVLink or PCIe; without, the driver stages it).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless the lengths agree; the driver's error.
    #[doc(alias = "cuMemcpyAsync")]
    #[doc(alias = "cuMemcpyPeerAsync")]
    pub fn memcpy_dtod<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(
        &self,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        check_len("CudaStream::memcpy_dtod", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let owners = [src.stream(), dst.stream()];
        join_owners(self, &owners)?;
        let _bound = self.context().bind()?;
        let (src_ctx, dst_ctx) = (src.stream().context(), dst.stream().context());
        if Arc::ptr_eq(src_ctx, dst_ctx) {
            // SAFETY: both ranges are valid for byte_len bytes and ordered after their owners.
            unsafe { raw::memcpy_async(dst.device_ptr(), src.device_ptr(), src.byte_len(), self.raw())? };
        } else {
            // SAFETY: as above; the contexts are the ranges' live primary contexts.
            unsafe {
                raw::memcpy_peer_async(
                    dst.device_ptr(),
                    dst_ctx.raw(),
                    src.device_ptr(),
                    src_ctx.raw(),
                    src.byte_len(),
                    self.raw(),
                )?
            };
        }
        self.settle(release_owners(self, &owners))
    }

    /// Sets every 32-bit word of `dst` to `value` on this stream.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless `T` is 4 bytes wide; the driver's error.
    #[doc(alias = "cuMemsetD32Async")]
    pub fn memset_u32<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, dst: &mut D, value: u32) -> Result<()> {
        check_len("CudaStream::memset_u32: element size", 4, std::mem::size_of::<T>())?;
        if dst.is_empty() {
            return Ok(());
        }
        join_owners(self, &[dst.stream()])?;
        let _bound = self.context().bind()?;
        // SAFETY: dst is valid for len 4-byte words and ordered after its owner.
        unsafe { raw::memset_d32_async(dst.device_ptr(), value, dst.len(), self.raw())? };
        self.settle(release_owners(self, &[dst.stream()]))
    }

    /// Sets every byte of `dst` to `value` on this stream.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuMemsetD8Async")]
    pub fn memset_bytes<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, dst: &mut D, value: u8) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        join_owners(self, &[dst.stream()])?;
        let _bound = self.context().bind()?;
        // SAFETY: dst is valid for byte_len bytes and ordered after its owner.
        unsafe { raw::memset_d8_async(dst.device_ptr(), value, dst.byte_len(), self.raw())? };
        self.settle(release_owners(self, &[dst.stream()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert_eq!(bounds("t", &(2..5), 8).unwrap(), (2, 5));
        assert_eq!(bounds("t", &(..), 8).unwrap(), (0, 8));
        assert_eq!(bounds("t", &(3..=3), 8).unwrap(), (3, 4));
        assert_eq!(bounds("t", &(4..9), 8).unwrap_err(), Error::OutOfBounds { what: "t", start: 4, end: 9, len: 8 });
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..2;
        assert!(bounds("t", &reversed, 8).is_err());
    }

    #[test]
    fn byte_sizes_do_not_overflow_silently() {
        assert_eq!(byte_size::<u32>("t", 10).unwrap(), 40);
        assert!(matches!(byte_size::<u64>("t", usize::MAX / 2), Err(Error::SizeOverflow { elem_size: 8, .. })));
    }
}
