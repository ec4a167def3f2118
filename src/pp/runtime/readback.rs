//! The runtime's side of deferred readback: [`PpNRt::readback`], [`PpNRt::readback_of`] and
//! [`PpNRt::record_done`] (the readback itself is [`PendingReadback`]).

use std::sync::Arc;

use super::PpNRt;
use crate::error::{CudaError, CudaResult};
use crate::pp::error::Result;
use crate::pp::pending_readback::{PendingReadback, ReadbackBuffer, ReadbackSource};
use crate::pp::ring::MIN_SLOT_BYTES;
use crate::safe::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, DeviceSlice, EnqueueGate};

impl PpNRt {
    /// Records a fresh completion event on the last stage's stream (call after the step's final
    /// work, e.g. the logits matmul, has been enqueued there): an event to wait on, on the host or
    /// on another stream, for everything the step enqueued on the last stage.
    ///
    /// For reading a step's results back while later steps run, use [`readback`](Self::readback)
    /// instead: it waits for the results' own last write only, copies into pinned buffers it
    /// reuses, and never makes a stage stream wait for the copy. A pinned buffer allocated per
    /// step costs far more than the step (a 33 µs decode step took 1.58 ms so); done by hand,
    /// allocate it once:
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use ppnrt::{Engine, PinnedHostBuffer, PpNRt};
    /// let primary = Engine::new(0)?;
    /// let rt = PpNRt::get(&primary)?;
    /// let last = rt.n_stages() - 1;
    /// let readback = rt.readback_stream();
    /// // Once, before the decode loop:
    /// let mut host = PinnedHostBuffer::<f32>::new(readback.context(), 32_000, false)?;
    /// for _step in 0..3 {
    ///     let logits = {
    ///         let _scope = rt.enter(last)?;
    ///         rt.engine(last, &primary)?.alloc_zeroed::<f32>(32_000)? // the step's logits
    ///     };
    ///     let done = rt.record_done()?;
    ///     readback.wait(&done)?;
    ///     readback.memcpy_dtoh_pinned(&logits, &mut host)?;
    ///     let values: &[f32] = host.as_slice()?; // waits for the copy
    ///     let _ = values;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_done(&self) -> Result<CudaEvent> {
        let last = self.stage(self.stages.len() - 1)?;
        let event = CudaEvent::new(last.engine.context(), false)?;
        event.record(&last.stream)?;
        Ok(event)
    }

    /// Deferred readback of `source`, a buffer on the last stage's device (the step's logits, say):
    /// the readback stream waits for `source`'s last write (the step's work, enqueued before this
    /// call) and copies it into a pinned buffer from the runtime's ring; `source`'s free is moved
    /// to the readback stream, so no stage stream ever waits for the copy, and the buffer stays
    /// alive until the copy is done. Call it after the step's last work on `source` was enqueued.
    /// A buffer that a graph holds (the last stage's output in graph mode) keeps its owner: the
    /// graph frees it last, after the copy as every free; to read such a buffer back step after
    /// step without giving it up, use [`readback_of`](Self::readback_of).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use ppnrt::{Engine, PpNRt};
    /// let primary = Engine::new(0)?;
    /// let rt = PpNRt::get(&primary)?;
    /// let last = rt.n_stages() - 1;
    /// let logits = {
    ///     let _scope = rt.enter(last)?;
    ///     rt.engine(last, &primary)?.alloc_zeroed::<f32>(32_000)? // the step's logits
    /// };
    /// let pending = rt.readback(logits)?;
    /// // ... enqueue the next steps ...
    /// let values: &[f32] = pending.wait()?;
    /// # let _ = values; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`](crate::CudaError::WrongDevice) when `source` is not on the last stage's device; the driver's
    /// error (a pinned allocation the first time a size is read back).
    pub fn readback<T: DeviceRepr>(&self, source: CudaSlice<T>) -> Result<PendingReadback<T>> {
        self.check_readback_source("PpNRt::readback: the buffer must be on the last stage's device", &source)?;
        let (len, shared) = (source.len(), Arc::clone(&self.readbacks));
        match source.retire(&self.readback) {
            // The memory's only handle: freed on the readback stream, whose copy waits for the
            // step's write and then stands for the copy's read and the free (see `Retired`).
            Ok(mut retired) => {
                let host = self.start_readback(len * std::mem::size_of::<T>(), |host, stream, gate| {
                    host.copy_from_retired(stream, gate, &mut retired)
                })?;
                Ok(PendingReadback::new(host, len, ReadbackSource::Retired(retired), shared))
            }
            // A graph holds the memory and frees it last, after the copy as every free: the copy
            // is a read under the rule.
            Err(source) => {
                let host = self.start_readback(source.byte_len(), |host, stream, gate| {
                    host.copy_from(stream, gate, source.as_view().into_bytes())
                })?;
                Ok(PendingReadback::new(host, len, ReadbackSource::Given(source), shared))
            }
        }
    }

    /// Deferred readback of a buffer the caller keeps (the last stage's output buffer of captured
    /// step graphs, say): as [`readback`](Self::readback), but `source` stays the caller's. The
    /// copy is a read of `source` under the crate's ordering rule: the next write of `source`
    /// (the next step's, a graph's launch included) waits for it on the GPU, and its free does
    /// too. Prefer [`readback`](Self::readback) for a buffer of one step, which no stage stream
    /// then waits for.
    ///
    /// # Errors
    /// As [`readback`](Self::readback).
    pub fn readback_of<T: DeviceRepr, S: DeviceSlice<T>>(&self, source: &S) -> Result<PendingReadback<T>> {
        self.check_readback_source("PpNRt::readback_of: the buffer must be on the last stage's device", source)?;
        let host = self.start_readback(source.byte_len(), |host, stream, gate| {
            host.copy_from(stream, gate, source.as_view().into_bytes())
        })?;
        Ok(PendingReadback::new(host, source.len(), ReadbackSource::Kept, Arc::clone(&self.readbacks)))
    }

    /// Checks that `source` is on the last stage's device (`what` names the call and the rule,
    /// for the error).
    fn check_readback_source<T: DeviceRepr, S: DeviceSlice<T>>(&self, what: &'static str, source: &S) -> Result<()> {
        let device = self.stage(self.stages.len() - 1)?.engine.ordinal();
        if source.ordinal() != device {
            return Err(CudaError::WrongDevice { what, expected: device, found: source.ordinal() }.into());
        }
        Ok(())
    }

    /// Takes a pinned buffer of at least `bytes` from the ring (or allocates one) and enqueues
    /// `copy` into it on the readback stream, whose enqueue gate is held (refused while the
    /// stream is captured). On error the pinned buffer is given back to the ring (freed when the
    /// ring is full).
    fn start_readback(
        &self,
        bytes: usize,
        copy: impl FnOnce(&mut ReadbackBuffer, &Arc<CudaStream>, &EnqueueGate<'_>) -> CudaResult<()>,
    ) -> Result<Box<ReadbackBuffer>> {
        let reused = {
            let mut ring = self.readbacks.ring.lock();
            // The last given back first (the usual one of a size read back step after step).
            match ring.last() {
                Some(host) if host.len() >= bytes => ring.pop(),
                _ => ring.iter().position(|host| host.len() >= bytes).map(|at| ring.swap_remove(at)),
            }
        };
        let stream = &self.readback;
        let gate = stream.enqueue_gate_uncaptured("PpNRt::readback")?;
        let mut host = match reused {
            Some(host) => host,
            None => {
                let capacity = bytes.checked_next_power_of_two().unwrap_or(bytes).max(MIN_SLOT_BYTES);
                ReadbackBuffer::new(stream, capacity)?
            }
        };
        if let Err(e) = copy(&mut host, stream, &gate) {
            self.readbacks.give_back(host);
            return Err(e.into());
        }
        Ok(host)
    }

    /// The dedicated readback stream (in the last stage's context).
    pub fn readback_stream(&self) -> &Arc<CudaStream> {
        &self.readback
    }
}
