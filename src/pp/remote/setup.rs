//! Setting the links up: the rendezvous, the connections between ranks, the communicators'
//! join and the first message that proves each link, every wait bounded.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::HELLO_MAGIC;
use super::ipc;
use super::link::{Carrier, Credit, Link, LinkFailure, PhaseCell, RankLinks};
use super::receiver::Inbound;
use super::sender::{ControlWriter, Heard, PEER_CLOSED, SendControl, Sender, silence_fails};
use super::wire::{BackReader, BackWriter};
use crate::Engine;
use crate::auth::{Admission, JobKey, Opener, Sealer, connect_and_knock, write_by};
use crate::nccl::{GRAPH_MIXING_VERSION, NcclComm, nccl, poll_pause};
use crate::pp::config::PpConfig;
use crate::pp::error::{Error, PpError, Result};
use crate::pp::fault::{EXIT_BEFORE_COMM_JOIN, FaultPoint};
use crate::pp::plan::{Plan, Transport};
use crate::pp::process_transport::IPC_TRANSPORT_BUILT;
use crate::rendezvous::{RankIdentity, Rendezvous, RendezvousError};
use crate::safe::{CudaEvent, CudaSlice, CudaStream};

/// The local side of every cross-rank boundary, keyed by boundary.
pub(in crate::pp) struct Links {
    pub(in crate::pp) senders: BTreeMap<usize, Arc<Sender>>,
    pub(in crate::pp) inbound: BTreeMap<usize, Inbound>,
}

/// What [`connect`] needs of a local stage: its engine (whose context it runs in) and stream.
pub(in crate::pp) struct LocalStage {
    pub(in crate::pp) engine: Engine,
    pub(in crate::pp) stream: Arc<CudaStream>,
}

/// A rank's contribution to the rendezvous: its listening port (two bytes, little-endian), then
/// whether it can run NCCL boundaries ([`NCCL_USABLE`]), or not ([`NCCL_UNUSABLE`], the reason
/// following, at most [`MAX_UNUSABLE_REASON`] bytes). A rank needs NCCL only where the plan gives
/// one of its boundaries NCCL, which every rank learns from the same table.
const NCCL_USABLE: u8 = 1;
const NCCL_UNUSABLE: u8 = 0;
/// The longest reason a rank without NCCL gives the others.
const MAX_UNUSABLE_REASON: usize = 1024;

