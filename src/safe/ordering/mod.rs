//! The ordering rule, in one place: every copy, memset and kernel launch orders the buffers it
//! touches itself.
//!
//! Each buffer (device slice or pinned host buffer) carries an [`Access`]: the stream of its last
//! write and the streams that read it since, each as a *mark*. Before an operation on stream `S`:
//!
//! - a read waits for the last write, a write waits for the last write and every read since;
//! - a mark on `S` itself needs nothing (stream order); a mark on another stream is waited on
//!   through an event recorded after that use (`cuStreamWaitEvent`, which works across devices),
//!   once: a mark remembers the last stream that waited for its event, until the event is
//!   recorded again (so a buffer written once and read by many kernels on another stream costs
//!   that stream one wait).
//!
//! After the operation is enqueued, `S` becomes the buffer's last writer, or one of its readers.
//! Freeing orders the owning stream after every mark the same way (or, for `cuMemFree` and pinned
//! memory, waits on the host).
//!
//! Events come from a per-context pool and are recorded only when needed: a mark gets its event
//! when another stream first has to wait on it (recorded then, at the end of the marked stream,
//! which is after the use), unless the buffer is *eager*, whose every use records its event at
//! once (the pipeline's slot buffers: the event then sits right after the copy, not behind later
//! work of the stream). So work that stays on one stream costs no driver call at all, and no
//! stream is ever queried. The rule is host-side bookkeeping plus event records and waits, which
//! are also what a stream capture turns into graph dependencies.
//!
//! The plain path: a buffer whose state records only the last write of one stream, with no event
//! and no read since (its usual state: made on a stream, used there), carries that stream's id in
//! an atomic tag. Work on that stream has nothing to wait for and nothing to note, so it takes no
//! lock: it claims the tag for the span of its enqueue instead, and whoever locks the state takes
//! the tag down first, waiting out a claim (so that its waits and records come after the claimed
//! work), and puts up the state's new tag as it unlocks ([`Access::plain`]; the `plain` module).
//!
//! Threading: the bookkeeping is behind a mutex per buffer, held only for the span of one
//! operation. An operation holds the locks of its buffers (in address
//! order) from its waits to its notes ([`Access::around`], [`Access::around_two`],
//! [`HeldAccesses`]), except while a caller's kernel-parameter code runs, which may use the same
//! buffers through the crate; a host wait for a buffer ([`Access::wait_on_host`]) waits with it
//! unlocked. A write needs `&mut` of the buffer, so no
//! read can race with it from safe code; concurrent reads from several threads are recorded each
//! under the lock. A graph holds its buffers by `Arc`, so two graphs writing one buffer can be
//! launched at once from two threads: each launch keeps its whole footprint locked from the waits
//! to the notes, so the second is ordered after the first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use smallvec::SmallVec;

use super::capture::{queries_allowed, refuse_in_capture};
use super::event_pool::{PooledEvent, StreamEvent};
use super::stream::{CudaStream, EnqueueGate};
use crate::cuda_error::{CudaError, Result};
pub(crate) use own::{OwnOrder, Owned};
use plain::plain_on;

mod hand;
mod own;
mod plain;

/// How an operation uses a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// Reads it: waits for the last write.
    Read,
    /// Writes it: waits for the last write and every read since.
    Write,
    /// Writes one aligned word that other uses may overlap (a stream memory operation's
    /// write-value, which releases the wait-values reading it): waits for nothing but its own
    /// stream's earlier work (any wait for another stream's mark could be a wait for the very
    /// wait-value it releases: a mark's event is recorded at the end of its stream), and is noted
    /// like a read, so later writes and the release wait for it.
    Signal,
}

/// Read marks a buffer keeps holding their streams: past this many, the older ones are detached
/// (see [`detach_reads`]).
const ATTACHED_READS: usize = 4;

