//! Setting the links up: the rendezvous, the connections between ranks, the communicators'
//! join and the first message that proves each link, every wait bounded.

use super::*;

/// The local side of every cross-rank boundary, keyed by boundary.
pub(in crate::pp) struct Links {
    pub(in crate::pp) senders: BTreeMap<usize, Arc<Sender>>,
    pub(in crate::pp) inbound: BTreeMap<usize, Inbound>,
}

/// What [`connect`] needs of a local stage: its context and stream.
pub(in crate::pp) struct LocalStage {
    pub(in crate::pp) ctx: Arc<Context>,
    pub(in crate::pp) stream: Arc<CudaStream>,
}

/// A rank's contribution to the rendezvous starts with this byte when it can run its boundaries
/// (its listening port and, from rank 0, the NCCL ids follow)...
const READY: u8 = 1;
/// ... and with this one when it cannot (the reason follows, at most [`MAX_UNABLE_REASON`] bytes).
const UNABLE: u8 = 0;
/// The longest reason a rank that cannot run its boundaries gives the others.
const MAX_UNABLE_REASON: usize = 1024;

/// Joins the other ranks of `config` (see the module docs) and returns this rank's links.
///
/// # Errors
/// [`Error::Rendezvous`] for a failed rendezvous or a listener that cannot be bound;
/// [`PpError::PeerFailed`] for a connection that
/// fails; NCCL's error.
pub(in crate::pp) fn connect(config: &PpConfig, plan: &Plan, stages: &[Option<LocalStage>]) -> Result<Links> {
    let rank = config.own_rank();
    let timeout = config.peer_timeout_value();
    let cross: Vec<_> = plan.boundaries.iter().filter(|b| b.transport == Transport::Nccl).copied().collect();
    // The listener of this rank's incoming boundaries, on an ephemeral port of every interface.
    let unbindable = |e: std::io::Error| RendezvousError::Address { addr: "0.0.0.0:0".into(), reason: e.to_string() };
    let listener = TcpListener::bind("0.0.0.0:0").map_err(unbindable)?;
    let port = listener.local_addr().map_err(unbindable)?.port();
    // A rank that cannot run its boundaries (no usable NCCL) still meets the others and says so:
    // they fail at once, naming it, instead of waiting out the peer timeout for it.
    let usable = crate::nccl::nccl().map(|_| ());
    let mut contribution = Vec::new();
    match &usable {
        Ok(()) => {
            contribution.push(READY);
            contribution.extend_from_slice(&port.to_le_bytes());
            if rank == 0 {
                for _ in &cross {
                    contribution.extend_from_slice(&NcclUniqueId::new()?.to_bytes());
                }
            }
        }
        Err(e) => {
            contribution.push(UNABLE);
            let reason = e.to_string();
            contribution.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_UNABLE_REASON)]);
        }
    }
    let rendezvous = Rendezvous {
        addr: config.rendezvous_addr().unwrap_or_default().to_string(),
        rank,
        world: config.world(),
        fingerprint: config.fingerprint(),
        timeout,
    };
    let members = rendezvous.exchange(&contribution);
    // This rank's own cause first, whatever the rendezvous gave.
    usable?;
    let members = members?;
    let first_boundary = cross.first().map_or(0, |b| b.boundary);
    if let Some((peer, reason)) = members.iter().enumerate().find_map(|(r, m)| {
        (m.bytes.first() == Some(&UNABLE)).then(|| (r, String::from_utf8_lossy(&m.bytes[1..]).into_owned()))
    }) {
        let boundary =
            cross.iter().find(|b| b.tx_rank == peer || b.rx_rank == peer).map_or(first_boundary, |b| b.boundary);
        return Err(Error::Pipeline(PpError::PeerFailed {
            boundary,
            peer,
            reason: format!("rank {peer} cannot run its boundaries: {reason}"),
        }));
    }
    let malformed = |reason: String| Error::Pipeline(PpError::PeerFailed { boundary: first_boundary, peer: 0, reason });
    if let Some(short) = members.iter().position(|m| m.bytes.len() < 3 || m.bytes[0] != READY) {
        return Err(malformed(format!("rank {short} contributed no listening port")));
    }
    let ids = &members[0].bytes[3..];
    if ids.len() != cross.len() * NcclUniqueId::BYTES {
        return Err(malformed(format!("rank 0 handed out {} id bytes for {} boundaries", ids.len(), cross.len())));
    }
    let address_of =
        |r: usize| SocketAddr::new(members[r].addr, u16::from_le_bytes([members[r].bytes[1], members[r].bytes[2]]));

    // Control connections: every outbound one first (a connect completes in the listener's
    // backlog, so no rank waits on another here), then accept the inbound ones in any order.
    let mut outbound = BTreeMap::new();
    for b in cross.iter().filter(|b| b.tx_rank == rank) {
        let mut socket = connect_with_retry(address_of(b.rx_rank), timeout)
            .map_err(|e| setup_error(b.boundary, b.rx_rank, "connecting the boundary", &e))?;
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&(b.boundary as u32).to_le_bytes());
        socket.write_all(&hello).map_err(|e| setup_error(b.boundary, b.rx_rank, "greeting the receiver", &e))?;
        socket.set_nodelay(true).map_err(|e| setup_error(b.boundary, b.rx_rank, "TCP_NODELAY", &e))?;
        socket.set_write_timeout(Some(timeout)).map_err(|e| setup_error(b.boundary, b.rx_rank, "write timeout", &e))?;
        outbound.insert(b.boundary, socket);
    }
    let mut inbound_sockets = accept_inbound(&listener, &cross, rank, timeout)?;

    // Communicators, in boundary order on every rank.
    let mut links = Links { senders: BTreeMap::new(), inbound: BTreeMap::new() };
    for (i, b) in cross.iter().enumerate() {
        let sending = b.tx_rank == rank;
        if !sending && b.rx_rank != rank {
            continue;
        }
        let id: &[u8; NcclUniqueId::BYTES] =
            ids[i * NcclUniqueId::BYTES..(i + 1) * NcclUniqueId::BYTES].try_into().expect("sliced to the id's size");
        let stage = if sending { b.boundary } else { b.boundary + 1 };
        let local = stages[stage].as_ref().expect("this rank runs its boundary's stage");
        let peer = if sending { b.rx_rank } else { b.tx_rank };
        let socket = if sending {
            outbound.remove(&b.boundary).expect("connected above")
        } else {
            inbound_sockets.remove(&b.boundary).expect("accepted above")
        };
        let watched = setup_watched(config);
        let id = NcclUniqueId::from_bytes(id);
        let nccl_rank = i32::from(!sending);
        let comm = if watched {
            let mut joining = setup_watch(&socket, "joining the NCCL communicator", timeout);
            NcclComm::init_rank_watched(&local.ctx, 2, &id, nccl_rank, timeout, || {
                joining().map_err(|reason| Error::Pipeline(PpError::PeerFailed { boundary: b.boundary, peer, reason }))
            })?
        } else {
            NcclComm::init_rank(&local.ctx, 2, &id, nccl_rank)?
        };
        let clone = |socket: &TcpStream| {
            socket.try_clone().map_err(|e| setup_error(b.boundary, peer, "cloning the connection", &e))
        };
        let recv_graphs = Mutex::new(Some(Vec::new()));
        let link = Arc::new(Link {
            boundary: b.boundary,
            peer,
            recv_graphs,
            graph_receives: AtomicU64::new(0),
            captures_missed: AtomicU32::new(0),
            comm,
            failure: Arc::new(LinkFailure::new(b.boundary, peer)),
            connection: clone(&socket)?,
            timeout,
            silence_fails: silence_fails(config),
            phase: PhaseCell::new(),
        });
        let probe = CudaSlice::<u32>::alloc_persistent_eager(&local.stream, 4)?;
        if sending {
            let watch = clone(&socket)?;
            // The probe proves the link (and makes NCCL connect now, not in the first step).
            link.comm.send(&local.stream, &probe, 1)?;
            wait_for_probe(&link, &local.stream, &socket, watched)?;
            let control = Mutex::new(SendControl { socket, step: 0, closed: false, written: Instant::now() });
            let sender = Sender {
                link,
                tx_stream: Arc::clone(&local.stream),
                tx_device: b.tx_device,
                n_slots: config.n_slots(),
                control,
                watch,
                #[cfg(feature = "testing")]
                announce_only: config.fault() == crate::pp::config::ProtocolFault::AnnounceWithoutSend,
            };
            links.senders.insert(b.boundary, Arc::new(sender));
        } else {
            let recv_stream = CudaStream::new(&local.ctx)?;
            let mut probe = probe;
            link.comm.recv(&recv_stream, &mut probe, 0)?;
            wait_for_probe(&link, &recv_stream, &socket, watched)?;
            let capture_stream = if recv_graphs_allowed(config)? { Some(CudaStream::new(&local.ctx)?) } else { None };
            links.inbound.insert(b.boundary, Inbound { link, socket, recv_stream, capture_stream });
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
    Ok(config.nccl_recv_graphs_allowed()
        && nccl()?.version() >= GRAPH_MIXING_VERSION
        && !mixing_support_off(std::env::var("NCCL_GRAPH_MIXING_SUPPORT").ok().as_deref()))
}

/// Whether the value of `NCCL_GRAPH_MIXING_SUPPORT` turns the support off (NCCL reads it as an
/// integer; 0 is off).
pub(super) fn mixing_support_off(value: Option<&str>) -> bool {
    value.is_some_and(|text| text.trim().parse::<i64>() == Ok(0))
}

/// Whether the setup's waits for NCCL are bounded and watch the peer (always, except with the
/// setup broken on purpose: [`ProtocolFault::UnwatchedSetup`](crate::pp::ProtocolFault), tests
/// only). With [`ProtocolFault::ExitBeforeCommJoin`](crate::pp::ProtocolFault) this rank exits
/// here, before it joins its first communicator (tests only).
pub(super) fn setup_watched(config: &PpConfig) -> bool {
    #[cfg(feature = "testing")]
    match config.fault() {
        crate::pp::config::ProtocolFault::ExitBeforeCommJoin => std::process::exit(EXIT_BEFORE_COMM_JOIN),
        crate::pp::config::ProtocolFault::UnwatchedSetup => return false,
        _ => {}
    }
    #[cfg(not(feature = "testing"))]
    let _ = config;
    true
}

/// The exit status of a rank that exits before it joins a communicator on purpose
/// ([`ProtocolFault::ExitBeforeCommJoin`](crate::pp::ProtocolFault)).
#[cfg(feature = "testing")]
pub(super) const EXIT_BEFORE_COMM_JOIN: i32 = 86;

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
        return stream.synchronize();
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

pub(super) fn connect_with_retry(addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(socket) => return Ok(socket),
            Err(e) if start.elapsed() >= timeout => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Accepts one connection per boundary this rank receives, each greeting with its boundary.
pub(super) fn accept_inbound(
    listener: &TcpListener,
    cross: &[crate::pp::plan::BoundaryPlan],
    rank: usize,
    timeout: Duration,
) -> Result<BTreeMap<usize, TcpStream>> {
    let wanted: Vec<_> = cross.iter().filter(|b| b.rx_rank == rank).map(|b| (b.boundary, b.tx_rank)).collect();
    let mut sockets = BTreeMap::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| RendezvousError::Address { addr: "0.0.0.0:0".into(), reason: e.to_string() })?;
    let start = Instant::now();
    while sockets.len() < wanted.len() {
        let missing = || wanted.iter().find(|(b, _)| !sockets.contains_key(b)).copied().unwrap_or((0, 0));
        let (mut socket, _) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if start.elapsed() >= timeout {
                    let (b, peer) = missing();
                    return Err(Error::Pipeline(PpError::PeerFailed {
                        boundary: b,
                        peer,
                        reason: format!("the sending rank never connected within {timeout:?}"),
                    }));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                let (b, peer) = missing();
                return Err(setup_error(b, peer, "accepting a connection", &e));
            }
        };
        let mut hello = [0u8; 12];
        let greeted = socket
            .set_nonblocking(false)
            .and_then(|()| socket.set_read_timeout(Some(timeout.saturating_sub(start.elapsed()).max(POLL))))
            .and_then(|()| socket.read_exact(&mut hello));
        if greeted.is_err() || &hello[..8] != HELLO_MAGIC {
            continue; // not one of ours
        }
        let b = u32::from_le_bytes(hello[8..12].try_into().expect("four bytes")) as usize;
        if wanted.iter().any(|&(w, _)| w == b) && !sockets.contains_key(&b) {
            let peer = wanted.iter().find(|&&(w, _)| w == b).map_or(0, |&(_, p)| p);
            socket.set_nodelay(true).map_err(|e| setup_error(b, peer, "TCP_NODELAY", &e))?;
            socket.set_write_timeout(Some(timeout)).map_err(|e| setup_error(b, peer, "write timeout", &e))?;
            sockets.insert(b, socket);
        }
    }
    Ok(sockets)
}