/// Joins the other ranks of `config` (see the module docs), this rank reporting `identity` (its
/// host, user and devices), chooses the transport of each boundary between ranks from every
/// rank's identity (`plan` updated, the same on every rank), and returns this rank's links.
///
/// # Errors
/// [`Error::Rendezvous`] for a failed rendezvous or a listener that cannot be bound;
/// [`Error::Config`] for IPC forced where it cannot work; [`PpError::TransportUnavailable`] for
/// a boundary given IPC before its transport is built; [`PpError::PeerFailed`] for a connection
/// that fails; NCCL's error.
pub(in crate::pp) fn connect(
    config: &PpConfig,
    plan: &mut Plan,
    stages: &[Option<LocalStage>],
    identity: &RankIdentity,
) -> Result<Links> {
    let rank = config.rank();
    let timeout = config.peer_timeout();
    let cross: Vec<_> = plan.boundaries.iter().filter(|b| b.transport == Transport::Nccl).copied().collect();
    let rendezvous = Rendezvous {
        addr: config.rendezvous().unwrap_or_default().to_string(),
        rank,
        world: config.world(),
        fingerprint: config.fingerprint(),
        timeout,
        access: config.job_access().clone(),
    };
    // The listener of this rank's incoming boundaries: an ephemeral port of the interface that
    // reaches rank 0 (where the other ranks reach this one), never every interface.
    let interface = rendezvous.local_interface()?;
    let unbindable = |e: std::io::Error| RendezvousError::Address {
        addr: SocketAddr::new(interface, 0).to_string(),
        reason: e.to_string(),
    };
    let listener = TcpListener::bind(SocketAddr::new(interface, 0)).map_err(unbindable)?;
    let port = listener.local_addr().map_err(unbindable)?.port();
    // A rank without a usable NCCL still meets the others and says so: where the plan then gives
    // one of its boundaries NCCL, every rank fails at once, naming it, instead of waiting out the
    // peer timeout for it; an IPC-only job never needs NCCL.
    let usable = crate::nccl::nccl().map(|_| ());
    let mut contribution = port.to_le_bytes().to_vec();
    match &usable {
        Ok(()) => contribution.push(NCCL_USABLE),
        Err(e) => {
            contribution.push(NCCL_UNUSABLE);
            let reason = e.to_string();
            contribution.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_UNUSABLE_REASON)]);
        }
    }
    let members = rendezvous.exchange_as(identity, &contribution)?;
    let first_boundary = cross.first().map_or(0, |b| b.boundary);
    let contributions: Vec<&[u8]> = members.iter().map(|m| m.bytes.as_slice()).collect();
    let contributions = parse_contributions(&contributions, &cross)?;
    // Every rank computes the same choices from the same member table.
    let identities: Vec<RankIdentity> = members.iter().map(|m| m.identity.clone()).collect();
    plan.choose_processes_named(&identities, config.process_transport(), config.setting_names(), IPC_TRANSPORT_BUILT)?;
    plan.refuse_unbuilt()?;
    let over_nccl = |r: usize| {
        cross
            .iter()
            .map(|met| &plan.boundaries[met.boundary])
            .find(|b| b.transport == Transport::Nccl && (b.tx_rank == r || b.rx_rank == r))
    };
    // This rank's own cause first: it has an NCCL boundary and no NCCL.
    if let (Err(e), Some(_)) = (usable, over_nccl(rank)) {
        return Err(e.into());
    }
    if let Some((b, peer, reason)) = contributions.iter().enumerate().find_map(|(r, c)| {
        let reason = c.without_nccl.as_ref()?;
        over_nccl(r).map(|b| (b.boundary, r, reason))
    }) {
        return Err(Error::Pipeline(PpError::PeerFailed {
            boundary: b,
            peer,
            reason: format!("rank {peer} cannot run its NCCL boundaries: {reason}"),
        }));
    }
    let address_of = |r: usize| SocketAddr::new(members[r].addr, contributions[r].port);

    // Control connections, each authenticated both ways: the inbound ones are admitted on a
    // thread of their own while this one connects the outbound ones (two ranks may each send to
    // the other, so neither may wait for its own connections before serving the other's).
    let key = config.job_access().key();
    let admitting = {
        let (cross, key) = (cross.clone(), key.clone());
        std::thread::Builder::new()
            .name("ppnrt-admit".into())
            .spawn(move || accept_inbound(&listener, &cross, rank, timeout, &key))
            .map_err(|e| setup_error(first_boundary, rank, "starting the admission thread", &e))?
    };
    let mut outbound = BTreeMap::new();
    let mut outbound_failed = None;
    for b in cross.iter().filter(|b| b.tx_rank == rank) {
        match connect_outbound(b, address_of(b.rx_rank), timeout, &key) {
            Ok(connection) => {
                outbound.insert(b.boundary, connection);
            }
            Err(e) => {
                outbound_failed = Some(e);
                break;
            }
        }
    }
    let inbound_sockets = admitting.join().unwrap_or_else(|_| {
        Err(Error::Pipeline(PpError::PeerFailed {
            boundary: first_boundary,
            peer: rank,
            reason: "the admission thread panicked".into(),
        }))
    });
    if let Some(e) = outbound_failed {
        return Err(e);
    }
    let mut inbound_sockets = inbound_sockets?;

    let rank_links = Arc::new(RankLinks::default());
    // Communicators, in boundary order on every rank.
    let mut links = Links { senders: BTreeMap::new(), inbound: BTreeMap::new() };
    for met in &cross {
        // The boundary as the choice above left it (its transport and why).
        let b = &plan.boundaries[met.boundary];
        let sending = b.tx_rank == rank;
        if !sending && b.rx_rank != rank {
            continue;
        }
        let stage = if sending { b.boundary } else { b.boundary + 1 };
        let local = stages[stage].as_ref().expect("this rank runs its boundary's stage");
        let peer = if sending { b.rx_rank } else { b.tx_rank };
        let (mut socket, forward, back) = if sending {
            outbound.remove(&b.boundary).expect("connected above")
        } else {
            inbound_sockets.remove(&b.boundary).expect("accepted above")
        };
        // The keys' first use on the way back may be the NCCL id: the RX rank's answers continue
        // from there.
        let (mut back_sealer, mut back_opener) = (Sealer::new(back.clone()), Opener::new(back.clone()));
        let watched = setup_watched(config);
        // An IPC boundary's slots and flags (see `ipc`): the TX rank's mappings, or the RX rank's
        // exported slots for its ring.
        let mut mapped_slots = Vec::new();
        let mut exported_slots = None;
        let carrier = if b.transport == Transport::Ipc {
            exit_if_faulted_before_join(config);
            if sending {
                let taken = ipc::take(config, b, &mut socket, &local.stream, &local.engine)?;
                mapped_slots = taken.slots;
                Carrier::Ipc(taken.flags)
            } else {
                let offered = ipc::offer(config, b, &mut socket, &local.stream)?;
                exported_slots = Some(offered.slots);
                Carrier::Ipc(offered.flags)
            }
        } else {
            let id = if sending {
                nccl_id::take(b, &mut socket, &mut back_opener, timeout)?
            } else {
                nccl_id::offer(b, &mut socket, &mut back_sealer, timeout)?
            };
            exit_if_faulted_before_join(config);
            let nccl_rank = i32::from(!sending);
            Carrier::Nccl(if watched {
                let mut joining = setup_watch(&socket, "joining the NCCL communicator", timeout);
                NcclComm::init_rank_watched(local.engine.context(), 2, &id, nccl_rank, timeout, || {
                    joining()
                        .map_err(|reason| Error::Pipeline(PpError::PeerFailed { boundary: b.boundary, peer, reason }))
                })?
            } else {
                NcclComm::init_rank(local.engine.context(), 2, &id, nccl_rank)?
            })
        };
        let clone = |socket: &TcpStream| {
            socket.try_clone().map_err(|e| setup_error(b.boundary, peer, "cloning the connection", &e))
        };
        let recv_graphs = Mutex::new(Some(Vec::new()));
        // On the RX rank: its sealed answers to the TX rank (the receiver thread's, the
        // watchdog's and the stage's credits).
        let back_writer =
            (!sending).then(|| Arc::new(Mutex::new(BackWriter { sealer: back_sealer, unsent: Vec::new() })));
        let link = Arc::new(Link {
            boundary: b.boundary,
            peer,
            sends: sending,
            recv_graphs,
            graph_receives: AtomicU64::new(0),
            captures_missed: AtomicU32::new(0),
            carrier,
            failure: Arc::new(LinkFailure::new(b.boundary, peer)),
            rank_links: Arc::clone(&rank_links),
            connection: clone(&socket)?,
            timeout,
            silence_fails: silence_fails(config),
            phase: PhaseCell::new(),
            credit: back_writer.clone().map(|back| Credit { wanted: AtomicBool::new(false), back }),
            fault: config.faults(),
        });
        rank_links.add(&link);
        // Over NCCL a probe proves the link (and makes NCCL connect now, not in the first step);
        // an IPC boundary was proved by its setup.
        let probe = match link.nccl() {
            Some(_) => Some(CudaSlice::<u32>::alloc_persistent_eager(&local.stream, 4)?),
            None => None,
        };
        if sending {
            let watch = clone(&socket)?;
            if let (Some(comm), Some(probe)) = (link.nccl(), &probe) {
                // SAFETY: the RX rank's probe receive is of the same four `u32`s.
                unsafe { comm.send(&local.stream, probe, 1) }?;
                wait_for_probe(&link, &local.stream, &socket, watched)?;
            }
            let writer = Mutex::new(ControlWriter {
                socket: clone(&socket)?,
                sealer: Sealer::new(forward),
                written: Instant::now(),
                closed: false,
                wakes: link.ipc().map(ipc::IpcFlags::block),
            });
            let control = Mutex::new(SendControl {
                socket,
                back: BackReader { opener: back_opener, pending: Vec::new() },
                credit: 0,
                step: 0,
                ipc_slots: mapped_slots,
                closed: false,
                last_elem: None,
                sent: None,
            });
            let sender = Sender {
                link,
                tx_stream: Arc::clone(&local.stream),
                tx_device: b.tx_device,
                n_slots: config.slots(),
                control,
                writer,
                heard: Heard::new(),
                watch,
                fault: config.faults(),
            };
            links.senders.insert(b.boundary, Arc::new(sender));
        } else {
            let recv_stream = CudaStream::new(local.engine.context())?;
            if let (Some(comm), Some(mut probe)) = (link.nccl(), probe) {
                // SAFETY: the TX rank's probe send is of the same four `u32`s.
                unsafe { comm.recv(&recv_stream, &mut probe, 0) }?;
                wait_for_probe(&link, &recv_stream, &socket, watched)?;
            }
            let capture_stream = if link.nccl().is_some() && recv_graphs_allowed(config)? {
                Some(CudaStream::new(local.engine.context())?)
            } else {
                None
            };
            let opener = Opener::new(forward);
            let back = back_writer.expect("made above for the RX rank");
            links.inbound.insert(
                b.boundary,
                Inbound { link, socket, opener, back, recv_stream, capture_stream, exported_slots },
            );
        }
    }
    Ok(links)
}