/// One use of a buffer: the stream it was enqueued on, and an event recorded after it (made when
/// first needed).
#[derive(Debug)]
struct Mark {
    /// The stream of the use; `None` once the mark is detached: its event recorded after the use,
    /// the stream let go (see [`detach_reads`]).
    stream: Option<Arc<CudaStream>>,
    /// The [`id`](CudaStream::id) of the use's stream, kept when the mark is detached: that
    /// stream's next read takes the mark up again rather than adding one.
    stream_id: u64,
    /// Shared while the stream is captured (see [`CudaStream::event_after_enqueued`]) or while a
    /// host wait holds it (see [`Access::wait_on_host`]).
    event: Option<StreamEvent>,
    /// The last stream made to wait for `event` as it is recorded now (outside a capture), by
    /// its [`id`](CudaStream::id), which no other stream ever gets (a raw handle may be reused
    /// once its stream is destroyed): that stream's later work is ordered after the use already
    /// and needs no second wait. Cleared whenever `event` is recorded again or dropped.
    waited_by: Option<u64>,
}

impl Mark {
    fn new(stream: &Arc<CudaStream>) -> Mark {
        Mark { stream: Some(Arc::clone(stream)), stream_id: stream.id(), event: None, waited_by: None }
    }

    /// Whether the use was enqueued on `stream` (for a detached mark, the very stream, by its id).
    #[inline]
    fn is_on(&self, stream: &CudaStream) -> bool {
        match self.stream.as_deref() {
            Some(own) => same_stream(own, stream),
            None => self.stream_id == stream.id(),
        }
    }

    /// Makes `stream` (another stream than the mark's) wait for the use, unless it already did
    /// for the event as recorded now.
    #[inline]
    fn wait_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.waited_by == Some(stream.id()) {
            return Ok(());
        }
        stream.wait_pooled(self.event()?)?;
        // A wait made during a capture lands in the graph, not on the stream: remembered only
        // outside one.
        self.waited_by = (!stream.is_capturing()).then(|| stream.id());
        Ok(())
    }

    /// The mark's event (recorded now if it has none), shared with the mark: for a host wait
    /// made without the buffer's state locked.
    fn shared_event(&mut self) -> Result<Arc<PooledEvent>> {
        self.event()?;
        let shared = match self.event.take().expect("set above") {
            StreamEvent::Shared(event) => event,
            StreamEvent::Own(event) => Arc::new(event),
        };
        self.event = Some(StreamEvent::Shared(Arc::clone(&shared)));
        Ok(shared)
    }

    /// Whether the mark's event is `event`, as shared by [`shared_event`](Self::shared_event).
    fn holds(&self, event: &Arc<PooledEvent>) -> bool {
        matches!(&self.event, Some(StreamEvent::Shared(own)) if Arc::ptr_eq(own, event))
    }

    /// The mark's event, recorded now at the end of its stream if it has none yet (or, while the
    /// stream is being captured, the event recorded when the capture began).
    #[inline]
    fn event(&mut self) -> Result<&PooledEvent> {
        if self.event.is_none() {
            self.record_event_now()?;
        }
        Ok(self.event.as_deref().expect("set above"))
    }

    /// [`event`](Self::event) for a mark with none yet: records one now at the end of its
    /// stream.
    #[inline(never)]
    fn record_event_now(&mut self) -> Result<()> {
        self.waited_by = None;
        let stream = self.stream.as_ref().expect("a detached mark keeps its event");
        self.event = Some(stream.event_after_enqueued(None)?);
        Ok(())
    }
}

/// The use that orders a buffer used both ways by one operation: either one when they agree or
/// one is a read, else a write (which waits for everything a signal does, and more). Out of
/// line: only a buffer given twice to one operation needs it, and the copy's path stays as it
/// was without it.
#[cold]
#[inline(never)]
fn stronger(a: Use, b: Use) -> Use {
    match (a, b) {
        (a, b) if a == b => a,
        (Use::Read, other) | (other, Use::Read) => other,
        _ => Use::Write,
    }
}

