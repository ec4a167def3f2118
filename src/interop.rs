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
use crate::safe::{CudaSlice, CudaStream, DeviceRepr};

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
