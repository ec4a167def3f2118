//! The pipeline's waiting times: how long a thread that waits for another (a slot to come free,
//! a step from another rank, a quiet link) spins, and how often it looks again once it sleeps.
//! Shared by the ring's waits and the links between ranks; and the bounded poll of something the
//! device finishes ([`poll_until`]).

use std::time::{Duration, Instant};

/// How often the receiver threads and the watchdog look at a link that is quiet.
pub(in crate::pp) const POLL: Duration = Duration::from_millis(10);

/// How long a thread that expects the next step soon (a receiver thread after a record or
/// waiting for a free slot, an `rx_wait` on a boundary from another rank) spins before it
/// sleeps: waking a sleeping thread costs tens of µs on a busy host, more than a step's host
/// work, and a decode step's next boundary crossing comes within this window. Spinning costs one
/// core for at most this long per wait.
pub(in crate::pp) const SPIN: Duration = Duration::from_micros(250);

/// The timer slack (ns) of the threads that poll another process's words in short naps: with
/// Linux's default of 50 µs a nap of 20 µs lasts about 70 µs, and every step that waits past the
/// spin pays that.
const POLLER_TIMER_SLACK_NS: std::num::NonZeroU64 = std::num::NonZeroU64::new(1_000).expect("not zero");

/// Makes the calling thread's short sleeps as short as asked ([`POLLER_TIMER_SLACK_NS`]); for
/// the threads that poll words another process writes. Best effort: a kernel that refuses keeps
/// its default slack, and only the naps' length changes.
pub(in crate::pp) fn sleep_finely() {
    let _ = rustix::thread::set_current_timer_slack(Some(POLLER_TIMER_SLACK_NS));
}

/// Looks (`look`, at least once) until it says done (`Ok(true)`) or fails, paced by
/// [`poll_pause`](crate::nccl::poll_pause) (a few yields, then 200 µs naps): for what the device
/// usually finishes within microseconds and may take seconds (a stream's receives, an event after
/// a send). `Ok(false)` once `deadline` passed with it not done.
pub(in crate::pp) fn poll_until<E>(
    deadline: Instant,
    mut look: impl FnMut() -> std::result::Result<bool, E>,
) -> std::result::Result<bool, E> {
    let mut polls = 0u32;
    loop {
        if look()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        crate::nccl::poll_pause(&mut polls);
    }
}