/// A buffer state's address: the order in which several are locked together.
fn address(access: &Access) -> usize {
    std::ptr::from_ref(access) as usize
}

#[inline]
fn same_stream(a: &CudaStream, b: &CudaStream) -> bool {
    std::ptr::eq(a, b) || (a.raw() == b.raw() && Arc::ptr_eq(a.context(), b.context()))
}

#[derive(Debug, Default)]
struct State {
    write: Option<Mark>,
    /// The reads since `write`, one mark per stream: inline for the usual one (a buffer made on
    /// one stream and read on another), so a fresh buffer's first read allocates nothing. An
    /// eager buffer keeps its read marks across writes (see [`note_marks`]).
    reads: SmallVec<[Mark; 1]>,
}

/// The ordering state of one buffer. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Access {
    state: Mutex<State>,
    /// The stream whose work alone the state records, with nothing recorded or waited for (see
    /// [`plain_on`]), by its [`id`](CudaStream::id); 0 when there is none. An operation on that
    /// stream then has nothing to wait for and nothing to note: it takes no lock, but claims the
    /// tag ([`PLAIN_CLAIMED`](plain::PLAIN_CLAIMED)) for the span of its enqueue ([`Access::claim_plain`]). Whoever
    /// locks the state takes the tag down first, waiting out a claim, so that its waits and
    /// records come after the claimed enqueue, and puts up the state's new tag as it unlocks
    /// ([`Locked`]).
    plain: AtomicU64,
    eager: bool,
}

/// A buffer's state, locked, with its plain tag taken down (see [`Access::plain`]): put up again
/// for the state as it is when the guard drops, before the lock is released.
struct Locked<'a> {
    access: &'a Access,
    state: MutexGuard<'a, State>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Locked<'_> {
    /// Orders `stream` for the buffer's `use_`, runs `enqueue`, and notes the use, all under this
    /// lock: the one span of [`Access::around`] and [`Access::around_two`]'s. A failed note waits
    /// for `stream` (see [`CudaStream::settle`]).
    #[inline(always)]
    fn around<R, E: From<CudaError>>(
        &mut self,
        use_: Use,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        enqueue: impl FnOnce() -> Result<R, E>,
    ) -> Result<R, E> {
        order_locked(self, stream, use_)?;
        let result = enqueue()?;
        let eager = self.access.eager;
        stream.settle(note_locked(self, stream, use_, eager, Some(gate)))?;
        Ok(result)
    }
}

impl Drop for Locked<'_> {
    #[inline]
    fn drop(&mut self) {
        let tag = plain_on(&self.state, self.access.eager);
        if tag != 0 {
            // Release: what the lock holder enqueued comes before a claim's enqueue.
            self.access.plain.store(tag, Ordering::Release);
        }
    }
}

impl Access {
    /// A buffer just allocated in stream order on `owner` (its allocation is the last write), or
    /// with no pending use (`None`).
    #[inline]
    pub(crate) fn new(owner: Option<&Arc<CudaStream>>, eager: bool) -> Access {
        let state = State { write: owner.map(Mark::new), reads: SmallVec::new() };
        let plain = AtomicU64::new(plain_on(&state, eager));
        Access { state: Mutex::new(state), plain, eager }
    }

