//! cudarc 0.19's buffers and streams in this crate, zero copy (feature `cudarc`).
//!
//! An engine built on cudarc keeps its activations in `cudarc::driver::CudaSlice`s and orders
//! them on its cudarc streams, with cudarc's events where its event tracking is on. An
//! [`EngineStream`] wraps one such stream (the same `CUstream`, on the device's primary context,
//! which this crate and cudarc share); through it a cudarc slice or view is lent to this crate as
//! a [`CudaSlice`] for as long as a guard lives ([`EngineStream::read`], [`EngineStream::write`]):
//! no copy, and the ordering both ways is kept:
//!
//! - the lend makes the engine's stream wait for the slice's earlier cudarc work (cudarc's own
//!   `device_ptr` / `device_ptr_mut`), and this crate's first use on another stream (a stage's)
//!   waits for the engine's stream (the crate's ordering rule, with the engine's stream as the
//!   memory's owner);
//! - the guard's drop makes the engine's stream wait for every use this crate made, then records
//!   cudarc's event there, so cudarc's later work on any stream waits for it.
//!
//! Feature `cudarc` builds this module with cudarc loading the driver at run time; an engine
//! whose own cudarc dependency picks another linking mode (candle links the CUDA libraries, and
//! cudarc allows one mode per build) enables `cudarc-interop` instead, which leaves the mode and
//! the CUDA version to it.
//!
//! The borrow the guard holds keeps cudarc's other writers out meanwhile (a read guard holds
//! `&`, a write guard `&mut`). With cudarc's event tracking off, cudarc leaves the ordering
//! across its streams to the engine, as it does for its own launches.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::engine::Engine;
use crate::error::{CudaError, Result};
use crate::pp::ReceivedSlot;
use crate::safe::{CudaSlice, CudaStream, DeviceRepr, DeviceSlice};

/// An engine's cudarc stream as a stream of this crate: the same `CUstream` (not destroyed
/// here), on the context this crate shares with cudarc (the device's primary context).
pub struct EngineStream {
    theirs: Arc<cudarc::driver::CudaStream>,
    ours: Arc<CudaStream>,
}

impl EngineStream {
    /// Wraps `stream`, a cudarc stream of `engine`'s device.
    ///
    /// # Errors
    /// [`CudaError::WrongContext`] when `stream`'s context is not `engine`'s (cudarc's
    /// `CudaContext::new` retains the device's primary context, as this crate does; a non-primary
    /// cudarc context cannot be shared).
    pub fn new(engine: &Engine, stream: &Arc<cudarc::driver::CudaStream>) -> Result<EngineStream> {
        let theirs_ctx = stream.context().cu_ctx();
        let ours_ctx = engine.context().raw();
        if !std::ptr::eq(theirs_ctx.cast::<u8>(), ours_ctx.cast::<u8>()) {
            return Err(CudaError::WrongContext {
                what: "EngineStream::new: the cudarc stream's context must be the engine's (the device's primary context)",
                device: engine.context().ordinal(),
            });
        }
        // SAFETY: the stream is a live stream of `engine`'s context (checked above), and the
        // wrapper keeps cudarc's `Arc` of it, so it outlives every holder of `ours`.
        let ours = unsafe { CudaStream::adopt(engine.context(), stream.cu_stream().cast::<crate::sys::CUstream_st>()) };
        Ok(EngineStream { theirs: Arc::clone(stream), ours })
    }

