//! Waiting for what a non-blocking communicator does in the background, bounded: polls, the
//! bounded abort, and the communicators' configuration.

use super::*;

/// Polls the communicator `raw` until what NCCL does for it in the background is done: `Ok`
/// when it completed, NCCL's error when it failed, `keep_waiting`'s error (checked between
/// polls, paced by [`poll_pause`]) when the caller stops waiting.
pub(super) fn poll_until_settled<E: From<NcclError>>(
    nccl: &Nccl,
    raw: ncclComm_t,
    mut keep_waiting: impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let mut polls = 0u32;
    loop {
        let mut state = ncclResult_t::ncclInProgress;
        // Contract: the communicator is live (joined, not destroyed); writes one result.
        nccl_call!(nccl, ncclCommGetAsyncError(raw, &mut state))?;
        if state != ncclResult_t::ncclInProgress {
            return Ok(nccl.check("ncclCommGetAsyncError (a call completing in the background)", state)?);
        }
        keep_waiting()?;
        poll_pause(&mut polls);
    }
}

/// The pause between two polls of something that usually completes within microseconds and may
/// take seconds: yields for the first 100 polls, then sleeps 200 µs per poll.
pub(crate) fn poll_pause(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    if *polls < 100 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The longest wait for NCCL's abort of a communicator ([`NcclError::AbortStuck`] after it).
pub const ABORT_BOUND: Duration = Duration::from_secs(10);

/// A communicator handle sent to the thread that aborts it.
pub(super) struct AbortedHandle(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread; the handle moves to the thread that
// aborts it, and nothing else uses it from then on (its owner refuses every later call).
unsafe impl Send for AbortedHandle {}

/// Calls `ncclCommAbort(raw)` (in `ctx`) and waits for it at most `bound`: NCCL's abort waits for
/// its own threads, and one stuck inside the driver would keep the caller for ever. The abort
/// runs on a thread of its own, which is left to finish when the bound passes
/// ([`NcclError::AbortStuck`], for `what`); where no thread can be started, on the caller's.
/// `raw` must be live and this its last use.
pub(super) fn abort_within(
    nccl: &'static Nccl,
    ctx: &Arc<Context>,
    raw: ncclComm_t,
    bound: Duration,
    what: &'static str,
) -> Result<ncclResult_t> {
    start_abort(nccl, ctx, raw).wait_until(Instant::now() + bound, bound, what)
}

/// An abort started by [`start_abort`]: its result, when it comes.
pub(super) enum AbortStarted {
    /// The abort runs on its own thread, which sends its result.
    Running(std::sync::mpsc::Receiver<Result<ncclResult_t>>),
    /// No thread could be started: the abort ran on the caller's.
    Done(Result<ncclResult_t>),
}

impl AbortStarted {
    /// Waits for the abort until `by` at most; an abort that ended meanwhile keeps its result
    /// (for [`wait_until`](Self::wait_until)), one still running goes on (and one whose thread
    /// ended without a result is found so there).
    pub(super) fn settle_by(&mut self, by: Instant) {
        if let AbortStarted::Running(result) = self {
            if let Ok(aborted) = result.recv_timeout(by.saturating_duration_since(Instant::now())) {
                *self = AbortStarted::Done(aborted);
            }
        }
    }

    /// The abort's result, waited for until `deadline` ([`NcclError::AbortStuck`] naming `what`
    /// and `bound` after it; the abort's thread is left to finish).
    pub(super) fn wait_until(self, deadline: Instant, bound: Duration, what: &'static str) -> Result<ncclResult_t> {
        match self {
            AbortStarted::Done(result) => result,
            AbortStarted::Running(result) => {
                match result.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(aborted) => aborted,
                    Err(_) => Err(NcclError::AbortStuck { what, waited: bound }),
                }
            }
        }
    }
}

/// Starts `ncclCommAbort(raw)` (in `ctx`) on a thread of its own and returns at once; where no
/// thread can be started, aborts on the caller's. NCCL sets the communicator's abort flag first,
/// so its kernels return soon after the start; its cleanup may then wait for the whole device.
/// `raw` must be live and this its last use.
pub(super) fn start_abort(nccl: &'static Nccl, ctx: &Arc<Context>, raw: ncclComm_t) -> AbortStarted {
    let abort = move |handle: AbortedHandle, ctx: Arc<Context>| {
        let _bound = ctx.bind()?;
        // Contract: the communicator is live and this is its last use (the caller's).
        nccl_result!(nccl, ncclCommAbort(handle.0))
    };
    let (done, result) = std::sync::mpsc::channel();
    let (handle, thread_ctx) = (AbortedHandle(raw), Arc::clone(ctx));
    let started = std::thread::Builder::new().name("ppnrt-nccl-abort".into()).spawn(move || {
        let _ = done.send(abort(handle, thread_ctx));
    });
    match started {
        Ok(_) => AbortStarted::Running(result),
        Err(_) => AbortStarted::Done(abort(AbortedHandle(raw), Arc::clone(ctx))),
    }
}

/// A communicator being joined: aborted when dropped unless its handle was taken (the join
/// succeeded); the abort is waited for at most `bound` ([`abort_within`]).
pub(super) struct JoinInProgress<'c> {
    pub(super) nccl: &'static Nccl,
    pub(super) ctx: &'c Arc<Context>,
    pub(super) raw: ncclComm_t,
    pub(super) bound: Duration,
}

impl Drop for JoinInProgress<'_> {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // The communicator was made by the join, nothing else holds it, and this is its last use.
        let aborted = abort_within(self.nccl, self.ctx, self.raw, self.bound, "NcclComm::init_rank_watched");
        if let Err(e) = aborted {
            record_drop_error(e);
        }
    }
}

/// A `keep_waiting` of [`poll_until_settled`] that stops waiting for `what` after `waited`.
pub(super) fn for_at_most(what: &'static str, waited: Duration) -> impl FnMut() -> Result<()> {
    let deadline = Instant::now().checked_add(waited);
    move || match deadline {
        Some(deadline) if Instant::now() >= deadline => Err(NcclError::TimedOut { what, waited }),
        _ => Ok(()),
    }
}

/// An `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` makes it (every choice left to NCCL), with
/// `blocking` set.
pub(super) fn config(blocking: bool) -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: crate::sys::nccl::NCCL_VERSION_CODE,
        blocking: c_int::from(blocking),
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
        graphUsageMode: CONFIG_UNDEF_INT,
        numRmaCtx: CONFIG_UNDEF_INT,
        maxP2pPeers: CONFIG_UNDEF_INT,
        graphStreamOrdering: CONFIG_UNDEF_INT,
        launchOrderImplicit: CONFIG_UNDEF_INT,
        numRmaSig: CONFIG_UNDEF_INT,
        rmaEagerInit: CONFIG_UNDEF_INT,
        hostCftMode: CONFIG_UNDEF_INT,
        nvlsHostMode: CONFIG_UNDEF_INT,
    }
}
