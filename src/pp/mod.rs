//! The pipeline-parallel N-stage transport runtime.
//!
//! A model's layers are split into consecutive stages placed on one or more devices. Boundary
//! `b` joins stage `b` (TX) and stage `b + 1` (RX) and owns a ring of slots; each slot is a
//! persistent buffer on the RX side (pinned host memory for [`Transport::HostStaged`]) and two
//! events, `ev_tx` on the TX device and `ev_rx` on the RX device.
//!
//! - [`PpNRt::tx`] on stage `b`'s stream: wait `ev_rx` (the slot's previous reader is done), copy
//!   into the slot, record `ev_tx`.
//! - [`PpNRt::rx`] on stage `b + 1`'s stream: wait `ev_tx`, copy the slot into a fresh buffer
//!   allocated on that stream, record `ev_rx`.
//!
//! Copies within a device (the `tx` of a [`Transport::Local`] boundary, every `rx` from a device
//! slot) run as the SM copy helper kernel up to [`SM_COPY_MAX_BYTES`], else on the copy engine;
//! `tx` and `rx` always wait on the other side's event rather than query it first (a query
//! costs the host as much as a cross-device wait).
//!
//! Host-side slot state (free → filled → free) catches misuse before anything is enqueued, and
//! nothing is overwritten when a call fails. Each stage has its own stream; several host threads
//! may drive different stages of one runtime at once.
//!
//! A pipeline may span processes and hosts ([`PpConfig::with_ranks`], `PPNRT_RANKS`): each process
//! runs its own stages, and a boundary between two processes is [`Transport::Nccl`] (an NCCL
//! send on the TX stage's stream, received by the RX process into its slot ring), with the same
//! `tx`/`rx` contract; a stage of another process is [`PpError::StageNotOwned`], and a failed
//! peer [`PpError::PeerFailed`]. At the rendezvous every rank reports its host, user and
//! devices, and the plan chooses each such boundary's transport by one rule both ranks compute
//! alike ([`ProcessTransport`], `PPNRT_PROCESS_TRANSPORT`): [`Transport::Ipc`] for two ranks of
//! one host whose devices reach each other, once that transport is built (until then `auto`
//! stays on NCCL, and a runtime refuses an IPC boundary with
//! [`PpError::TransportUnavailable`]); the plan's line says which each boundary got and why.
//!
//! Every fallible call returns the crate's typed [`Error`], which converts into
//! `Box<dyn std::error::Error>` with `?`. Stage lookups ([`PpNRt::engine`], [`PpNRt::enter`]) are
//! fallible too: a stage index out of range is [`PpError::StageOutOfRange`], never a
//! panic. `tx` and `rx` take any [`DeviceRepr`](crate::DeviceRepr) element type (`f32`, `bf16`,
//! `f16`, integers, or a type of yours); `rx` checks that it asks for the type and length `tx` sent.

mod config;
mod error;
mod fault;
mod pending_readback;
mod plan;
mod process_transport;
// Unsafe only where NCCL's send and receive need equal counts, which the links' records carry.
#[allow(unsafe_code)]
mod remote;
mod ring;
mod runtime;
mod timing;

pub use crate::pp::config::{
    DEFAULT_PEER_TIMEOUT, DEVICES_VAR, MAX_PEER_TIMEOUT, MAX_SLOTS, MAX_STAGES, MIN_PEER_TIMEOUT, PEER_TIMEOUT_VAR,
    PROCESS_TRANSPORT_VAR, PpConfig, RANK_VAR, RANKS_VAR, RENDEZVOUS_VAR, RESERVE_BYTES_VAR, SLOTS_VAR, STAGES_VAR,
    TRANSPORT_VAR,
};
#[cfg(feature = "testing")]
pub use crate::pp::fault::ProtocolFault;
pub use error::{Error, PpError, ReceiverState, Result, SlotState};
pub use pending_readback::PendingReadback;
pub use plan::{BoundaryPlan, Plan, Transport, TransportPolicy};
pub use process_transport::{ProcessTransport, Reach, TransportReason};
pub use runtime::{PpNRt, ReceivedSlot, SM_COPY_MAX_BYTES, StageCapture, StepGraphs};