    /// The stream, as this crate's (use it for the engine's own work through this crate).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.ours
    }

    /// The cudarc stream.
    pub fn cudarc_stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        &self.theirs
    }

    /// Lends the cudarc slice or view `src` to this crate for reading (a `tx` from it, a copy
    /// out of it, a kernel that reads it) until the guard drops.
    pub fn read<'a, T: DeviceRepr, S: DevicePtr<T>>(&'a self, src: &'a S) -> Lent<'a, T> {
        let (ptr, sync) = src.device_ptr(&self.theirs);
        // SAFETY: `ptr` addresses `src.len()` elements of `T` of the stream's device; `src` is
        // borrowed for the guard's life, so cudarc neither frees nor writes it meanwhile, and
        // its earlier writes are ordered before the engine's stream (cudarc's `device_ptr`); no
        // other slice of this crate covers it while the guard lives (each lend is its own guard,
        // and the borrow keeps a write guard out).
        let slice = unsafe { CudaSlice::from_foreign(ptr, src.len(), &self.ours) };
        Lent { slice, _sync: sync }
    }

    /// Lends the cudarc slice or view `dst` to this crate for writing (an `rx_into` it, a copy
    /// into it, a kernel that writes it) until the guard drops.
    pub fn write<'a, T: DeviceRepr, S: DevicePtrMut<T>>(&'a self, dst: &'a mut S) -> LentMut<'a, T> {
        let len = dst.len();
        let (ptr, sync) = dst.device_ptr_mut(&self.theirs);
        // SAFETY: as in `read`, with `dst` borrowed mutably: nothing else of cudarc touches it
        // while the guard lives; its earlier reads and writes are ordered before the engine's
        // stream (cudarc's `device_ptr_mut`).
        let slice = unsafe { CudaSlice::from_foreign(ptr, len, &self.ours) };
        LentMut { lent: Lent { slice, _sync: sync } }
    }

    /// The slot that `received` lends ([`PpNRt::rx_in_place`](crate::PpNRt::rx_in_place)) as a
    /// cudarc view, for the engine's kernels to read in place: no copy. The engine's stream is
    /// ordered after the slot's data arrived; with cudarc's event tracking on, cudarc's readers
    /// on other streams are too (the view's write event is recorded there), and when the view
    /// drops the engine's stream waits for them, so that the slot's next `tx`, ordered after the
    /// engine's stream when `received` drops, comes after every read. With the tracking off,
    /// read the view on this stream only (cudarc then leaves ordering across streams to the
    /// engine). A host-staged boundary's guard holds a copy; the view is then of the copy.
    ///
    /// # Errors
    /// The driver's error ([`crate::Error::Cuda`]).
    pub fn received_view<'a, T: DeviceRepr>(
        &'a self,
        received: &'a mut ReceivedSlot<'_, T>,
    ) -> crate::pp::Result<ReceivedView<'a, T>> {
        received.order_on(&self.ours)?;
        let view = received.view()?;
        // SAFETY: the address holds `view.len()` elements of `T` for as long as `received` lends
        // them, which the returned guard's borrow of `received` outlasts; the guard never lets
        // cudarc free the memory (it leaks the slice, see `ReceivedView`'s drop).
        let mut slice = unsafe { self.theirs.upgrade_device_ptr::<T>(view.device_ptr(), view.len()) };
        // cudarc's write event of the slice, recorded on the engine's stream after the wait above:
        // cudarc's readers on other streams wait for it.
        drop(cudarc::driver::DevicePtrMut::device_ptr_mut(&mut slice, &self.theirs));
        Ok(ReceivedView { slice: Some(slice), _received: std::marker::PhantomData })
    }
}

/// A received slot as a cudarc view ([`EngineStream::received_view`]), borrowing the
/// [`ReceivedSlot`] it was made from (so the slot is not given back while the view lives).
/// Dropping it makes the engine's stream wait for cudarc's reads of it (with event tracking on).
pub struct ReceivedView<'a, T> {
    /// The slot's memory as a cudarc slice that never frees it (leaked on drop).
    slice: Option<cudarc::driver::CudaSlice<T>>,
    _received: std::marker::PhantomData<&'a mut ()>,
}

impl<T> ReceivedView<'_, T> {
    /// The received elements, for cudarc's launches and copies.
    pub fn view(&self) -> cudarc::driver::CudaView<'_, T> {
        self.slice.as_ref().expect("held until drop").as_view()
    }
}

impl<T> Drop for ReceivedView<'_, T> {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            // Waits, on the engine's stream, for cudarc's reads of the slice (its tracked events),
            // and gives the memory back to the slot without freeing it.
            slice.leak();
        }
    }
}

/// A cudarc buffer lent to this crate for reading ([`EngineStream::read`]): derefs to a
/// [`CudaSlice`].
pub struct Lent<'a, T: DeviceRepr> {
    // Dropped in this order (fields drop as declared): the slice first (the engine's stream
    // waits for this crate's uses), then cudarc's record (its event then covers them).
    slice: CudaSlice<T>,
    _sync: SyncOnDrop<'a>,
}

impl<T: DeviceRepr> Deref for Lent<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

/// A cudarc buffer lent to this crate for writing ([`EngineStream::write`]): derefs to a mutable
/// [`CudaSlice`].
pub struct LentMut<'a, T: DeviceRepr> {
    lent: Lent<'a, T>,
}

impl<T: DeviceRepr> Deref for LentMut<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.lent.slice
    }
}

impl<T: DeviceRepr> DerefMut for LentMut<'_, T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.lent.slice
    }
}
