//! A communicator: its unique id, the join, sends and receives ordered by the crate's rule, the
//! error polling and the teardown.

use super::*;

/// A communicator's unique id: made by one rank ([`NcclUniqueId::new`]) and handed to every
/// other rank (as [`to_bytes`](Self::to_bytes), over any channel) before they join.
///
/// ```no_run
/// use ppnrt::nccl::NcclUniqueId;
/// # fn main() -> ppnrt::Result<()> {
/// // Rank 0 makes the id and sends its bytes to every other rank, over any channel.
/// let id = NcclUniqueId::new()?;
/// let bytes: [u8; NcclUniqueId::BYTES] = id.to_bytes();
/// // ... and each of them rebuilds it.
/// let received = NcclUniqueId::from_bytes(&bytes);
/// # let _ = received;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct NcclUniqueId(ncclUniqueId);

impl NcclUniqueId {
    /// Number of bytes in an id.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; it also starts NCCL's bootstrap listener on this host).
    ///
    /// # Errors
    /// [`NcclError`] when NCCL cannot be loaded or the call fails.
    pub fn new() -> Result<NcclUniqueId> {
        let nccl = nccl()?;
        let mut id = ncclUniqueId::default();
        // Contract: writes one id through a valid pointer.
        nccl_call!(nccl, ncclGetUniqueId(&mut id))?;
        Ok(NcclUniqueId(id))
    }

    /// The id as bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// An id received from the rank that made it.
    pub fn from_bytes(bytes: &[u8; Self::BYTES]) -> NcclUniqueId {
        NcclUniqueId(ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) })
    }
}

impl fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NcclUniqueId(..)")
    }
}

/// One rank's NCCL communicator, on one device. Dropping it destroys the communicator (after its
/// queued operations); [`abort`](Self::abort) ends it at once.
///
/// ```no_run
/// use ppnrt::nccl::{NcclComm, NcclUniqueId};
/// # fn main() -> ppnrt::Result<()> {
/// # let (rank, id_bytes) = (0, [0u8; NcclUniqueId::BYTES]);
/// let engine = ppnrt::Engine::new(0)?;
/// let id = NcclUniqueId::from_bytes(&id_bytes); // made by rank 0, received from it
/// let comm = NcclComm::init_rank(engine.context(), 2, &id, rank)?; // waits for both ranks
/// let stream = engine.stream()?;
/// let n = 1024;
/// if rank == 0 {
///     let x = engine.htod(&vec![1.0f32; n])?;
///     // SAFETY: rank 1 receives exactly n f32.
///     unsafe { comm.send(&stream, &x, 1)? };
/// } else {
///     let mut y = engine.alloc::<f32>(n)?;
///     // SAFETY: rank 0 sends exactly n f32.
///     unsafe { comm.recv(&stream, &mut y, 0)? };
/// }
/// # Ok(()) }
/// ```
pub struct NcclComm {
    pub(super) raw: ncclComm_t,
    pub(super) ctx: Arc<Context>,
    pub(super) rank: i32,
    pub(super) n_ranks: i32,
    /// NCCL communicators are not to be used by two threads at once: every call on this one
    /// holds this lock. It guards whether the communicator was aborted ([`abort_now`]
    /// (Self::abort_now)): no call reaches an aborted communicator.
    pub(super) calls: std::sync::Mutex<bool>,
    /// For a non-blocking communicator (joined by [`init_rank_watched`](Self::init_rank_watched)),
    /// whose calls NCCL may complete in the background: how long such a call is waited for
    /// before the communicator is aborted. `None` for a blocking one.
    pub(super) background_bound: Option<Duration>,
    /// Its work that may still run, looked at before a receive is captured ([`PostingAlone`]).
    pub(super) in_flight: Arc<InFlight>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; every call on it
// holds `calls`.
unsafe impl Send for NcclComm {}
// SAFETY: as above: `&NcclComm` only reaches the communicator through those calls.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `n_ranks`, on `ctx`'s device. Blocks until every
    /// rank has joined (`ncclCommInitRank`).
    ///
    /// # Errors
    /// [`NcclError::InvalidRank`] for a rank outside `0..n_ranks` or `n_ranks < 1`; NCCL's error.
    pub fn init_rank(ctx: &Arc<Context>, n_ranks: i32, id: &NcclUniqueId, rank: i32) -> Result<NcclComm> {
        if n_ranks < 1 || !(0..n_ranks).contains(&rank) {
            return Err(NcclError::InvalidRank { what: "NcclComm::init_rank", rank, n_ranks });
        }
        let nccl = nccl()?;
        let _bound = ctx.bind()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // Contract: writes the handle through a valid pointer; the rank is in 0..n_ranks (checked)
        // and the device's context is current (bound above).
        nccl_call!(nccl, ncclCommInitRank(&mut raw, n_ranks, id.0, rank))?;
        Ok(NcclComm::joined(raw, ctx, rank, n_ranks, None))
    }