    /// The state, locked, its plain tag taken down (see [`Access::plain`]).
    #[inline]
    fn lock(&self) -> Locked<'_> {
        // The state is updated in single assignments; a panic elsewhere cannot leave it torn (the
        // lock does not poison).
        let state = self.state.lock();
        self.take_down_plain();
        Locked { access: self, state }
    }

    /// Makes `stream` wait for the uses that `use_` conflicts with: the last write, and for a
    /// write every read since. Uses on `stream` itself need nothing, nor do uses `stream` already
    /// waited for.
    pub(crate) fn order(&self, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
        order_locked(&mut self.lock(), stream, use_)
    }

    /// [`order`](Self::order) through exclusive access (the buffer's last owner, freeing it):
    /// no lock to take.
    #[inline]
    pub(crate) fn order_exclusive(&mut self, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
        // Plain on `stream` (see `Access::plain`; no claim can be held here): nothing to wait
        // for, and the state and its tag stay as they are.
        if *self.plain.get_mut() == stream.id() {
            return Ok(());
        }
        self.order_exclusive_locked(stream, use_)
    }

    /// [`order_exclusive`](Self::order_exclusive) off the plain path.
    #[inline(never)]
    fn order_exclusive_locked(&mut self, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
        let state = self.state.get_mut();
        // The tag follows the state, ordered or not (the result is not held across: on success
        // nothing is moved).
        if let Err(e) = order_locked(state, stream, use_) {
            *self.plain.get_mut() = plain_on(state, self.eager);
            return Err(e);
        }
        *self.plain.get_mut() = plain_on(state, self.eager);
        Ok(())
    }

    /// Notes that an operation using the buffer was just enqueued on `stream`. For an eager
    /// buffer this records the use's event now (the only call here that can fail; the caller
    /// then waits for `stream`, see [`CudaStream::settle`]).
    pub(crate) fn note(&self, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
        note_locked(&mut self.lock(), stream, use_, self.eager, None)
    }

    /// Orders `stream` for this buffer's `use_`, runs `enqueue`, and notes the use, with the
    /// buffer's state locked once for the whole span. `gate` is `stream`'s enqueue gate, held by
    /// the caller, which saw the stream not capturing under it. A failed note waits for `stream`
    /// (see [`CudaStream::settle`]).
    #[inline(always)]
    pub(crate) fn around<R, E: From<CudaError>>(
        &self,
        use_: Use,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        enqueue: impl FnOnce() -> Result<R, E>,
    ) -> Result<R, E> {
        if let Some(_claim) = self.claim_plain(stream.id()) {
            // Nothing to wait for, nothing to note (see `Access::plain`).
            return enqueue();
        }
        self.lock().around(use_, stream, gate, enqueue)
    }

    /// [`around`](Self::around) for two buffers' uses (a copy's), both locked for the whole span,
    /// in address order; the same buffer twice is locked once, for the stronger use.
    #[inline(always)]
    pub(crate) fn around_two<R, E: From<CudaError>>(
        a: (&Access, Use),
        b: (&Access, Use),
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        enqueue: impl FnOnce() -> Result<R, E>,
    ) -> Result<R, E> {
        if std::ptr::eq(a.0, b.0) {
            let use_ = stronger(a.1, b.1);
            return a.0.around(use_, stream, gate, enqueue);
        }
        let stream_id = stream.id();
        match (a.0.looks_plain_for(stream_id), b.0.looks_plain_for(stream_id)) {
            (true, true) => {
                // Both tags were seen naming the stream just now: the claims alone.
                if let Some(_claim_a) = a.0.claim_plain_seen(stream_id) {
                    if let Some(_claim_b) = b.0.claim_plain_seen(stream_id) {
                        // Nothing to wait for, nothing to note for either (see `Access::plain`).
                        return enqueue();
                    }
                }
            }
            (plain_a, plain_b) if plain_a != plain_b => {
                let ((plain, _), (other, other_use)) = if plain_a { (a, b) } else { (b, a) };
                // The other buffer locked first, the claim then: a claim is never held while
                // waiting for a lock (whoever holds the plain buffer's lock may be waiting for
                // the other's, and would wait for the claim).
                let mut state = other.lock();
                // Seen naming the stream before the lock: the claim alone (it fails if the tag
                // changed meanwhile).
                if let Some(_claim) = plain.claim_plain_seen(stream_id) {
                    return state.around(other_use, stream, gate, enqueue);
                }
            }
            _ => {}
        }
        let (first, second) = if address(a.0) < address(b.0) { (a, b) } else { (b, a) };
        let mut first_state = first.0.lock();
        let mut second_state = second.0.lock();
        order_locked(&mut first_state, stream, first.1)?;
        order_locked(&mut second_state, stream, second.1)?;
        let result = enqueue()?;
        stream.settle(
            note_locked(&mut first_state, stream, first.1, first.0.eager, Some(gate))
                .and_then(|()| note_locked(&mut second_state, stream, second.1, second.0.eager, Some(gate))),
        )?;
        Ok(result)
    }

    /// Locks the states of several buffers together, for one operation from its waits to its
    /// notes (see [`HeldAccesses`]). A buffer given twice is locked once, for the stronger use.
    pub(crate) fn lock_all<'a>(uses: impl IntoIterator<Item = (&'a Access, Use)>) -> HeldAccesses<'a> {
        let mut uses: Vec<(&'a Access, Use)> = uses.into_iter().collect();
        // Address order: two threads locking overlapping sets take the common locks in one order.
        uses.sort_by_key(|(access, _)| address(access));
        let mut held: Vec<(&'a Access, Use, Locked<'a>)> = Vec::with_capacity(uses.len());
        for (access, use_) in uses {
            match held.last_mut() {
                Some((last, last_use, _)) if std::ptr::eq(*last, access) => {
                    *last_use = stronger(*last_use, use_);
                }
                _ => held.push((access, use_, access.lock())),
            }
        }
        HeldAccesses { held }
    }

    /// Drops the record of the reads since the last write, so that the next write does not wait
    /// for them. Only for deliberately broken protocols in hazard tests (the pipeline's protocol
    /// faults).
    #[cfg(feature = "testing")]
    pub(crate) fn forget_reads(&self) {
        self.lock().reads.clear();
    }

    /// Drops the record of the last write, so that the next read does not wait for it. Only for
    /// deliberately broken protocols in hazard tests.
    #[cfg(feature = "testing")]
    pub(crate) fn forget_write(&self) {
        self.lock().write = None;
    }

    /// Whether every use that `use_` conflicts with has completed, without blocking (refused as
    /// `call` on a capturing thread) (a use
    /// without an event yet gets one now, at the end of its stream).
    pub(crate) fn is_complete(&self, call: &'static str, use_: Use) -> Result<bool> {
        refuse_in_capture(|| None, call)?;
        let mut state = self.lock();
        let State { write, reads, .. } = &mut *state;
        for mark in write.iter_mut().chain(reads.iter_mut().filter(|_| use_ == Use::Write)) {
            if !mark.event()?.is_complete()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks the host until every use that `use_` conflicts with has completed (before the host
    /// reads, writes or frees the buffer); refused as `call` on a capturing thread.
    ///
    /// The wait itself runs with the state unlocked, so that operations on the buffer from other
    /// threads are not held up by it: the events waited for are shared with their marks
    /// meanwhile (a shared event is never recorded again, see [`CudaStream::record_event`]), and
    /// for a write, afterwards, the marks that no operation changed in between are cleared.
    pub(crate) fn wait_on_host(&self, call: &'static str, use_: Use) -> Result<()> {
        refuse_in_capture(|| None, call)?;
        let waited: SmallVec<[Arc<PooledEvent>; 2]> = {
            let mut state = self.lock();
            let State { write, reads, .. } = &mut *state;
            write
                .iter_mut()
                .chain(reads.iter_mut().filter(|_| use_ == Use::Write))
                .map(Mark::shared_event)
                .collect::<Result<_>>()?
        };
        for event in &waited {
            event.synchronize()?;
        }
        if use_ == Use::Write {
            let mut state = self.lock();
            let done = |mark: &Mark| waited.iter().any(|event| mark.holds(event));
            if state.write.as_ref().is_some_and(done) {
                state.write = None;
            }
            state.reads.retain(|mark| !done(mark));
        }
        Ok(())
    }
}

impl Access {
    /// Waits on the host for every use of the buffer, recording no event on `owner`, a stream
    /// captured outside this crate (where an event recorded now would be captured: a lend's end,
    /// `interop`): a mark on `owner` with no event yet stands for no use of the crate's (the
    /// owner's, made with the buffer; the crate's uses on it record their events as they are
    /// noted, the buffer being eager).
    #[cfg(feature = "cudarc-interop")]
    pub(crate) fn wait_on_host_off(&self, owner: &CudaStream) -> Result<()> {
        let waited: SmallVec<[Arc<PooledEvent>; 2]> = {
            let mut state = self.lock();
            let State { write, reads, .. } = &mut *state;
            write
                .iter_mut()
                .chain(reads.iter_mut())
                .filter(|mark| mark.event.is_some() || !mark.is_on(owner))
                .map(Mark::shared_event)
                .collect::<Result<_>>()?
        };
        waited.iter().try_for_each(|event| event.synchronize())
    }
}

/// Several buffers' ordering states, locked together (in address order) for one operation: made
/// by [`Access::lock_all`]. For work whose buffers no borrow keeps from other threads (a graph's
/// footprint, held by `Arc`): two threads launching such work on the same buffers then order one
/// after the other, each waiting for the other's marks as they are once its work is enqueued,
/// never both for what came before.
pub(crate) struct HeldAccesses<'a> {
    held: Vec<(&'a Access, Use, Locked<'a>)>,
}

impl HeldAccesses<'_> {
    /// [`Access::order`] for every buffer held.
    pub(crate) fn order(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.held.iter_mut().try_for_each(|(_, use_, state)| order_locked(state, stream, *use_))
    }

    /// [`Access::note`] for every buffer held; `gate` is `stream`'s enqueue gate, held by the
    /// caller, which saw the stream not capturing under it.
    pub(crate) fn note(&mut self, stream: &Arc<CudaStream>, gate: &EnqueueGate<'_>) -> Result<()> {
        self.held
            .iter_mut()
            .try_for_each(|(access, use_, state)| note_locked(state, stream, *use_, access.eager, Some(gate)))
    }
}

