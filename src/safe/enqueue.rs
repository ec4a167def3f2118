//! The one door every enqueue passes: copies, memsets, launches, host copies and NCCL's calls
//! reach the stream through [`ordered`] (or [`ordered_with`], [`ordered_as`]), which binds the
//! stream's context once, holds the stream's enqueue gate, and then either records the work into
//! the stream's capture (its device buffers joining the capture's footprint) or orders it by the
//! crate's rule: waits for what each buffer's use conflicts with, enqueues, and notes the uses
//! (`ordering`). A buffer is handed to the door as a [`Tracked`]: device memory or a pinned host
//! buffer's ordering state.
//!
//! Threading: the door holds the stream's enqueue gate from its look at the capture to the notes,
//! so a capture of the stream begins or ends wholly before or after the call; the buffers' locks
//! are `ordering`'s.

use std::sync::Arc;

use super::element::DeviceRepr;
use super::memory::{CudaView, CudaViewMut, DeviceMemory};
use super::ordering::{Access, OwnOrder, Owned, Use};
use super::stream::{CudaStream, EnqueueGate, refuse_on};
use crate::cuda_error::{CudaError, Result};

/// A buffer an operation touches, as the ordering rule sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tracked<'b> {
    /// Device memory (a graph that captures the operation holds it alive).
    Device(&'b Arc<DeviceMemory>),
    /// Pinned host memory (cannot be captured).
    Host(&'b Access),
}

impl<'b> Tracked<'b> {
    fn access(self) -> &'b Access {
        match self {
            Tracked::Device(memory) => memory.access(),
            Tracked::Host(access) => access,
        }
    }
}

impl<'a, T: DeviceRepr> CudaView<'a, T> {
    /// The viewed allocation, for the ordering rule.
    pub(crate) fn tracked(&self) -> Tracked<'a> {
        Tracked::Device(self.memory())
    }
}

impl<'a, T: DeviceRepr> CudaViewMut<'a, T> {
    /// The viewed allocation, for the ordering rule.
    pub(crate) fn tracked(&self) -> Tracked<'a> {
        Tracked::Device(self.memory())
    }
}

/// Runs `enqueue` on `stream` under the crate's ordering rule, with the stream's context current
/// (bound once for the whole call): waits for what each buffer's use conflicts with, enqueues,
/// then notes the uses (eager buffers record their event then; if that fails, the stream is
/// waited for, so nothing is left in flight unordered). The buffers' states stay locked from the
/// waits to the notes, so `enqueue` must run only the crate's own code (see [`ordered_with`]).
///
/// On a capturing stream the work is recorded into the graph instead, and the buffers join the
/// capture's footprint, to be ordered when the graph is launched (see the `graph` module).
pub(crate) fn ordered<'b, R, I>(stream: &Arc<CudaStream>, uses: I, enqueue: impl FnOnce() -> Result<R>) -> Result<R>
where
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    ordered_with(stream, uses, true, enqueue)
}

/// [`ordered`] for a copy from `src` to `dst` of which one side is a buffer its owner orders
/// (`owned`, see [`OwnOrder`](super::ordering::OwnOrder)): the other side passes the door as
/// usual, the owned one is ordered by its events around `enqueue`. `gate` is `stream`'s enqueue
/// gate, held by the caller, which saw the stream not capturing under it: an owned buffer's
/// events are recorded outside any capture.
#[inline(always)]
pub(crate) fn ordered_owned<R>(
    stream: &Arc<CudaStream>,
    gate: &EnqueueGate<'_>,
    src: Tracked<'_>,
    dst: Tracked<'_>,
    owned: Owned<'_>,
    enqueue: impl FnOnce() -> Result<R>,
) -> Result<R> {
    assert!(gate.holds(stream) && !stream.is_capturing(), "an owned buffer is used outside a capture, under the gate");
    // One binding for the waits, the copy and the event records. The caller's gate stands for
    // the door's: the stream was seen uncaptured under it, so the other side is ordered by the
    // rule at once (the door's look at the capture and its gate again would be the same).
    let _bound = stream.context().bind_for_call()?;
    match owned {
        Owned::Src(order) => {
            assert!(order.orders(src.access()), "the owned side is the buffer its order orders");
            dst.access().around(
                Use::Write,
                stream,
                gate,
                #[inline(always)]
                || order.read(stream, enqueue),
            )
        }
        Owned::Dst(order) => {
            assert!(order.orders(dst.access()), "the owned side is the buffer its order orders");
            src.access().around(
                Use::Read,
                stream,
                gate,
                #[inline(always)]
                || order.write(stream, enqueue),
            )
        }
    }
}

/// [`ordered_owned`] for a copy into a buffer its owner orders (`order`, the copy's `dst`) from
/// the memory of a slice given up for its last read on `stream` (`src`, its ordering state held
/// exclusively: see [`Retired`](super::memory::Retired)): `src`'s state is handed to `stream`
/// (see [`OwnOrder::write_from_handed`]), which waits for its uses and stands for the copy's
/// read, so the read is not noted apart. `gate` as for [`ordered_owned`].
#[inline(always)]
pub(crate) fn ordered_retired_owned<R>(
    stream: &Arc<CudaStream>,
    gate: &EnqueueGate<'_>,
    src: &mut Access,
    dst: Tracked<'_>,
    order: &mut OwnOrder,
    enqueue: impl FnOnce() -> Result<R>,
) -> Result<R> {
    assert!(gate.holds(stream) && !stream.is_capturing(), "an owned buffer is used outside a capture, under the gate");
    assert!(order.orders(dst.access()), "the owned side is the buffer its order orders");
    // One binding for the wait, the copy and the event record.
    let _bound = stream.context().bind_for_call()?;
    order.write_from_handed(stream, src, enqueue)
}