/// Whether inbound links may receive through captured graphs: allowed by the configuration, an
/// NCCL of at least [`GRAPH_MIXING_VERSION`], and NCCL's support for mixing graph launches with
/// ordinary calls on one communicator not turned off (`NCCL_GRAPH_MIXING_SUPPORT=0`): without
/// it NCCL does not guarantee an ordinary call made while a graph launch is outstanding, and a
/// step of a new size is such a call.
pub(super) fn recv_graphs_allowed(config: &PpConfig) -> Result<bool> {
    Ok(config.nccl_recv_graphs()
        && nccl()?.version() >= GRAPH_MIXING_VERSION
        && !mixing_support_off(std::env::var("NCCL_GRAPH_MIXING_SUPPORT").ok().as_deref()))
}

/// Whether the value of `NCCL_GRAPH_MIXING_SUPPORT` turns the support off (NCCL reads it as an
/// integer; 0 is off).
pub(super) fn mixing_support_off(value: Option<&str>) -> bool {
    value.is_some_and(|text| text.trim().parse::<i64>() == Ok(0))
}

/// A rank's rendezvous contribution, read.
#[derive(Debug)]
struct Contribution {
    /// The port of its boundaries' listener.
    port: u16,
    /// Why it cannot load NCCL, when it cannot.
    without_nccl: Option<String>,
}