/// [`Access::order`] on a locked state.
#[inline]
fn order_locked(state: &mut State, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
    if use_ == Use::Signal {
        return Ok(());
    }
    // The usual case needs nothing: the last write on this stream, and no read to wait for.
    let write_here = state.write.as_ref().is_none_or(|mark| mark.is_on(stream));
    if write_here && (use_ == Use::Read || state.reads.is_empty()) {
        return Ok(());
    }
    order_waits(state, stream, use_)
}

/// The waits of [`order_locked`] on other streams.
#[inline(never)]
fn order_waits(state: &mut State, stream: &Arc<CudaStream>, use_: Use) -> Result<()> {
    if let Some(mark) = state.write.as_mut().filter(|mark| !mark.is_on(stream)) {
        mark.wait_on(stream)?;
    }
    if use_ == Use::Write {
        for mark in state.reads.iter_mut().filter(|mark| !mark.is_on(stream)) {
            mark.wait_on(stream)?;
        }
    }
    Ok(())
}

/// [`Access::note`] on a locked state; `eager` records the use's event now (`gate`: `stream`'s
/// enqueue gate when the caller holds it and saw the stream not capturing under it).
#[inline]
fn note_locked(
    state: &mut State,
    stream: &Arc<CudaStream>,
    use_: Use,
    eager: bool,
    gate: Option<&EnqueueGate<'_>>,
) -> Result<()> {
    // A signal stays a pending use like a read (see `Use::Signal`).
    let use_ = if use_ == Use::Signal { Use::Read } else { use_ };
    // The usual case of a buffer that is not eager: its last write was on this stream, whose mark
    // then stands for this use too (for a write, the reads since were waited for by `order`).
    if !eager && state.reads.is_empty() {
        if let Some(mark) = state.write.as_mut().filter(|mark| mark.is_on(stream)) {
            mark.waited_by = None;
            mark.event = None;
            return Ok(());
        }
    }
    note_marks(state, stream, use_, eager, gate)
}

