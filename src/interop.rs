//! cudarc 0.19's buffers and streams in this crate, zero copy (feature `cudarc`).
//!
//! An engine built on cudarc keeps its activations in `cudarc::driver::CudaSlice`s and orders
//! them on its cudarc streams, with cudarc's events where its event tracking is on. An
//! [`EngineStream`] wraps one such stream (the same `CUstream`, on the device's primary context,
//! which this crate and cudarc share). Through it a cudarc buffer is lent to this crate for the
//! length of a closure, as a view of this crate's ([`CudaView`] to read, [`CudaViewMut`] to
//! write), which the closure passes to `tx`, `rx_into`, copies and launches:
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let engine = ppnrt::Engine::new(0)?;
//! # let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(2), &engine)?;
//! # let n = 1024;
//! use ppnrt::interop::EngineStream;
//! let cudarc_stream = cudarc::driver::CudaContext::new(0)?.new_stream()?;
//! let engine_stream = EngineStream::new(&engine, &cudarc_stream)?; // the same CUstream
//! let hidden = cudarc_stream.alloc_zeros::<f32>(n)?;
//! let slot = engine_stream.read(&hidden, |hidden| {
//!     let _stage = rt.enter(0)?;
//!     rt.tx(0, &hidden, n)
//! })??; // cudarc's later writers of `hidden` wait for the send
//! let mut next = cudarc_stream.alloc_zeros::<f32>(n)?;
//! engine_stream.write(&mut next, |mut next| {
//!     let _stage = rt.enter(1)?;
//!     rt.rx_into(0, slot, &mut next) // the boundary's one copy, into the engine's buffer
//! })??; // cudarc's readers of `next` wait for the copy
//! # Ok(())
//! # }
//! ```
//!
//! What the lend guarantees, with no `unsafe` in the caller:
//!
//! - **Ordered both ways, whatever the closure does.** On entry the engine's stream waits for the
//!   buffer's earlier cudarc work (cudarc's own `device_ptr` / `device_ptr_mut`), and this crate's
//!   first use on another stream (a stage's) waits for the engine's stream (the crate's ordering
//!   rule, with the engine's stream as the memory's owner). When the closure returns, or unwinds,
//!   the engine's stream waits for every use this crate made, then cudarc's event of the buffer
//!   is recorded there, so cudarc's later work on any stream waits for it. That end runs in this
//!   crate's frame, not in a guard the caller holds: no `mem::forget` can skip it.
//! - **The lent memory cannot outlive the lend.** The closure gets a view whose lifetime ends
//!   with the call: it cannot be kept, moved out or swapped for an owned slice, and the borrow of
//!   the cudarc buffer keeps cudarc's other users out meanwhile (a read lends `&`, a write
//!   `&mut`). No stream capture may take the view's memory (a graph would launch on it after
//!   the lend): such a capture is refused ([`CaptureError::IllegalCall`](crate::CaptureError)).
//!   The lend's end is enqueued on the engine's stream whatever capture is active elsewhere, and
//!   never captured: no capture of the engine's stream begins during a lend
//!   ([`CaptureError::CannotBegin`](crate::CaptureError)), and a lend on a capturing stream is
//!   refused.
//! - **Only cudarc's own buffers.** [`CudarcBuffer`] and [`CudarcBufferMut`] are sealed and
//!   implemented for cudarc's `CudaSlice`, `CudaView` and `CudaViewMut` alone (a write for the
//!   slice and the mutable view): the address and length come from cudarc's own code, never from
//!   a caller's implementation of cudarc's safe `DevicePtr` / `DeviceSlice` traits. A buffer of
//!   another context than the stream's is refused.
//! - **cudarc's stream lives as long as this crate uses it.** [`EngineStream::stream`] holds
//!   cudarc's `Arc` of the stream ([`CudaStream::adopt_owned`]): a runtime built on it
//!   ([`PpNRt::with_stage_streams`](crate::PpNRt::with_stage_streams)) keeps it alive after the
//!   engine drops its own handles.
//! - **The thread's current context is the caller's.** cudarc binds its context on each call and
//!   puts nothing back; every call into cudarc made here runs with the stream's context made
//!   current first and the caller's put back afterwards (on unwind too), through the crate's
//!   context rule, so a [`Context::bound_unchecked`](crate::Context::bound_unchecked) scope of
//!   another device stays right.
//!
//! [`EngineStream::received_view`] goes the other way: a slot received in place
//! ([`PpNRt::rx_in_place`](crate::PpNRt::rx_in_place)) lent to the closure as a cudarc view, for
//! the engine's kernels to read with no copy.
//!
//! Feature `cudarc` builds this module with cudarc loading the driver at run time; an engine
//! whose own cudarc dependency picks another linking mode (candle links the CUDA libraries, and
//! cudarc allows one mode per build) enables `cudarc-interop` instead, which leaves the mode and
//! the CUDA version to it. With cudarc's event tracking off, cudarc leaves the ordering across
//! its streams to the engine, as it does for its own launches.
//!
//! A lent buffer cannot be kept by anything of this crate past the closure (a view borrows it).
//!
//! ```compile_fail,E0521
//! # fn steal(engine_stream: &ppnrt::interop::EngineStream, y: &mut cudarc::driver::CudaSlice<u32>) {
//! let mut kept = None;
//! engine_stream.write(y, |view| kept = Some(view)).unwrap();
//! # drop(kept);
//! # }
//! ```
//!
//! Nor can an owned slice be swapped out of the lend (the closure gets a view, not `&mut` to an
//! owned slice over cudarc's memory): the form that was open to it does not compile.
//!
//! ```compile_fail,E0061
//! # fn steal(engine_stream: &ppnrt::interop::EngineStream, y: &mut cudarc::driver::CudaSlice<u32>, other: ppnrt::CudaSlice<u32>) {
//! let mut lent = engine_stream.write(y);
//! let stolen: ppnrt::CudaSlice<u32> = std::mem::replace(&mut *lent, other);
//! # drop(stolen);
//! # }
//! ```
//!
//! A caller's own buffer type cannot be lent, whatever it claims through cudarc's safe traits:
//!
//! ```compile_fail,E0277
//! struct Claims(std::sync::Arc<cudarc::driver::CudaStream>);
//! impl cudarc::driver::DeviceSlice<u32> for Claims {
//!     fn len(&self) -> usize { 65_536 }
//!     fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> { &self.0 }
//! }
//! impl cudarc::driver::DevicePtr<u32> for Claims {
//!     fn device_ptr<'a>(&'a self, _: &'a cudarc::driver::CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
//!         (0x1000, cudarc::driver::SyncOnDrop::Sync(None))
//!     }
//! }
//! # fn lend(engine_stream: &ppnrt::interop::EngineStream, stream: std::sync::Arc<cudarc::driver::CudaStream>) {
//! engine_stream.read(&Claims(stream), |view| view.len()).unwrap();
//! # }
//! ```
//!
//! and it cannot join the sealed traits:
//!
//! ```compile_fail,E0277
//! struct Claims;
//! impl ppnrt::interop::CudarcBuffer<u32> for Claims {}
//! ```

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::SyncOnDrop;