/// Reads every rank's rendezvous contribution: a listening port and an NCCL flag of 0 or 1 (see
/// [`NCCL_USABLE`]), the reason after a 0. The first that is not so fails the setup naming that
/// rank (the peer of its first boundary between ranks in `cross`) and the bad value: its length,
/// or its flag.
fn parse_contributions(contributions: &[&[u8]], cross: &[crate::pp::plan::BoundaryPlan]) -> Result<Vec<Contribution>> {
    let read = |r: usize, bytes: &[u8]| match *bytes {
        [low, high, NCCL_USABLE, ..] => Ok(Contribution { port: u16::from_le_bytes([low, high]), without_nccl: None }),
        [low, high, NCCL_UNUSABLE, ref reason @ ..] => Ok(Contribution {
            port: u16::from_le_bytes([low, high]),
            without_nccl: Some(String::from_utf8_lossy(reason).into_owned()),
        }),
        [_, _, flag, ..] => Err(format!("rank {r} contributed the NCCL flag {flag:#04x} (0: unusable, 1: usable)")),
        _ => Err(format!("rank {r} contributed {} byte(s): no listening port and NCCL flag", bytes.len())),
    };
    contributions
        .iter()
        .enumerate()
        .map(|(peer, bytes)| {
            read(peer, bytes).map_err(|reason| {
                let boundary = cross
                    .iter()
                    .find(|b| b.tx_rank == peer || b.rx_rank == peer)
                    .or(cross.first())
                    .map_or(0, |b| b.boundary);
                Error::Pipeline(PpError::PeerFailed { boundary, peer, reason })
            })
        })
        .collect()
}

/// Whether the setup's waits for NCCL are bounded and watch the peer (always, except with the
/// setup broken on purpose: [`ProtocolFault::UnwatchedSetup`](crate::pp::ProtocolFault), tests
/// only).
pub(super) fn setup_watched(config: &PpConfig) -> bool {
    !config.faults().at(FaultPoint::UnwatchedSetup)
}