    pub(super) fn joined(
        raw: ncclComm_t,
        ctx: &Arc<Context>,
        rank: i32,
        n_ranks: i32,
        background_bound: Option<Duration>,
    ) -> NcclComm {
        NcclComm {
            raw,
            ctx: Arc::clone(ctx),
            rank,
            n_ranks,
            calls: std::sync::Mutex::new(false),
            background_bound,
            in_flight: InFlight::registered(),
        }
    }

    /// Whether NCCL may complete this communicator's calls in the background.
    pub(super) fn nonblocking(&self) -> bool {
        self.background_bound.is_some()
    }

    /// Joins the communicator `id` as `rank` of `n_ranks`, on `ctx`'s device, without blocking
    /// for longer than the caller allows: NCCL joins in the background while this call polls
    /// it, calling `keep_waiting` between polls (about every 200 µs); when `keep_waiting` fails
    /// (a deadline passed, a peer was seen gone), the join is aborted and that error returned.
    /// A rank that never joins (it died or stopped after the id was handed out) therefore costs
    /// the caller what `keep_waiting` allows, not a hang: with [`init_rank`](Self::init_rank)
    /// NCCL waits for it for ever.
    ///
    /// The communicator is NCCL's non-blocking kind (see the [module docs](crate::nccl)): a later call
    /// that NCCL completes in the background (the first send or receive to a peer connects it)
    /// is waited for, at most `settle_within`; past that the communicator is aborted and the
    /// call fails with [`NcclError::TimedOut`]. A call whose wait fails otherwise (NCCL reports
    /// an error meanwhile, or its poll fails) aborts the communicator too, and returns that
    /// error: NCCL could go on with the call's work in the background, after its caller gave
    /// the buffer up. Every later call then returns [`NcclError::Aborted`].
    ///
    /// With an NCCL older than [`NONBLOCKING_VERSION`] this is `init_rank`: it blocks until
    /// every rank joined, whatever `keep_waiting` says.
    ///
    /// # Errors
    /// As [`init_rank`](Self::init_rank); `keep_waiting`'s error.
    pub fn init_rank_watched<E: From<NcclError>>(
        ctx: &Arc<Context>,
        n_ranks: i32,
        id: &NcclUniqueId,
        rank: i32,
        settle_within: Duration,
        keep_waiting: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<NcclComm, E> {
        let nccl = nccl()?;
        if nccl.version() < NONBLOCKING_VERSION || nccl.api.ncclCommInitRankConfig.is_err() {
            return Ok(NcclComm::init_rank(ctx, n_ranks, id, rank)?);
        }
        if n_ranks < 1 || !(0..n_ranks).contains(&rank) {
            return Err(NcclError::InvalidRank { what: "NcclComm::init_rank_watched", rank, n_ranks }.into());
        }
        let _bound = ctx.bind().map_err(NcclError::from)?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        let mut config = config(false);
        // Contract: writes the handle through a valid pointer; the rank is in 0..n_ranks
        // (checked), the configuration is initialised as NCCL_CONFIG_INITIALIZER does and lives
        // through the call (NCCL copies it), and the device's context is current (bound above).
        let started = nccl_result!(nccl, ncclCommInitRankConfig(&mut raw, n_ranks, id.0, rank, &mut config))?;
        // Aborted on every way out but success: an error, or `keep_waiting` panicking.
        let mut joining = JoinInProgress { nccl, ctx, raw, bound: settle_within.min(ABORT_BOUND) };
        match started {
            ncclResult_t::ncclSuccess => {}
            ncclResult_t::ncclInProgress if !raw.is_null() => poll_until_settled(nccl, raw, keep_waiting)?,
            other => nccl.check("ncclCommInitRankConfig", other)?,
        }
        joining.raw = std::ptr::null_mut();
        Ok(NcclComm::joined(raw, ctx, rank, n_ranks, Some(settle_within)))
    }

    /// Maps the result of `call`, which the caller made holding the call lock (`aborted`): a
    /// non-blocking communicator's `ncclInProgress` is waited for, at most `settle_within`.
    /// A call that does not settle (past the bound, its poll failed, or NCCL reported an error
    /// meanwhile) aborts the communicator before this returns: NCCL may still be enqueueing the
    /// call's work in the background, after the caller noted the buffer's use and gave the
    /// buffer up (a failed call's buffer is freed at once), and that work must never run
    /// unaborted. After the abort, whatever was enqueued is in its stream, aborted.
    pub(super) fn settle(
        &self,
        nccl: &Nccl,
        aborted: &mut MutexGuard<'_, bool>,
        call: &'static str,
        result: ncclResult_t,
    ) -> Result<()> {
        let Some(bound) = self.background_bound.filter(|_| result == ncclResult_t::ncclInProgress) else {
            return nccl.check(call, result);
        };
        let settled = poll_until_settled(nccl, self.raw, for_at_most(call, bound));
        if settled.is_err() {
            if let Err(e) = self.abort_locked(aborted) {
                record_drop_error(e);
            }
        }
        settled
    }

    /// This rank.
    pub fn rank(&self) -> i32 {
        self.rank
    }

    /// The number of ranks.
    pub fn n_ranks(&self) -> i32 {
        self.n_ranks
    }

    /// The lock of every call, refusing an aborted communicator.
    pub(super) fn one_call(&self, what: &'static str) -> Result<std::sync::MutexGuard<'_, bool>> {
        let aborted = self.calls.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if *aborted {
            return Err(NcclError::Aborted { what });
        }
        Ok(aborted)
    }

    pub(super) fn check_peer(&self, what: &'static str, peer: i32, stream: &CudaStream, device: i32) -> Result<()> {
        if !(0..self.n_ranks).contains(&peer) {
            return Err(NcclError::InvalidRank { what, rank: peer, n_ranks: self.n_ranks });
        }
        let device_of = |what, found| {
            if found == self.ctx.ordinal() {
                Ok(())
            } else {
                Err(NcclError::Cuda(CudaError::WrongDevice { what, expected: self.ctx.ordinal(), found }))
            }
        };
        device_of("NcclComm: the stream must be on the communicator's device", stream.ordinal())?;
        device_of("NcclComm: the buffer must be on the communicator's device", device)?;
        Ok(())
    }

    /// Sends `buf` to rank `peer` on `stream`, ordered like a copy that reads `buf`. The matching
    /// [`recv`](Self::recv) of as many bytes must be issued by `peer` (a rank sending to itself
    /// issues both inside one [`group`]).
    ///
    /// # Safety
    /// `peer`'s matching receive is of exactly `buf`'s bytes. NCCL does not check that the two
    /// counts agree, and a send longer than its receive may write past the receiving buffer
    /// (NCCL's direct path writes into the peer's memory); one shorter leaves the receive waiting
    /// or delivers part of a later message. Carry the count to the peer first (as the pipeline's
    /// sealed records do) when it is not fixed by the program.
    ///
    /// # Errors
    /// [`NcclError::InvalidRank`]; [`CudaError::WrongDevice`] for a stream or buffer of another
    /// device; NCCL's error.
    pub unsafe fn send<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        stream: &Arc<CudaStream>,
        buf: &S,
        peer: i32,
    ) -> Result<()> {
        self.check_peer("NcclComm::send", peer, stream, buf.ordinal())?;
        // SAFETY: the caller's contract is this function's.
        let op = unsafe { P2p::send(self, stream, buf, peer) };
        self.alone(&op, "NcclComm::send")
    }

    /// Receives from rank `peer` into `buf` on `stream`, ordered like a copy that writes `buf`.
    ///
    /// # Safety
    /// `peer`'s matching send is of exactly `buf`'s bytes (see [`send`](Self::send)): a longer
    /// send may write past `buf`.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub unsafe fn recv<T: DeviceRepr, D: DeviceSliceMut<T>>(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut D,
        peer: i32,
    ) -> Result<()> {
        self.check_peer("NcclComm::recv", peer, stream, buf.ordinal())?;
        // SAFETY: the caller's contract is this function's.
        let op = unsafe { P2p::recv(self, stream, buf, peer) };
        self.alone(&op, "NcclComm::recv")
    }

