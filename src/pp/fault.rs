//! Fault injection: the protocol broken on purpose, for the tests that show its checks catch
//! real races and dead peers (`testing` feature).
//!
//! The one seam between the runtime and its test hooks. A [`PpConfig`](super::PpConfig) carries
//! a [`Fault`]; production code asks it at named points ([`FaultPoint`], and the hooks below
//! that act on a slot or a record) and carries no `cfg` of its own. Without the `testing`
//! feature a [`Fault`] is an empty value, every point answers "no fault" from an
//! `#[inline(always)]` function that returns a constant, and the hooks are empty: the
//! compiler removes each call and the branch behind it. A hook takes what it acts on as it is at
//! the call (a ring and a slot index, not the slot looked up): no argument costs the build
//! without the feature anything. With the feature, the hot path's hooks are inlined too (a
//! comparison of the injected fault), as the hooks were where they are called.

use std::time::Duration;

#[cfg(feature = "testing")]
use super::ring::SlotBuffer;
use super::ring::Slots;

/// The exit status of a rank that exits before it joins a communicator on purpose
/// ([`ProtocolFault::ExitBeforeCommJoin`]).
pub(crate) const EXIT_BEFORE_COMM_JOIN: i32 = 86;

/// A deliberate protocol break, for tests that must show the hazard checks catch real races
/// (`testing` feature).
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProtocolFault {
    /// The protocol as specified.
    #[default]
    None,
    /// `tx` does not wait for the slot's previous `rx` (write-after-read hazard).
    SkipRxWait,
    /// `rx` does not wait for the slot's `tx` (read-before-write hazard).
    SkipTxWait,
    /// A boundary to another process is not failed when its peer stays silent for longer than
    /// the peer timeout (the liveness check off).
    IgnoreSilence,
    /// This rank exits (status 86) after the rendezvous, right before it joins its first NCCL
    /// communicator: a peer that dies during the others' setup.
    ExitBeforeCommJoin,
    /// The setup joins NCCL communicators blocking and waits for each link's first message with
    /// no bound (a peer that dies meanwhile hangs it): the bounded setup off.
    UnwatchedSetup,
    /// A `tx` to another rank writes its step's record but never sends the step's data: a peer
    /// that announces a step and dies before its send ran.
    AnnounceWithoutSend,
    /// A link that fails does not fail this rank's other links: what this rank forwards after a
    /// receive the failure cut short goes on downstream as if it were whole.
    ContainedFailure,
    /// A `tx` to another rank alters its record of this step after sealing it (a record forged
    /// or corrupted in flight).
    ForgeRecordAt(u64),
    /// A `tx` to another rank writes its record of this step twice (a record replayed).
    ReplayRecordAt(u64),
    /// A `tx` to another rank writes half of its record of this step and then ends the
    /// connection (a record cut short by a dying peer).
    TruncateRecordAt(u64),
    /// This rank's links take this many milliseconds to fail once a failure is seen (a busy
    /// machine's threads that read a shut connection or a silent peer late): meanwhile its calls
    /// and readbacks find the links up.
    SlowToFail(u64),
    /// Over IPC, this rank's receiver takes each step without freeing its slot for the sender
    /// and without waiting for its copy, and then confirms the sender's close: a receiving rank
    /// that lies about having received every step.
    ReceiveWithoutFreeing,
    /// Over NCCL, this rank's receiver takes each step without posting its receive (the slot
    /// keeps what it held), and then confirms the sender's close: a receiving rank that lies
    /// about having received every step, while the sender's sends wait for receives that never
    /// come.
    ConfirmWithoutReceiving,
}

/// The fault a configuration injects: a [`ProtocolFault`] with the `testing` feature, nothing
/// (a value of no size) without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Fault {
    #[cfg(feature = "testing")]
    injected: ProtocolFault,
}