use crate::cuda_error::{CudaError, Result};
use crate::engine::Engine;
use crate::pp::ReceivedSlot;
use crate::safe::{Context, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice};
use crate::sys::CUdeviceptr;

mod sealed {
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaStream, SyncOnDrop};

    use crate::sys::CUdeviceptr;

    /// How a cudarc buffer is lent for reading: its context, and its address and length with
    /// cudarc's ordering on `stream` (the stream waits for the buffer's last write; the returned
    /// record, dropped after this crate's reads, covers them).
    pub trait Lend<T> {
        fn cudarc_context(&self) -> &Arc<CudaContext>;
        fn lend<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, usize, SyncOnDrop<'a>);
    }

    /// How a cudarc buffer is lent for writing (the stream waits for its last write and its
    /// reads since).
    pub trait LendMut<T>: Lend<T> {
        fn lend_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, usize, SyncOnDrop<'a>);
    }
}

/// A cudarc buffer this crate may read: cudarc's `CudaSlice<T>`, `CudaView<'_, T>` and
/// `CudaViewMut<'_, T>`, and nothing else (sealed: the address and length come from cudarc's
/// own code, see the module docs).
///
/// ```no_run
/// use ppnrt::interop::{CudarcBuffer, EngineStream};
///
/// /// Sends any cudarc buffer of `f32` (a slice or a view of one) across boundary 0.
/// fn send(rt: &ppnrt::PpNRt, stream: &EngineStream, x: &impl CudarcBuffer<f32>, n: usize) -> ppnrt::Result<usize> {
///     stream.read(x, |view| rt.tx(0, &view, n))?
/// }
/// ```
pub trait CudarcBuffer<T>: sealed::Lend<T> {}

