//! The pipeline's waiting times: how long a thread that waits for another (a slot to come free,
//! a step from another rank, a quiet link) spins, and how often it looks again once it sleeps.
//! Shared by the ring's waits and the links between ranks.

use std::time::Duration;

/// How often the receiver threads and the watchdog look at a link that is quiet.
pub(in crate::pp) const POLL: Duration = Duration::from_millis(10);

/// How long a thread that expects the next step soon (a receiver thread after a record or
/// waiting for a free slot, an `rx_wait` on a boundary from another rank) spins before it
/// sleeps: waking a sleeping thread costs tens of µs on a busy host, more than a step's host
/// work, and a decode step's next boundary crossing comes within this window. Spinning costs one
/// core for at most this long per wait.
pub(in crate::pp) const SPIN: Duration = Duration::from_micros(250);