/// Lets the read marks go of the streams they hold, so that a buffer read on stream after stream
/// (weights read by a fresh stream per request) keeps neither the streams nor a mark per stream:
/// each mark gets its event (recorded now at the end of its stream, after the read, if it has
/// none) and lets its stream go; detached marks whose reads have completed are dropped. Writes
/// still wait for the reads in flight, through the events.
#[cold]
fn detach_reads(reads: &mut SmallVec<[Mark; 1]>) -> Result<()> {
    for mark in reads.iter_mut() {
        mark.event()?;
        // Only an event of the pool's own is recorded again later; a shared one stays with its
        // capture or host wait, and the stream is kept with it.
        if matches!(mark.event, Some(StreamEvent::Own(_))) {
            mark.stream = None;
        }
    }
    // A query would break a capture of this thread: the marks are pruned on a later read.
    if !queries_allowed() {
        return Ok(());
    }
    // Every query first: a failed one leaves every mark in place.
    let mut done: SmallVec<[bool; 8]> = SmallVec::with_capacity(reads.len());
    for mark in reads.iter() {
        done.push(match (&mark.stream, &mark.event) {
            (None, Some(event)) => event.is_complete()?,
            _ => false,
        });
    }
    let mut at = 0;
    reads.retain(|_| {
        at += 1;
        !done[at - 1]
    });
    Ok(())
}