/// A cudarc buffer this crate may write: cudarc's `CudaSlice<T>` and `CudaViewMut<'_, T>`
/// (sealed).
///
/// ```no_run
/// use ppnrt::interop::{CudarcBufferMut, EngineStream};
///
/// /// Receives boundary 0's `slot` into any writable cudarc buffer of `f32`.
/// fn receive(rt: &ppnrt::PpNRt, stream: &EngineStream, dst: &mut impl CudarcBufferMut<f32>, slot: usize) -> ppnrt::Result<()> {
///     stream.write(dst, |mut view| rt.rx_into(0, slot, &mut view))?
/// }
/// ```
pub trait CudarcBufferMut<T>: CudarcBuffer<T> + sealed::LendMut<T> {}

/// cudarc's own `Lend` of its buffer types: their concrete `DevicePtr` / `DeviceSlice`
/// implementations, cudarc's code.
macro_rules! lend_impls {
    ($($ty:ty),*) => {$(
        impl<T> sealed::Lend<T> for $ty {
            fn cudarc_context(&self) -> &Arc<cudarc::driver::CudaContext> {
                cudarc::driver::DeviceSlice::stream(self).context()
            }
            fn lend<'a>(&'a self, stream: &'a cudarc::driver::CudaStream) -> (CUdeviceptr, usize, SyncOnDrop<'a>) {
                let (ptr, record) = cudarc::driver::DevicePtr::device_ptr(self, stream);
                (ptr, cudarc::driver::DeviceSlice::len(self), record)
            }
        }
        impl<T> CudarcBuffer<T> for $ty {}
    )*};
}
lend_impls!(cudarc::driver::CudaSlice<T>, cudarc::driver::CudaView<'_, T>, cudarc::driver::CudaViewMut<'_, T>);