/// [`ordered_with`] for work whose own error is of a layer above (an NCCL call's): the rule's
/// own errors convert into it.
#[inline]
pub(crate) fn ordered_as<'b, R, E, I>(
    stream: &Arc<CudaStream>,
    uses: I,
    locked: bool,
    enqueue: impl FnOnce() -> Result<R, E>,
) -> Result<R, E>
where
    E: From<CudaError>,
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    ordered_with_error(stream, uses, locked, enqueue)
}

/// [`ordered`], holding the buffers' states locked while `enqueue` runs when `locked`; else (a
/// launch whose kernel arguments run a caller's code, which may use the same buffers through this
/// crate) unlocked between the waits and the notes.
#[inline]
pub(crate) fn ordered_with<'b, R, I>(
    stream: &Arc<CudaStream>,
    uses: I,
    locked: bool,
    enqueue: impl FnOnce() -> Result<R>,
) -> Result<R>
where
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    ordered_with_error(stream, uses, locked, enqueue)
}

/// [`ordered`] for work that may wait on the device for a word only `release` is sure to set
/// (a wait for another process): when the notes fail and the rule must wait on the host for the
/// stream, `release` runs first, so that the wait ends (the work behind it then runs as a
/// released wait makes it run) instead of holding the call until the other process acts.
pub(crate) fn ordered_releasing<'b, R, I>(
    stream: &Arc<CudaStream>,
    uses: I,
    release: impl FnOnce(),
    enqueue: impl FnOnce() -> Result<R>,
) -> Result<R>
where
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    ordered_then_release(stream, uses, true, Some(release), enqueue)
}

#[inline(always)]
fn ordered_with_error<'b, R, E, I>(
    stream: &Arc<CudaStream>,
    uses: I,
    locked: bool,
    enqueue: impl FnOnce() -> Result<R, E>,
) -> Result<R, E>
where
    E: From<CudaError>,
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    ordered_then_release(stream, uses, locked, None::<fn()>, enqueue)
}

/// The rule's whole door (see [`ordered`]); with `release`, the work may wait for a word only it
/// is sure to set, and it runs before the host waits for the stream after failed notes (see
/// [`ordered_releasing`]).
#[inline(always)]
fn ordered_then_release<'b, R, E, I>(
    stream: &Arc<CudaStream>,
    uses: I,
    locked: bool,
    release: Option<impl FnOnce()>,
    enqueue: impl FnOnce() -> Result<R, E>,
) -> Result<R, E>
where
    E: From<CudaError>,
    I: IntoIterator<Item = (Tracked<'b>, Use)> + Clone,
{
    let release_is_none = release.is_none();
    // One binding for the whole operation: the waits, the work and the event records below find
    // the context current and only check it.
    let _bound = stream.context().bind_for_call()?;
    // The capture seen here is the one the work lands in (or none).
    let gate = stream.enqueue_gate();
    if let Some(capture) = stream.capture() {
        let mut devices = Vec::new();
        for (tracked, use_) in uses {
            match tracked {
                Tracked::Device(memory) if memory.lent() => {
                    refuse_on(Some(stream), "work on memory lent for a scope (a graph would outlive the lend)")?
                }
                Tracked::Device(memory) => devices.push((memory, use_)),
                Tracked::Host(_) => refuse_on(Some(stream), "a copy to or from pinned host memory")?,
            }
        }
        let result = enqueue()?;
        for (memory, use_) in devices {
            capture.add(memory, use_);
        }
        return Ok(result);
    }
    // Before the host waits for the stream after failed notes (`settle`).
    let settle = |noted: Result<()>| {
        if let (Err(_), Some(release)) = (&noted, release) {
            release();
        }
        stream.settle(noted)
    };
    if locked {
        // One lock per buffer, from the waits to the notes (the short forms settle inside, so
        // work with a release takes the long one).
        let mut each = uses.clone().into_iter();
        match (each.next(), each.next(), each.next()) {
            _ if !release_is_none => {}
            (None, ..) => return enqueue(),
            (Some((a, use_a)), None, _) => return a.access().around(use_a, stream, &gate, enqueue),
            (Some((a, use_a)), Some((b, use_b)), None) => {
                return Access::around_two((a.access(), use_a), (b.access(), use_b), stream, &gate, enqueue);
            }
            _ => {}
        }
        let mut held = Access::lock_all(uses.into_iter().map(|(tracked, use_)| (tracked.access(), use_)));
        held.order(stream)?;
        let result = enqueue()?;
        settle(held.note(stream, &gate))?;
        return Ok(result);
    }
    for (tracked, use_) in uses.clone() {
        tracked.access().order(stream, use_)?;
    }
    let result = enqueue()?;
    settle(uses.into_iter().try_for_each(|(tracked, use_)| tracked.access().note(stream, use_)))?;
    Ok(result)
}