/// With [`ProtocolFault::ExitBeforeCommJoin`](crate::pp::ProtocolFault) this rank exits here,
/// where it would join its first boundary's carrier: its NCCL communicator (the id already
/// handed over), or its IPC mappings (tests only).
fn exit_if_faulted_before_join(config: &PpConfig) {
    if config.faults().at(FaultPoint::ExitBeforeCommJoin) {
        std::process::exit(EXIT_BEFORE_COMM_JOIN);
    }
}

/// A check for a wait of the setup for NCCL (`what`): why the wait ends, when the peer closed
/// its end of the boundary's connection `socket` (it died) or `timeout` passed since this was
/// made.
pub(super) fn setup_watch<'a>(
    socket: &'a TcpStream,
    what: &'static str,
    timeout: Duration,
) -> impl FnMut() -> std::result::Result<(), String> + 'a {
    let deadline = Instant::now() + timeout;
    move || {
        if Instant::now() >= deadline {
            return Err(format!("{what} did not finish within {timeout:?}"));
        }
        match peer_closed(socket) {
            Ok(false) => Ok(()),
            Ok(true) => Err(format!("{PEER_CLOSED} while {what}")),
            Err(e) => Err(format!("the boundary's connection failed while {what}: {e}")),
        }
    }
}

/// Whether the peer closed its end of `socket`: a peek that does not block (the socket is
/// blocking again afterwards; the setup is its only user).
pub(super) fn peer_closed(socket: &TcpStream) -> std::io::Result<bool> {
    socket.set_nonblocking(true)?;
    let mut byte = [0u8; 1];
    let peeked = socket.peek(&mut byte);
    socket.set_nonblocking(false)?;
    match peeked {
        Ok(read) => Ok(read == 0),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until the probe's send or receive on `stream` completed. When `watched`, the wait is
/// bounded by the link's timeout and ends when the peer closes `socket`: the link then fails
/// (its communicator aborted, so the stream drains) and its error is returned.
pub(super) fn wait_for_probe(link: &Link, stream: &Arc<CudaStream>, socket: &TcpStream, watched: bool) -> Result<()> {
    if !watched {
        return Ok(stream.synchronize()?);
    }
    let done = CudaEvent::new(stream.context(), false)?;
    done.record(stream)?;
    let mut keep_waiting = setup_watch(socket, "moving the first message", link.timeout);
    let mut polls = 0u32;
    while !done.is_complete()? {
        if let Err(reason) = keep_waiting() {
            link.fail(reason.clone());
            stream.synchronize()?;
            return Err(link.stopped_or(&reason));
        }
        poll_pause(&mut polls);
    }
    Ok(())
}

pub(super) fn setup_error(boundary: usize, peer: usize, what: &str, e: &std::io::Error) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary, peer, reason: format!("{what}: {e}") })
}

/// A control connection with the keys of its records: `(connection, TX to RX, RX to TX)`.
pub(super) type Connection = (TcpStream, JobKey, JobKey);

/// How long one connection to a receiving rank's listener has for its handshake: a connection
/// that is silent, trickles or does not prove the job's key is closed then, and the others go on.
const HANDSHAKE_BUDGET: Duration = Duration::from_secs(2);
/// Connections a receiving rank's listener serves at once; a newcomer past them evicts the
/// oldest that has not proved the job's key (see [`crate::auth`]).
const MAX_PENDING_CONNECTIONS: usize = 256;
/// The sending rank's message: the boundary it connects.
const BOUNDARY_NAMED: usize = 4;
/// The receiving rank's answer: the boundary is taken...
const ACCEPTED: u8 = 1;
/// ... or not (not one of its boundaries, or connected already).
const NOT_ACCEPTED: u8 = 0;

