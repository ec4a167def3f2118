//! The process-wide posting lock and the record of streams with NCCL work in flight: a receive
//! is posted into a stream capture only while no other NCCL call posts and no NCCL work runs
//! ([`PostingAlone`]).

use super::*;

/// Held shared by every send, receive and group of this process while it posts (from before the
/// communicators' call locks until NCCL has enqueued the work), and exclusively by a thread
/// posting into a stream capture ([`PostingAlone`]): NCCL's launch into a capture and another
/// thread's launch were seen to deadlock inside the driver (`docs/NCCL-BOUNDARY.md`, Tests).
pub(super) static POSTING: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds [`POSTING`] exclusively (its own calls then take nothing).
    static POSTING_ALONE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `post` holding [`POSTING`] shared, unless this thread holds it alone.
pub(super) fn posting<R>(post: impl FnOnce() -> R) -> R {
    if POSTING_ALONE.get() {
        return post();
    }
    let _shared = POSTING.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    post()
}

/// The NCCL work one communicator posted that may still run: each stream that carried one of
/// its sends, receives or launches of a graph holding one, whether it did since the stream's
/// event was last recorded, and that event. Noting a post costs no driver call: the event is
/// recorded only when a capture asks ([`settled`](Self::settled)), at the end of the stream then
/// (after the post, and after whatever the stream was given since, which only makes the answer
/// later). Written under [`POSTING`] (shared), read under it exclusively.
#[derive(Default)]
pub(super) struct InFlight {
    pub(super) streams: Mutex<Vec<PostedOn>>,
}

/// One stream of a communicator's [`InFlight`]. A released entry (`stream` taken, see
/// [`InFlight::note`]) was recorded after its last post: its `posted` is false and its `event`
/// set.
pub(super) struct PostedOn {
    pub(super) stream: Option<Arc<CudaStream>>,
    /// Posted on since `event` was recorded (or never recorded).
    pub(super) posted: bool,
    pub(super) event: Option<StreamEvent>,
}

impl PostedOn {
    /// Records the event at the end of the stream if it was posted on since the last record
    /// (while the stream is captured, the capture's own event before it: captured work runs only
    /// when launched, and a launch is noted itself).
    pub(super) fn record(&mut self) -> Result<()> {
        if let (true, Some(stream)) = (self.posted, &self.stream) {
            stream.record_after_enqueued(None, &mut self.event)?;
            self.posted = false;
        }
        Ok(())
    }

    /// Lets go of the stream when nothing else holds it (its caller dropped it), once its event
    /// is recorded (a failed record keeps it, for the next look).
    pub(super) fn release_if_unheld(&mut self) {
        if self.stream.as_ref().is_some_and(|held| Arc::strong_count(held) == 1) && self.record().is_ok() {
            self.stream = None;
        }
    }

    /// Whether the work posted on the stream has completed (queried, never waited for).
    pub(super) fn complete(&self) -> Result<bool> {
        match &self.event {
            Some(event) if !self.posted => Ok(event.is_complete()?),
            _ => Ok(false),
        }
    }
}

/// How many streams a communicator's [`InFlight`] holds before a new one makes it let go of
/// those nothing else holds.
pub(super) const IN_FLIGHT_STREAMS: usize = 8;

/// Every live communicator's [`InFlight`] (weakly: a communicator's drop takes its streams and
/// events, and the contexts they hold, with it); the dead ones are taken out when one is added.
pub(super) static COMMUNICATORS_IN_FLIGHT: Mutex<Vec<Weak<InFlight>>> = Mutex::new(Vec::new());

impl InFlight {
    /// A new one, registered in [`COMMUNICATORS_IN_FLIGHT`].
    pub(super) fn registered() -> Arc<InFlight> {
        let in_flight = Arc::new(InFlight::default());
        let mut all = COMMUNICATORS_IN_FLIGHT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        all.retain(|weak| weak.strong_count() > 0);
        all.push(Arc::downgrade(&in_flight));
        in_flight
    }

    /// Notes that work was just enqueued on `stream`. A stream new to this communicator, past
    /// [`IN_FLIGHT_STREAMS`] of them, first makes it let go of the streams only it holds (their
    /// callers dropped them), and the released entries whose event completed are taken out. So a
    /// caller that posts on a new stream each time keeps no stream alive here.
    pub(super) fn note(&self, stream: &Arc<CudaStream>) {
        let mut streams = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let noted = streams.iter_mut().find(|on| on.stream.as_ref().is_some_and(|held| held.id() == stream.id()));
        if let Some(on) = noted {
            on.posted = true;
            return;
        }
        if streams.len() >= IN_FLIGHT_STREAMS {
            streams.iter_mut().for_each(PostedOn::release_if_unheld);
            streams.retain(|on| on.stream.is_some() || !on.complete().unwrap_or(false));
        }
        streams.push(PostedOn { stream: Some(Arc::clone(stream)), posted: true, event: None });
    }

    /// Whether all the work noted has completed: an event recorded at the end of each stream
    /// posted on since its last one ([`PostedOn::record`]), then every stream's event queried.
    /// The streams whose event completed are taken out.
    ///
    /// # Errors
    /// An event record's or query's error.
    pub(super) fn settled(&self) -> Result<bool> {
        let mut streams = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        streams.iter_mut().try_for_each(PostedOn::record)?;
        let mut settled = true;
        let mut failed = None;
        streams.retain(|on| {
            let complete = failed.is_none()
                && on.complete().unwrap_or_else(|e| {
                    failed = Some(e);
                    false
                });
            settled &= complete;
            !complete
        });
        failed.map_or(Ok(settled), Err)
    }
}

/// Whether every live communicator's NCCL work has completed (see [`InFlight::settled`]).
///
/// # Errors
/// An event query's error.
pub(super) fn all_settled() -> Result<bool> {
    // Taken out of the list first: the list is not held across the driver calls below.
    let all: SmallVec<[Arc<InFlight>; 8]> = COMMUNICATORS_IN_FLIGHT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for in_flight in all {
        if !in_flight.settled()? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// [`POSTING`] held exclusively by this thread: while it lives, no other send or receive of the
/// process is in progress, and this thread's own go ahead (for posting into a capture).
pub(crate) struct PostingAlone {
    pub(super) _exclusive: RwLockWriteGuard<'static, ()>,
}

impl PostingAlone {
    /// The lock, if no send or receive of the process is being posted now and every one a live
    /// communicator posted before has completed on its GPU (no NCCL kernel of the process is
    /// running, which may wait for a peer that waits for this process); `None` else. Never waits
    /// (a call in progress may be waiting for a peer).
    ///
    /// # Errors
    /// An event query's error.
    pub(crate) fn try_settled() -> Result<Option<PostingAlone>> {
        let exclusive = match POSTING.try_write() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        if !all_settled()? {
            return Ok(None);
        }
        POSTING_ALONE.set(true);
        Ok(Some(PostingAlone { _exclusive: exclusive }))
    }
}

impl Drop for PostingAlone {
    fn drop(&mut self) {
        POSTING_ALONE.set(false);
    }
}