/// The points where the protocol can be broken on purpose, each a yes-or-no question the
/// runtime asks its [`Fault`] (see [`ProtocolFault`] for what each one breaks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultPoint {
    /// A peer's silence does not fail its link ([`ProtocolFault::IgnoreSilence`]).
    IgnoreSilence,
    /// The rank exits before it joins its first communicator
    /// ([`ProtocolFault::ExitBeforeCommJoin`]).
    ExitBeforeCommJoin,
    /// The setup's waits for NCCL are not bounded ([`ProtocolFault::UnwatchedSetup`]).
    UnwatchedSetup,
    /// A `tx` to another rank writes its record and sends nothing
    /// ([`ProtocolFault::AnnounceWithoutSend`]).
    AnnounceWithoutSend,
    /// A failed link fails none of the rank's other links ([`ProtocolFault::ContainedFailure`]).
    ContainedFailure,
    /// An IPC receive neither frees its slot nor waits for the copy
    /// ([`ProtocolFault::ReceiveWithoutFreeing`]).
    ReceiveWithoutFreeing,
    /// An NCCL receive is not posted, and the close is confirmed all the same
    /// ([`ProtocolFault::ConfirmWithoutReceiving`]).
    ConfirmWithoutReceiving,
}

/// How a `tx` to another rank tampers with its record of a step (see [`Fault::tamper`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) enum Tamper {
    /// Alter the record after its seal ([`ProtocolFault::ForgeRecordAt`]).
    Forge,
    /// Write the record twice ([`ProtocolFault::ReplayRecordAt`]).
    Replay,
    /// Write half the record and end the connection ([`ProtocolFault::TruncateRecordAt`]).
    Truncate,
}

#[cfg(feature = "testing")]
impl Fault {
    /// The fault that injects `injected`.
    pub(crate) fn new(injected: ProtocolFault) -> Fault {
        Fault { injected }
    }

    /// The injected fault.
    pub(crate) fn injected(self) -> ProtocolFault {
        self.injected
    }

    /// Whether the protocol is broken at `point`.
    #[inline(always)]
    pub(crate) fn at(self, point: FaultPoint) -> bool {
        self.injected
            == match point {
                FaultPoint::IgnoreSilence => ProtocolFault::IgnoreSilence,
                FaultPoint::ExitBeforeCommJoin => ProtocolFault::ExitBeforeCommJoin,
                FaultPoint::UnwatchedSetup => ProtocolFault::UnwatchedSetup,
                FaultPoint::AnnounceWithoutSend => ProtocolFault::AnnounceWithoutSend,
                FaultPoint::ContainedFailure => ProtocolFault::ContainedFailure,
                FaultPoint::ReceiveWithoutFreeing => ProtocolFault::ReceiveWithoutFreeing,
                FaultPoint::ConfirmWithoutReceiving => ProtocolFault::ConfirmWithoutReceiving,
            }
    }

    /// How long a link waits before it records a failure ([`ProtocolFault::SlowToFail`]).
    #[inline(always)]
    pub(crate) fn fail_delay(self) -> Duration {
        match self.injected {
            ProtocolFault::SlowToFail(ms) => Duration::from_millis(ms),
            _ => Duration::ZERO,
        }
    }

    /// How a `tx` to another rank tampers with its record of `step`, if it does.
    #[inline(always)]
    pub(crate) fn tamper(self, step: u64) -> Option<Tamper> {
        match self.injected {
            ProtocolFault::ForgeRecordAt(at) if at == step => Some(Tamper::Forge),
            ProtocolFault::ReplayRecordAt(at) if at == step => Some(Tamper::Replay),
            ProtocolFault::TruncateRecordAt(at) if at == step => Some(Tamper::Truncate),
            _ => None,
        }
    }