/// The TX rank's control connection of boundary `b` to the RX rank at `addr`: connects (retrying
/// with backoff while the listener is not up or closes the connection unanswered, as it may in a
/// flood, within `timeout`), proves the job's key, checks the listener's proof, names the
/// boundary and waits for the answer.
pub(super) fn connect_outbound(
    b: &crate::pp::plan::BoundaryPlan,
    addr: SocketAddr,
    timeout: Duration,
    key: &JobKey,
) -> Result<Connection> {
    let deadline = Instant::now() + timeout;
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        Error::Pipeline(PpError::PeerFailed {
            boundary: b.boundary,
            peer: b.rx_rank,
            reason: format!("{what} at {addr}: {e}"),
        })
    };
    let (mut socket, handshake) = connect_and_knock(addr, key, HELLO_MAGIC, deadline)
        .map_err(|e| failed("connecting the boundary (the receiving rank's handshake)", &e))?;
    let boundary = (b.boundary as u32).to_le_bytes();
    handshake.send_message(&mut socket, key, &boundary, deadline).map_err(|e| failed("naming the boundary", &e))?;
    let answer = handshake
        .read_answer(&mut socket, key, deadline, |read: &[u8]| Ok((!read.is_empty()).then_some(1)))
        .map_err(|e| failed("the receiving rank's answer", &e))?;
    if answer != [ACCEPTED] {
        return Err(failed("the receiving rank", &"it does not take this boundary from this rank"));
    }
    socket.set_nodelay(true).map_err(|e| failed("TCP_NODELAY", &e))?;
    socket.set_write_timeout(Some(timeout)).map_err(|e| failed("write timeout", &e))?;
    let (forward, back) = handshake.record_keys(key, &(b.boundary as u64).to_le_bytes());
    Ok((socket, forward, back))
}

/// Admits one connection per boundary this rank receives, each proving the job's key and naming
/// its boundary, within `timeout` in all. Connections that do not prove the key, or name a
/// boundary this rank does not receive or has already, are closed and cost the others nothing.
pub(super) fn accept_inbound(
    listener: &TcpListener,
    cross: &[crate::pp::plan::BoundaryPlan],
    rank: usize,
    timeout: Duration,
    key: &JobKey,
) -> Result<BTreeMap<usize, Connection>> {
    let wanted: Vec<_> = cross.iter().filter(|b| b.rx_rank == rank).map(|b| (b.boundary, b.tx_rank)).collect();
    let mut sockets = BTreeMap::new();
    let unusable = |e: std::io::Error| {
        let addr = listener.local_addr().map_or_else(|_| "the boundary listener".into(), |a| a.to_string());
        RendezvousError::Address { addr, reason: e.to_string() }
    };
    let mut admission = Admission::new(
        listener,
        key.clone(),
        HELLO_MAGIC,
        HANDSHAKE_BUDGET.min(timeout),
        MAX_PENDING_CONNECTIONS,
        BOUNDARY_NAMED,
    )
    .map_err(unusable)?;
    let start = Instant::now();
    let deadline = start + timeout;
    let boundary_named = |read: &[u8]| Ok((read.len() >= BOUNDARY_NAMED).then_some(BOUNDARY_NAMED));
    while sockets.len() < wanted.len() {
        if start.elapsed() >= timeout {
            let (b, peer) = wanted.iter().find(|(b, _)| !sockets.contains_key(b)).copied().unwrap_or((0, 0));
            return Err(Error::Pipeline(PpError::PeerFailed {
                boundary: b,
                peer,
                reason: format!("the sending rank never connected within {timeout:?}{}", admission.refusals()),
            }));
        }
        let Some(mut admitted) = admission.poll(&boundary_named).map_err(unusable)? else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let b = u32::from_le_bytes(admitted.message[..4].try_into().expect("four bytes")) as usize;
        let fresh = wanted.iter().any(|&(w, _)| w == b) && !sockets.contains_key(&b);
        let answer = if fresh { ACCEPTED } else { NOT_ACCEPTED };
        if write_by(&mut admitted.stream, &admitted.handshake.answer(key, &[answer]), deadline).is_err() || !fresh {
            continue;
        }
        let peer = wanted.iter().find(|&&(w, _)| w == b).map_or(0, |&(_, p)| p);
        admitted.stream.set_nodelay(true).map_err(|e| setup_error(b, peer, "TCP_NODELAY", &e))?;
        admitted.stream.set_write_timeout(Some(timeout)).map_err(|e| setup_error(b, peer, "write timeout", &e))?;
        let (forward, back) = admitted.handshake.record_keys(key, &(b as u64).to_le_bytes());
        sockets.insert(b, (admitted.stream, forward, back));
    }
    Ok(sockets)
}

mod fingerprint;
mod nccl_id;
#[cfg(test)]
mod tests;