    /// Issues `op`, a send or receive of this communicator, outside a group, ordered like a copy
    /// of its buffer; when NCCL completes it in the background, it is waited for (bounded)
    /// before the ordering rule notes the use. Once NCCL took the call, the use is noted whatever
    /// the call returns: a call that failed may have enqueued work (one that did not settle
    /// aborted the communicator first, see [`settle`](Self::settle), so that work is in the
    /// stream by then), and the buffer's next use, or its free, waits for it.
    pub(super) fn alone(&self, op: &P2p<'_>, what: &'static str) -> Result<()> {
        let nccl = nccl()?;
        posting(|| {
            let mut one_call = self.one_call(what)?;
            let posted: Result<Result<()>> = ordered_as(op.stream(), [op.ordered_use()], true, || {
                let result = op.raw_call(nccl)?;
                // Enqueued once settled: the ordering rule marks the buffer after this returns.
                Ok(self.settle(nccl, &mut one_call, op.call_name(), result))
            });
            // Noted whatever the call returned: a failed call may have enqueued work.
            self.in_flight.note(op.stream());
            posted?
        })
    }

    /// Launches work that holds an operation of this communicator (a graph that captured a send
    /// or receive of it) on `stream` as a send or receive is posted: holding the process's
    /// posting lock shared, with an event after the work noted as this communicator's work that
    /// may still run (see [`PostingAlone`]).
    ///
    /// # Errors
    /// `launch`'s error.
    pub(crate) fn posting_launch<E>(
        &self,
        stream: &Arc<CudaStream>,
        launch: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        posting(|| {
            launch()?;
            self.in_flight.note(stream);
            Ok(())
        })
    }