macro_rules! lend_mut_impls {
    ($($ty:ty),*) => {$(
        impl<T> sealed::LendMut<T> for $ty {
            fn lend_mut<'a>(&'a mut self, stream: &'a cudarc::driver::CudaStream) -> (CUdeviceptr, usize, SyncOnDrop<'a>) {
                let len = cudarc::driver::DeviceSlice::len(self);
                let (ptr, record) = cudarc::driver::DevicePtrMut::device_ptr_mut(self, stream);
                (ptr, len, record)
            }
        }
        impl<T> CudarcBufferMut<T> for $ty {}
    )*};
}
lend_mut_impls!(cudarc::driver::CudaSlice<T>, cudarc::driver::CudaViewMut<'_, T>);

/// An engine's cudarc stream as a stream of this crate: the same `CUstream`, on the context this
/// crate shares with cudarc (the device's primary context). Every holder of
/// [`stream`](Self::stream) keeps cudarc's stream alive.
///
/// ```no_run
/// use ppnrt::{Engine, PpConfig, PpNRt, interop::EngineStream};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let cudarc_stream = ctx.default_stream();
/// let hidden = cudarc_stream.clone_htod(&[1.0f32; 256])?;
///
/// // The engine on the same context as cudarc's (the device's primary context).
/// let primary = Engine::new(0)?;
/// let engine_stream = EngineStream::new(&primary, &cudarc_stream)?;
/// let rt = PpNRt::new(PpConfig::new(2), &primary)?;
/// let slot = engine_stream.read(&hidden, |view| rt.tx(0, &view, 256))??;
/// let mut next = cudarc_stream.alloc_zeros::<f32>(256)?;
/// engine_stream.write(&mut next, |mut view| rt.rx_into(0, slot, &mut view))??;
/// # Ok(()) }
/// ```
pub struct EngineStream {
    /// cudarc's handle, given back under the crate's context rule (see `Drop`).
    theirs: ManuallyDrop<Arc<cudarc::driver::CudaStream>>,
    /// The same stream as this crate's, holding another `Arc` of cudarc's.
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
        let raw = stream.cu_stream().cast::<crate::sys::CUstream_st>();
        // SAFETY: the stream is a live stream of `engine`'s context (checked above), and the
        // wrapper owns an `Arc` of cudarc's stream, which keeps it live (cudarc destroys it when
        // its last `Arc` goes) for as long as the wrapper lives.
        let ours = unsafe { CudaStream::adopt_owned(engine.context(), raw, Box::new(Arc::clone(stream))) };
        Ok(EngineStream { theirs: ManuallyDrop::new(Arc::clone(stream)), ours })
    }

    /// The stream, as this crate's (use it for the engine's own work through this crate, or as a
    /// stage's stream): it holds cudarc's stream alive as long as anything holds it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.ours
    }

    /// The cudarc stream.
    pub fn cudarc_stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        &self.theirs
    }

    /// The stream's context (this crate's handle of cudarc's).
    fn context(&self) -> &Arc<Context> {
        self.ours.context()
    }

    /// Whether the driver sees the stream captured (a capture this crate did not begin: cudarc's
    /// own `begin_capture`, or another wrapper's of the same stream); an error counts as captured.
    fn captured_elsewhere(&self) -> bool {
        let raw = self.ours.raw();
        if raw.is_null() {
            return false; // the legacy default stream is never captured
        }
        let Ok(_bound) = self.context().bind() else { return true };
        // SAFETY: the stream is live (this wrapper holds cudarc's `Arc` of it) and not the legacy
        // default stream (checked above).
        !matches!(unsafe { crate::result::graph::is_capturing(raw) }, Ok(false))
    }

    /// Refuses a lend on a stream captured outside this crate (cudarc's ordering on entry would
    /// be captured, not enqueued).
    fn refuse_captured_elsewhere(&self, call: &'static str) -> Result<()> {
        if self.captured_elsewhere() {
            return Err(CudaError::Capture(crate::CaptureError::IllegalCall { call }));
        }
        Ok(())
    }

    /// Refuses a cudarc buffer of another context than the stream's.
    fn check_buffer(&self, what: &'static str, buffer: &cudarc::driver::CudaContext) -> Result<()> {
        if std::ptr::eq(buffer.cu_ctx().cast::<u8>(), self.context().raw().cast::<u8>()) {
            return Ok(());
        }
        let (expected, found) = (self.context().ordinal(), buffer.ordinal() as i32);
        if expected == found {
            Err(CudaError::WrongContext { what, device: expected })
        } else {
            Err(CudaError::WrongDevice { what, expected, found })
        }
    }

    /// Lends the cudarc buffer `src` to this crate for reading while `f` runs: `f` gets it as a
    /// [`CudaView`] to send (`tx`), copy from or hand a kernel; `read` returns what `f` returns.
    /// The engine's stream waits for the buffer's earlier cudarc writes first; when `f` returns
    /// or unwinds, the engine's stream waits for every use this crate made of the view, and
    /// cudarc's read event of the buffer is recorded there (cudarc's later writers wait for it).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] / [`CudaError::WrongContext`] for a buffer of another device or
    /// context than the stream's, [`CaptureError::IllegalCall`](crate::CaptureError) while the
    /// stream is capturing (`f` does not run).
    pub fn read<T, S, R>(&self, src: &S, f: impl FnOnce(CudaView<'_, T>) -> R) -> Result<R>
    where
        T: DeviceRepr,
        S: CudarcBuffer<T>,
    {
        self.check_buffer("EngineStream::read: the buffer must be of the stream's context", src.cudarc_context())?;
        // Dropped last (after cudarc's record): no capture of the engine's stream begins
        // meanwhile, so the lend's end is enqueued on it, not captured.
        let _scope = self.ours.lend_scope("EngineStream::read on a capturing stream")?;
        self.refuse_captured_elsewhere("EngineStream::read on a stream captured outside this crate")?;
        let (ptr, len, record) = self.context().call_foreign(|| src.lend(&self.theirs));
        // Declared before the slice, so dropped after it (also on unwind): cudarc's record then
        // covers the engine stream's wait for the crate's uses.
        let _record = AfterLend { record: ManuallyDrop::new(record), ctx: self.context(), on_host: Cell::new(false) };
        // SAFETY: `ptr` addresses `len` elements of `T` of the stream's device (cudarc's own
        // slice or view, of the stream's context: checked above); `src` is borrowed until this
        // returns, so cudarc neither frees nor writes it meanwhile, and its earlier writes are
        // ordered before the engine's stream (cudarc's `device_ptr`). The slice is dropped before
        // this returns (and every use the crate made is ordered before the engine's stream
        // then); `f` gets only a view borrowing it, and no capture can take the memory into a
        // graph that would outlive the lend (`lent_foreign`). No other slice of this crate covers the
        // memory meanwhile (each lend is its own, and the borrow keeps a write lend out). The end
        // is enqueued, not captured (rule 4, ordered in this frame): no capture of the engine's
        // stream begins during the lend (`_scope`), the slice's release is never deferred by a
        // capture elsewhere (`lent`), and a capture begun outside this crate is waited out on the
        // host (`LentSlice`).
        let lent = unsafe { CudaSlice::lent_foreign(ptr, len, &self.ours) };
        let slice = LentSlice { slice: lent, lender: self, end: &_record };
        Ok(f(slice.slice.as_view()))
    }

    /// Lends the cudarc buffer `dst` to this crate for writing while `f` runs: `f` gets it as a
    /// [`CudaViewMut`] to receive into (`rx_into`), copy into or hand a kernel; `write` returns
    /// what `f` returns. The engine's stream waits for the buffer's earlier cudarc reads and
    /// writes first; when `f` returns or unwinds, the engine's stream waits for every use this
    /// crate made of the view, and cudarc's write event of the buffer is recorded there
    /// (cudarc's later readers and writers wait for it).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] / [`CudaError::WrongContext`] for a buffer of another device or
    /// context than the stream's, [`CaptureError::IllegalCall`](crate::CaptureError) while the
    /// stream is capturing (`f` does not run).
    pub fn write<T, D, R>(&self, dst: &mut D, f: impl FnOnce(CudaViewMut<'_, T>) -> R) -> Result<R>
    where
        T: DeviceRepr,
        D: CudarcBufferMut<T>,
    {
        self.check_buffer("EngineStream::write: the buffer must be of the stream's context", dst.cudarc_context())?;
        let _scope = self.ours.lend_scope("EngineStream::write on a capturing stream")?;
        self.refuse_captured_elsewhere("EngineStream::write on a stream captured outside this crate")?;
        let theirs: &cudarc::driver::CudaStream = &self.theirs;
        let (ptr, len, record) = self.context().call_foreign(move || dst.lend_mut(theirs));
        let _record = AfterLend { record: ManuallyDrop::new(record), ctx: self.context(), on_host: Cell::new(false) };
        // SAFETY: as in `read`, with `dst` borrowed mutably until this returns: nothing else of
        // cudarc touches it meanwhile; its earlier reads and writes are ordered before the
        // engine's stream (cudarc's `device_ptr_mut`).
        let lent = unsafe { CudaSlice::lent_foreign(ptr, len, &self.ours) };
        let mut slice = LentSlice { slice: lent, lender: self, end: &_record };
        Ok(f(slice.slice.as_view_mut()))
    }

    /// Lends the slot that `received` holds ([`PpNRt::rx_in_place`](crate::PpNRt::rx_in_place))
    /// to `f` as a cudarc view, for the engine's kernels to read in place: no copy;
    /// `received_view` returns what `f` returns. The engine's stream is ordered after the slot's
    /// data arrived; with cudarc's event tracking on, cudarc's readers on other streams are too
    /// (the view's write event is recorded there), and when `f` returns or unwinds the engine's
    /// stream waits for them, so that the slot's next `tx`, ordered after the engine's stream
    /// when `received` drops, comes after every read. With the tracking off, read the view on
    /// this stream only (cudarc then leaves ordering across streams to the engine). A
    /// host-staged boundary's guard holds a copy; the view is then of the copy.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] when the slot is on another device than the stream,
    /// [`CaptureError::IllegalCall`](crate::CaptureError) while the stream is capturing (`f` does
    /// not run); the driver's error ([`crate::Error::Cuda`]).
    pub fn received_view<T, R>(
        &self,
        received: &mut ReceivedSlot<'_, T>,
        f: impl FnOnce(cudarc::driver::CudaView<'_, T>) -> R,
    ) -> crate::pp::Result<R>
    where
        T: DeviceRepr,
    {
        let (address, len, ordinal) = {
            let view = received.view()?;
            (view.device_ptr(), view.len(), view.ordinal())
        };
        if ordinal != self.ours.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "EngineStream::received_view: the slot must be on the stream's device",
                expected: self.ours.ordinal(),
                found: ordinal,
            }
            .into());
        }
        let _scope = self.ours.lend_scope("EngineStream::received_view on a capturing stream")?;
        self.refuse_captured_elsewhere("EngineStream::received_view on a stream captured outside this crate")?;
        received.order_on(&self.ours)?;
        let slice = self.context().call_foreign(|| {
            // SAFETY: the address holds `len` elements of `T` for as long as `received` lends
            // them, which outlasts this call (borrowed until it returns); the slice is never
            // freed by cudarc (`Unfreed` leaks it, on unwind too).
            let mut slice = unsafe { self.theirs.upgrade_device_ptr::<T>(address, len) };
            // cudarc's write event of the slice, recorded on the engine's stream after the wait
            // above: cudarc's readers on other streams wait for it.
            drop(cudarc::driver::DevicePtrMut::device_ptr_mut(&mut slice, &self.theirs));
            slice
        });
        let slice = Unfreed { slice: ManuallyDrop::new(slice), ctx: self.context() };
        Ok(f(slice.slice.as_view()))
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let theirs = unsafe { ManuallyDrop::take(&mut self.theirs) };
        // cudarc's drop of its last handle binds its context to destroy the stream.
        self.context().call_foreign(|| drop(theirs));
    }
}

/// A lent slice, in the lending function's frame: when it drops (on return or unwind) its
/// memory is released to the engine's stream (the stream waits for every use). Should something
/// outside this crate have begun capturing that stream meanwhile (cudarc's own `begin_capture`),
/// that wait would be captured, not enqueued: the uses are then waited for on the host, and
/// where even that fails (a capture mode that forbids it), the process aborts, since cudarc's
/// later work on the buffer would otherwise race the crate's.
struct LentSlice<'a, T: DeviceRepr> {
    slice: CudaSlice<T>,
    lender: &'a EngineStream,
    end: &'a AfterLend<'a>,
}