    /// The part of the fault every rank of the job shares, which the rendezvous compares: a
    /// fault of one rank's own behaviour is that rank's alone and left out.
    pub(crate) fn shared(self) -> Fault {
        match self.injected {
            ProtocolFault::ExitBeforeCommJoin
            | ProtocolFault::UnwatchedSetup
            | ProtocolFault::AnnounceWithoutSend
            | ProtocolFault::ContainedFailure
            | ProtocolFault::ForgeRecordAt(_)
            | ProtocolFault::ReplayRecordAt(_)
            | ProtocolFault::TruncateRecordAt(_)
            | ProtocolFault::SlowToFail(_)
            | ProtocolFault::ReceiveWithoutFreeing
            | ProtocolFault::ConfirmWithoutReceiving => Fault::default(),
            _ => self,
        }
    }

    /// The fault as a configuration's text shows it, `None` for no fault.
    pub(crate) fn shown(self) -> Option<ProtocolFault> {
        (self.injected != ProtocolFault::None).then_some(self.injected)
    }

    /// An eager `tx` into `ring`'s slot `k` does not wait for the slot's previous reads
    /// ([`ProtocolFault::SkipRxWait`]).
    #[inline(always)]
    pub(crate) fn before_tx(self, ring: &mut Slots, k: usize) {
        if self.injected == ProtocolFault::SkipRxWait {
            ring.forget_read(k);
        }
    }

    /// An eager `rx` of `ring`'s slot `k` does not wait for the slot's write
    /// ([`ProtocolFault::SkipTxWait`]).
    #[inline(always)]
    pub(crate) fn before_rx(self, ring: &mut Slots, k: usize) {
        if self.injected == ProtocolFault::SkipTxWait {
            ring.forget_write(k);
        }
    }

    /// A stage's graph launch for slot `k` drops the protocol's wait: for the input slot's write
    /// ([`ProtocolFault::SkipTxWait`]), or for the output slot's reads
    /// ([`ProtocolFault::SkipRxWait`]).
    #[inline(always)]
    pub(crate) fn before_launch(self, input: Option<&Slots>, output: Option<&Slots>, k: usize) {
        let ring = match self.injected {
            ProtocolFault::SkipTxWait => input,
            ProtocolFault::SkipRxWait => output,
            _ => return,
        };
        if let Some(SlotBuffer::Device(buffer)) = ring.map(|ring| ring.buffer(k)) {
            if self.injected == ProtocolFault::SkipTxWait {
                buffer.access().forget_write();
            } else {
                buffer.access().forget_reads();
            }
        }
    }
}

/// Without the `testing` feature: no fault anywhere, each answer a constant.
#[cfg(not(feature = "testing"))]
impl Fault {
    /// Whether the protocol is broken at `point`: never.
    #[inline(always)]
    pub(crate) fn at(self, _point: FaultPoint) -> bool {
        false
    }

    /// How long a link waits before it records a failure: not at all.
    #[inline(always)]
    pub(crate) fn fail_delay(self) -> Duration {
        Duration::ZERO
    }

    /// How a `tx` to another rank tampers with its record: it does not.
    #[inline(always)]
    pub(crate) fn tamper(self, _step: u64) -> Option<Tamper> {
        None
    }

    /// The part of the fault every rank shares: none.
    #[inline(always)]
    pub(crate) fn shared(self) -> Fault {
        self
    }

    /// The fault as a configuration's text shows it: none.
    #[inline(always)]
    pub(crate) fn shown(self) -> Option<std::convert::Infallible> {
        None
    }

    /// An eager `tx`'s hook: nothing.
    #[inline(always)]
    pub(crate) fn before_tx(self, _ring: &mut Slots, _k: usize) {}

    /// An eager `rx`'s hook: nothing.
    #[inline(always)]
    pub(crate) fn before_rx(self, _ring: &mut Slots, _k: usize) {}

    /// A graph launch's hook: nothing.
    #[inline(always)]
    pub(crate) fn before_launch(self, _input: Option<&Slots>, _output: Option<&Slots>, _k: usize) {}
}