    /// The communicator's asynchronous error, if any (a peer that failed or vanished, a network
    /// error): `Ok(())` while none occurred (and while a non-blocking communicator completes a
    /// call in the background).
    ///
    /// # Errors
    /// The asynchronous error as [`NcclError::Call`], or the query's own failure.
    pub fn async_error(&self) -> Result<()> {
        let nccl = nccl()?;
        let one_call = self.one_call("NcclComm::async_error")?;
        self.async_error_locked(nccl, &one_call)
    }

    /// [`async_error`](Self::async_error) unless another thread's call holds the communicator
    /// (a call a non-blocking communicator completes in the background may hold it until its
    /// bound): then `Ok(())` at once, and the next look checks. For a watchdog, which must not
    /// wait on the calls it watches.
    ///
    /// # Errors
    /// As [`async_error`](Self::async_error).
    pub fn async_error_if_idle(&self) -> Result<()> {
        let nccl = nccl()?;
        let one_call = match self.calls.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        if *one_call {
            return Err(NcclError::Aborted { what: "NcclComm::async_error_if_idle" });
        }
        self.async_error_locked(nccl, &one_call)
    }

    pub(super) fn async_error_locked(&self, nccl: &Nccl, _one_call: &MutexGuard<'_, bool>) -> Result<()> {
        let mut state = ncclResult_t::ncclSuccess;
        // Contract: the communicator is live while self is; writes one result.
        nccl_call!(nccl, ncclCommGetAsyncError(self.raw, &mut state))?;
        if state == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        nccl.check("ncclCommGetAsyncError (asynchronous error)", state)
    }

    /// Ends the communicator at once, abandoning its queued operations (after a peer failed).
    ///
    /// # Errors
    /// NCCL's error.
    pub fn abort(self) -> Result<()> {
        self.abort_now()
    }

    /// Ends the communicator at once from any thread, abandoning its queued operations (their
    /// kernels return, so the streams they sit on drain): the way out when a peer failed while
    /// other threads still hold the communicator. Every later call on it returns
    /// [`NcclError::Aborted`]; a second abort does nothing.
    ///
    /// # Errors
    /// NCCL's error.
    pub fn abort_now(&self) -> Result<()> {
        let mut aborted = self.calls.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.abort_locked(&mut aborted)
    }

    /// Aborts every communicator of `comms` at once, as [`abort_now`](Self::abort_now) does one:
    /// each abort is started before any is waited for. An abort's cleanup may wait for the
    /// whole device, so one after the other, the first could wait for a kernel of the next,
    /// which only that next abort ends. Each result in the order of `comms` (`Ok` for one
    /// aborted before); the aborts are waited for at most the longest of their bounds.
    pub fn abort_together(comms: &[&NcclComm]) -> Vec<Result<()>> {
        Self::abort_first_then(comms, &[], Duration::ZERO)
    }