impl<T: DeviceRepr> Drop for LentSlice<'_, T> {
    fn drop(&mut self) {
        if !self.lender.captured_elsewhere() {
            return;
        }
        if let Err(e) = self.slice.wait_for_uses_on_host() {
            eprintln!(
                "ppnrt: aborting: a lend's end cannot be ordered: its stream was captured outside this crate during the lend, and waiting on the host failed: {e}"
            );
            std::process::abort();
        }
        // Every use is complete: cudarc's record, which would land in the capture, is not made.
        self.end.on_host.set(true);
    }
}

/// The end of a lend, in the lending function's frame (so it runs on return and on unwind, and
/// no caller can forget it): cudarc's record of its buffer's use, dropped after the crate's
/// slice (which made the engine's stream wait for the crate's uses), under the crate's context
/// rule.
struct AfterLend<'a> {
    record: ManuallyDrop<SyncOnDrop<'a>>,
    ctx: &'a Context,
    /// The crate's uses were waited for on the host (`LentSlice`): cudarc's record is not made.
    on_host: Cell<bool>,
}

impl Drop for AfterLend<'_> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let record = unsafe { ManuallyDrop::take(&mut self.record) };
        if self.on_host.get() {
            // Only references to cudarc's event and stream: nothing is leaked.
            std::mem::forget(record);
            return;
        }
        self.ctx.call_foreign(|| drop(record));
    }
}

/// A received slot as a cudarc slice, in `received_view`'s frame: never freed by cudarc. When it
/// drops (on return or unwind) the engine's stream waits for cudarc's reads of it (its tracked
/// events), under the crate's context rule, and the memory goes back to the slot.
struct Unfreed<'a, T> {
    slice: ManuallyDrop<cudarc::driver::CudaSlice<T>>,
    ctx: &'a Context,
}

impl<T> Drop for Unfreed<'_, T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        self.ctx.call_foreign(|| {
            slice.leak();
        });
    }
}
