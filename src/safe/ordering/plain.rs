//! The plain path of the ordering rule: a buffer whose state records only the last write of one
//! stream, with no event and no read since, carries that stream's id in an atomic tag
//! ([`Access::plain`](super::Access)), and work on that stream takes no lock: it claims the tag
//! for the span of its enqueue ([`PlainClaim`]). Whoever locks the state takes the tag down first,
//! waiting out a claim ([`Access::take_down_plain`]), and puts up the state's new tag
//! ([`plain_on`]) as it unlocks (`Locked`'s drop, in the parent module).
//!
//! Threading: the tag is the only state shared without the lock; every change of it is an atomic
//! exchange, and the claim's `Release` orders its enqueue before the next lock holder's.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Access, Mark, State};
use crate::safe::stream::back_off;

/// The bit of [`Access::plain`] that an operation on the plain path holds for the span of its
/// enqueue.
pub(super) const PLAIN_CLAIMED: u64 = 1 << 63;

/// The stream id that [`Access::plain`] holds for `state`: the last write's stream when the state
/// records that write alone, with no event (nothing recorded, nothing waited for) and no read
/// since, for a buffer that is not eager; else 0. Work on that stream is then ordered by the
/// stream alone, and noting it changes nothing ([`order_locked`] and [`note_locked`] do nothing).
#[inline]
pub(super) fn plain_on(state: &State, eager: bool) -> u64 {
    if eager || !state.reads.is_empty() {
        return 0;
    }
    match &state.write {
        Some(Mark { stream: Some(_), stream_id, event: None, waited_by: None }) => *stream_id,
        _ => 0,
    }
}

/// An operation's hold on a buffer's plain path (see [`Access::claim_plain`]), given up when it
/// drops.
pub(super) struct PlainClaim<'a> {
    tag: &'a AtomicU64,
    stream_id: u64,
}

impl Drop for PlainClaim<'_> {
    #[inline]
    fn drop(&mut self) {
        // Release: the claim's enqueue comes before whatever the next lock holder enqueues.
        self.tag.store(self.stream_id, Ordering::Release);
    }
}

impl Access {
    /// Takes the plain tag down (to 0), once no operation holds a claim on it: from then on no
    /// operation takes the plain path until the lock holder puts a tag up again.
    #[inline]
    pub(super) fn take_down_plain(&self) {
        let mut tag = self.plain.load(Ordering::Acquire);
        let mut round = 0;
        while tag != 0 {
            if tag & PLAIN_CLAIMED != 0 {
                // An enqueue on the plain path is in progress: it gives the claim up when done.
                back_off(&mut round);
                tag = self.plain.load(Ordering::Acquire);
                continue;
            }
            // Acquire: the claim's enqueue, given up before this, comes before what follows.
            match self.plain.compare_exchange_weak(tag, 0, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => tag = now,
            }
        }
    }

    /// Whether the plain tag names the stream `stream_id` now (a look, no claim).
    #[inline]
    pub(super) fn looks_plain_for(&self, stream_id: u64) -> bool {
        self.plain.load(Ordering::Relaxed) == stream_id
    }

    /// The plain path for work on the stream `stream_id`: a claim when the state records that
    /// stream's work alone
    /// with nothing to wait for or record (see [`Access::plain`]), so that the work needs no wait
    /// and noting it changes nothing; `None` otherwise. While the claim lives, whoever locks the
    /// state waits for it before touching the state or the stream's events.
    #[inline]
    pub(super) fn claim_plain(&self, stream_id: u64) -> Option<PlainClaim<'_>> {
        // A look first: a buffer off the plain path (an eager one) costs no atomic write here.
        if !self.looks_plain_for(stream_id) {
            return None;
        }
        self.claim_plain_seen(stream_id)
    }

    /// [`claim_plain`](Self::claim_plain) once [`looks_plain_for`](Self::looks_plain_for) saw the
    /// tag name `stream_id`: no second look, the claim alone (which holds only while the tag still
    /// names that stream, unclaimed).
    #[inline]
    pub(super) fn claim_plain_seen(&self, stream_id: u64) -> Option<PlainClaim<'_>> {
        self.plain
            .compare_exchange(stream_id, stream_id | PLAIN_CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| PlainClaim { tag: &self.plain, stream_id })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use super::PLAIN_CLAIMED;
    use crate::safe::ordering::Access;

    /// A state with no use recorded, its plain tag put up by hand for the stream `7`.
    fn tagged() -> Access {
        let access = Access::new(None, false);
        access.plain.store(7, Ordering::SeqCst);
        access
    }

    #[test]
    fn the_plain_path_is_for_its_own_stream_only_and_one_claim_at_a_time() {
        let access = tagged();
        assert!(access.claim_plain(8).is_none(), "another stream's work takes the locked path");
        let claim = access.claim_plain(7).expect("the tag's stream claims the plain path");
        assert_eq!(access.plain.load(Ordering::SeqCst), 7 | PLAIN_CLAIMED);
        assert!(access.claim_plain(7).is_none(), "a claimed tag is not claimed twice");
        drop(claim);
        assert_eq!(access.plain.load(Ordering::SeqCst), 7, "the claim gives the tag back as it was");
        assert!(access.claim_plain(7).is_some());
    }

    #[test]
    fn a_claim_after_a_look_holds_only_while_the_tag_still_names_the_stream_unclaimed() {
        let access = tagged();
        assert!(access.looks_plain_for(7));
        let claim = access.claim_plain_seen(7).expect("the tag's stream claims it after its look");
        assert_eq!(access.plain.load(Ordering::SeqCst), 7 | PLAIN_CLAIMED);
        assert!(access.claim_plain_seen(7).is_none(), "a tag claimed since the look is not claimed twice");
        drop(claim);
        assert!(access.claim_plain_seen(8).is_none(), "another stream's work takes the locked path");
        // Taken down since the look (a lock holder changes the state): no claim.
        access.plain.store(0, Ordering::SeqCst);
        assert!(access.claim_plain_seen(7).is_none(), "a tag taken down since the look is not claimed");
        assert_eq!(access.plain.load(Ordering::SeqCst), 0, "a failed claim leaves the tag as it is");
    }

    #[test]
    fn a_lock_waits_out_a_claim_and_takes_the_tag_down_until_it_unlocks() {
        let access = tagged();
        let claim = access.claim_plain(7).unwrap();
        let hold = Duration::from_millis(100);
        let (locked_at, released_at) = std::thread::scope(|scope| {
            let locker = scope.spawn(|| {
                let locked = access.lock();
                let at = Instant::now();
                // Locked, the tag is down: no claim while the state is being changed.
                assert_eq!(access.plain.load(Ordering::SeqCst), 0);
                assert!(access.claim_plain(7).is_none());
                drop(locked);
                at
            });
            std::thread::sleep(hold);
            let released_at = Instant::now();
            drop(claim);
            (locker.join().unwrap(), released_at)
        });
        assert!(locked_at >= released_at, "the lock was taken while an enqueue held the plain path");
        // The state records no use: no tag is put up again, and the stream takes the locked path.
        assert_eq!(access.plain.load(Ordering::SeqCst), 0);
        assert!(access.claim_plain(7).is_none());
    }
}