    /// [`abort_together`](Self::abort_together) in two waves: the aborts of `first` start, and
    /// are given up to `head_start` to end, before those of `then` start; then every abort is
    /// waited for, at most the longest of their bounds. For a rank whose failed link's receive
    /// must not be cut short (letting its stream run on) before the rank's other communicators
    /// are aborted: an abort sets its communicator's abort flag first, so a send queued behind
    /// that receive can no longer complete. The head start is bounded because an abort's cleanup
    /// may wait for the whole device, which may wait for the receive that only `then`'s abort
    /// ends. Each result in the order of `first`, then `then`.
    pub fn abort_first_then(first: &[&NcclComm], then: &[&NcclComm], head_start: Duration) -> Vec<Result<()>> {
        let nccl = match nccl() {
            Ok(nccl) => nccl,
            Err(e) => return first.iter().chain(then).map(|_| Err(e.clone())).collect(),
        };
        let start = |comms: &[&NcclComm]| -> Vec<Option<AbortStarted>> {
            comms
                .iter()
                .map(|comm| {
                    let mut aborted = comm.calls.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    if *aborted {
                        return None;
                    }
                    *aborted = true;
                    // The communicator is live (not aborted before, checked under the lock every
                    // call holds) and this is its last use: the flag set above refuses every later
                    // call, and the drop.
                    Some(start_abort(nccl, &comm.ctx, comm.raw))
                })
                .collect()
        };
        let mut started = start(first);
        if !then.is_empty() && !head_start.is_zero() {
            let head_start_ends = Instant::now() + head_start;
            for abort in started.iter_mut().flatten() {
                abort.settle_by(head_start_ends);
            }
        }
        started.extend(start(then));
        let comms: Vec<&NcclComm> = first.iter().chain(then).copied().collect();
        let bound = comms.iter().map(|comm| comm.abort_bound()).max().unwrap_or(ABORT_BOUND);
        let deadline = Instant::now() + bound;
        comms
            .iter()
            .zip(started)
            .map(|(comm, started)| match started {
                None => Ok(()),
                Some(started) => {
                    let result = started.wait_until(deadline, bound, "NcclComm::abort_together")?;
                    comm.check_teardown(nccl, "ncclCommAbort", result)
                }
            })
            .collect()
    }

    /// [`abort_now`](Self::abort_now) with the call lock (`aborted`) held.
    pub(super) fn abort_locked(&self, aborted: &mut MutexGuard<'_, bool>) -> Result<()> {
        if **aborted {
            return Ok(());
        }
        **aborted = true;
        let nccl = nccl()?;
        // The communicator is live (not aborted before, checked under the lock every call holds)
        // and this is its last use: the flag set above refuses every later call, and the drop.
        let result = abort_within(nccl, &self.ctx, self.raw, self.abort_bound(), "NcclComm::abort_now")?;
        self.check_teardown(nccl, "ncclCommAbort", result)
    }

    /// How long an abort of this communicator is waited for: its background bound, at most
    /// [`ABORT_BOUND`].
    pub(super) fn abort_bound(&self) -> Duration {
        self.background_bound.map_or(ABORT_BOUND, |bound| bound.min(ABORT_BOUND))
    }

    /// Maps the result of the abort or destroy `call`: a non-blocking communicator may finish
    /// either in the background (`ncclInProgress`), which is no error, as it is not used again.
    pub(super) fn check_teardown(&self, nccl: &Nccl, call: &'static str, result: ncclResult_t) -> Result<()> {
        if result == ncclResult_t::ncclInProgress && self.nonblocking() {
            return Ok(());
        }
        nccl.check(call, result)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if *self.calls.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()) {
            return;
        }
        let result = nccl().and_then(|nccl| {
            let _bound = self.ctx.bind()?;
            // A communicator whose peer failed is aborted (destroying it would wait for
            // operations that never complete); a healthy one is destroyed after its work.
            // Contract (all three calls): the communicator is live and this drop is its last use.
            let mut state = ncclResult_t::ncclSuccess;
            let healthy = nccl_call!(nccl, ncclCommGetAsyncError(self.raw, &mut state)).is_ok()
                && matches!(state, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress);
            // A non-blocking communicator is finalized first (in the background, waited for at
            // most its bound; an abort if it does not finish), as NCCL asks of that kind.
            let finalized = healthy && self.background_bound.is_none_or(|bound| self.finalize(nccl, bound).is_ok());
            let (call, result) = if finalized {
                ("ncclCommDestroy", nccl_result!(nccl, ncclCommDestroy(self.raw))?)
            } else {
                ("ncclCommAbort", abort_within(nccl, &self.ctx, self.raw, self.abort_bound(), "NcclComm::drop")?)
            };
            self.check_teardown(nccl, call, result)
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl NcclComm {
    /// Finalizes a non-blocking communicator (its drop), waiting at most `bound`; the
    /// error is recorded as a drop error.
    pub(super) fn finalize(&self, nccl: &Nccl, bound: Duration) -> Result<()> {
        // Contract: the communicator is live and its drop is its only user now.
        let result = nccl_result!(nccl, ncclCommFinalize(self.raw)).and_then(|result| {
            if result != ncclResult_t::ncclInProgress {
                return nccl.check("ncclCommFinalize", result);
            }
            poll_until_settled(nccl, self.raw, for_at_most("ncclCommFinalize", bound))
        });
        if let Err(e) = &result {
            record_drop_error(e.clone());
        }
        result
    }
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("n_ranks", &self.n_ranks)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}