/// [`note_locked`] beyond its usual case.
#[inline(never)]
fn note_marks(
    state: &mut State,
    stream: &Arc<CudaStream>,
    use_: Use,
    eager: bool,
    gate: Option<&EnqueueGate<'_>>,
) -> Result<()> {
    let State { write, reads } = state;
    // The mark this use updates: for a write, the new last write (the old one and every read
    // were waited for by `order`); for a read, the stream's own mark (the write's, when the
    // write was on this stream too: a later writer waits for it, so it must come after this
    // read as well).
    let mark = match use_ {
        Use::Write => {
            if !eager {
                reads.clear();
            }
            // An eager buffer keeps its read marks, each with its event, for the next read of its
            // stream to record again where it is (a slot's `ev_rx` and the RX stream, once per
            // step), instead of dropping them and making them again. Kept, a mark stands for a
            // read this write was ordered after: its `waited_by` names this stream, so later
            // writes here skip it; a write on another stream waits for it again, which orders
            // nothing wrongly (the read came before this write).
            if !write.as_ref().is_some_and(|mark| mark.is_on(stream)) {
                *write = Some(Mark::new(stream));
            }
            write.as_mut().expect("set above")
        }
        Use::Read | Use::Signal => match write.as_mut().filter(|mark| mark.is_on(stream)) {
            Some(mark) => mark,
            None => match reads.iter().position(|mark| mark.is_on(stream)) {
                Some(at) => &mut reads[at],
                None => {
                    if reads.len() >= ATTACHED_READS {
                        detach_reads(reads)?;
                    }
                    reads.push(Mark::new(stream));
                    reads.last_mut().expect("pushed above")
                }
            },
        },
    };
    // The mark now stands for this use too: a wait made for its event as it was does not
    // cover it. A detached mark of this stream holds the stream again (its event is made anew).
    mark.waited_by = None;
    if mark.stream.is_none() {
        mark.stream = Some(Arc::clone(stream));
    }
    if eager {
        // Its event recorded again after this use (or one from the pool).
        stream.record_after_enqueued(gate, &mut mark.event)
    } else {
        // Its event, if any, was recorded before this use: made again when next needed.
        mark.event = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Use, stronger};

    #[test]
    fn a_buffer_used_twice_is_ordered_for_the_stronger_use() {
        let all = [Use::Read, Use::Signal, Use::Write];
        for a in all {
            for b in all {
                let expected = match (a, b) {
                    (Use::Write, _) | (_, Use::Write) => Use::Write,
                    (Use::Signal, _) | (_, Use::Signal) => Use::Signal,
                    _ => Use::Read,
                };
                assert_eq!(stronger(a, b), expected, "{a:?} with {b:?}");
            }
        }
    }
}
