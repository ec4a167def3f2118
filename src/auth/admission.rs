//! The listening end of the handshake ([`Admission`]) and the connecting end's attempts
//! ([`connect_and_knock`]), with every read and write on a socket a stranger can reach bounded in
//! size and time.
//!
//! What a stranger on the port can cost the host: before a connection proves the job's key the
//! host reads at most the knock (a nonce and a proof), and afterwards at most the protocol's
//! largest message, each connection within its own budget (as OpenSSH's `LoginGraceTime`), and
//! the host holds at most a bounded number of connections at once. When that bound is reached, a
//! newcomer evicts the oldest connection that has not proved the key (first among its own source
//! address's, each source holding at most a quarter of the bound), never one that has: a flood
//! of strangers costs the members at most a retry (OpenSSH's `MaxStartups` drops unauthenticated
//! connections early, never members). The host accepts a bounded number of connections per
//! poll and reads the knocks already there before it accepts more, so a member's fresh
//! connection meets a read of its knock before newer ones can evict it. Running out of file
//! descriptors or buffers while accepting (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) frees a
//! descriptor by evicting the oldest unproven connection, or pauses accepting a moment: it never
//! ends the admission, nor does a connection that failed before it was accepted.
//!
//! The connecting end retries, with backoff and within its deadline, a connection the host
//! closed before answering its knock (evicted in a flood) or that could not be made; a host that
//! does not prove the key, or speaks another protocol, is an error at once.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::handshake::{Handshake, KnockError, NONCE, knock, nonce};
use super::seal::{JobKey, PROOF};
use super::wire::{Listen, Wire};

/// Tells from the first bytes of a message how long it is: `Ok(None)` while that is not known
/// yet, an error for bytes that are no such message.
pub(crate) type LengthOf = dyn Fn(&[u8]) -> Result<Option<usize>, String>;

/// A connection the host admitted: the guest proved the key and sent its message.
pub(crate) struct Admitted<S = TcpStream, P = SocketAddr> {
    /// The connection, blocking again.
    pub(crate) stream: S,
    pub(crate) peer: P,
    pub(crate) message: Vec<u8>,
    pub(crate) handshake: Handshake,
}

/// A connection whose handshake is under way on the host.
struct Pending<S, P> {
    stream: S,
    peer: P,
    handshake: Handshake,
    /// Whether the guest proved the key (it is then never evicted for a newcomer).
    knocked: bool,
    read: Vec<u8>,
    deadline: Instant,
    /// The order of arrival (the oldest unproven connection is evicted first).
    arrival: u64,
}

/// The most bytes one read of a pending connection takes.
const CHUNK: usize = 4096;
/// How long accepting pauses when the process is out of descriptors and no unproven connection
/// can make room.
const ACCEPT_PAUSE: Duration = Duration::from_millis(10);

/// The host's side of the handshake for every connection a listener accepts: all are served at
/// once without blocking, each within its own budget, and a connection that is silent, trickles,
/// floods, speaks another protocol or does not prove the key is closed without a word, costing
/// the others nothing (see the module docs for what it reads and whom it evicts).
pub(crate) struct Admission<'a, L: Listen = TcpListener> {
    listener: &'a L,
    key: JobKey,
    magic: [u8; 8],
    budget: Duration,
    max_pending: usize,
    /// The most unproven connections of one source address held at once.
    per_source: usize,
    max_message: usize,
    pending: Vec<Pending<L::Stream, L::Peer>>,
    arrivals: u64,
    /// No accept before this (the process ran out of descriptors).
    accept_after: Option<Instant>,
    /// Connections closed because they did not prove the key.
    unproven: usize,
    /// Connections closed for silence, another protocol or a malformed message.
    dropped: usize,
    /// Unproven connections evicted for newcomers (or for a descriptor).
    evicted: usize,
    last_refused: Option<L::Peer>,
}

impl<'a, L: Listen> Admission<'a, L> {
    /// Serves `listener` (made non-blocking) for the protocol `magic`, giving each connection
    /// `budget` for its handshake and message (at most `max_message` bytes), and holding at most
    /// `max_pending` connections at once (see the module docs for whom a newcomer evicts).
    pub(crate) fn new(
        listener: &'a L,
        key: JobKey,
        magic: &[u8; 8],
        budget: Duration,
        max_pending: usize,
        max_message: usize,
    ) -> std::io::Result<Admission<'a, L>> {
        listener.set_nonblocking(true)?;
        let max_pending = max_pending.max(1);
        Ok(Admission {
            listener,
            key,
            magic: *magic,
            budget,
            max_pending,
            per_source: (max_pending / 4).max(1),
            max_message,
            pending: Vec::new(),
            arrivals: 0,
            accept_after: None,
            unproven: 0,
            dropped: 0,
            evicted: 0,
            last_refused: None,
        })
    }

    /// Advances every pending handshake, then accepts what waits (a bounded number), and returns
    /// the first admitted connection, if any. `length_of` tells from the bytes of a guest's
    /// message read so far how long the message is (`Ok(None)`: not yet known; an error, or a
    /// length past `max_message`: malformed, the connection is closed). Returns `Ok(None)` when
    /// nothing is admitted now (the caller pauses briefly). Reads at most the knock before a
    /// connection proves the key, and at most its message after.
    ///
    /// # Errors
    /// The listener itself failed (not a connection, nor the process running out of
    /// descriptors: those are transient).
    pub(crate) fn poll(&mut self, length_of: &LengthOf) -> std::io::Result<Option<Admitted<L::Stream, L::Peer>>> {
        // The knocks already here first: a member's connection has proved the key before a
        // newcomer may evict it.
        let now = Instant::now();
        let mut at = 0;
        while at < self.pending.len() {
            match self.advance(at, length_of) {
                Step::Admitted(message) => {
                    let connection = self.pending.swap_remove(at);
                    if connection.stream.set_nonblocking(false).is_ok() {
                        return Ok(Some(Admitted {
                            stream: connection.stream,
                            peer: connection.peer,
                            message,
                            handshake: connection.handshake,
                        }));
                    }
                    self.dropped += 1;
                }
                Step::Waiting if now < self.pending[at].deadline => at += 1,
                Step::Waiting | Step::Dropped => {
                    self.last_refused = Some(self.pending.swap_remove(at).peer);
                    self.dropped += 1;
                }
                Step::Unproven => {
                    self.last_refused = Some(self.pending.swap_remove(at).peer);
                    self.unproven += 1;
                }
            }
        }
        self.accept()?;
        Ok(None)
    }

    /// What the closed connections were, for an error that ends the wait (empty when none).
    pub(crate) fn refusals(&self) -> String {
        if self.unproven + self.dropped + self.evicted == 0 {
            return String::new();
        }
        let last = self.last_refused.map_or(String::new(), |peer| format!(", the last from {peer}"));
        format!(
            "; {} connection(s) did not prove the job secret, {} were silent or spoke another protocol and {} \
             were evicted unproven by newer ones{last} (is the same job secret set on every rank?)",
            self.unproven, self.dropped, self.evicted
        )
    }

    /// Accepts at most an eighth of the bound per poll (a source's share is a quarter: a
    /// member's connection accepted in this poll is not evicted by the rest of it).
    fn accept(&mut self) -> std::io::Result<()> {
        if self.accept_after.is_some_and(|after| Instant::now() < after) {
            return Ok(());
        }
        self.accept_after = None;
        for _ in 0..(self.per_source / 2).max(1) {
            match self.listener.accept() {
                Ok((stream, peer)) => self.challenge(stream, peer),
                Err(e) => match accept_failure(&e) {
                    AcceptFailure::Drained => return Ok(()),
                    AcceptFailure::Connection => {}
                    AcceptFailure::Descriptors => {
                        // The connection waits in the listener's queue; closing the oldest
                        // unproven connection frees a descriptor for it, or accepting pauses.
                        if !self.evict_oldest(None) {
                            self.accept_after = Some(Instant::now() + ACCEPT_PAUSE);
                            return Ok(());
                        }
                    }
                    AcceptFailure::Listener => return Err(e),
                },
            }
        }
        Ok(())
    }

    /// Makes room for a newcomer from `peer` (its source's oldest unproven connection when the
    /// source holds its share, then the oldest unproven one when the bound is reached) and sends
    /// it the challenge; closes it when every connection held has proved the key.
    fn challenge(&mut self, mut stream: L::Stream, peer: L::Peer) {
        let source = L::source(&peer);
        let of_source = self.pending.iter().filter(|p| !p.knocked && L::source(&p.peer) == source).count();
        if of_source >= self.per_source {
            self.evict_oldest(Some(source));
        }
        if self.pending.len() >= self.max_pending && !self.evict_oldest(None) {
            self.dropped += 1;
            return;
        }
        let Ok(host) = nonce() else { return };
        if stream.set_nonblocking(true).is_err() {
            self.dropped += 1;
            return;
        }
        let mut challenge = self.magic.to_vec();
        challenge.extend_from_slice(&host);
        // Forty bytes into a fresh connection's empty buffer: written whole, or the
        // connection is gone.
        if !matches!(stream.write(&challenge), Ok(n) if n == challenge.len()) {
            self.dropped += 1;
            return;
        }
        self.arrivals += 1;
        self.pending.push(Pending {
            stream,
            peer,
            handshake: Handshake { magic: self.magic, host, guest: [0; NONCE] },
            knocked: false,
            read: Vec::new(),
            deadline: Instant::now() + self.budget,
            arrival: self.arrivals,
        });
    }

    /// Closes the oldest connection that has not proved the key (of `source` only, when given);
    /// whether there was one.
    fn evict_oldest(&mut self, source: Option<L::Source>) -> bool {
        let oldest = self
            .pending
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.knocked && source.is_none_or(|source| L::source(&p.peer) == source))
            .min_by_key(|(_, p)| p.arrival)
            .map(|(at, _)| at);
        let Some(at) = oldest else { return false };
        self.last_refused = Some(self.pending.swap_remove(at).peer);
        self.evicted += 1;
        true
    }

    /// The most bytes connection `at` may have sent so far: its knock before it proved the key,
    /// then its message and proof (the largest message while its length is not known).
    fn allowance(&self, at: usize, length_of: &LengthOf) -> Result<usize, Step> {
        let connection = &self.pending[at];
        if !connection.knocked {
            return Ok(NONCE + PROOF);
        }
        match length_of(&connection.read) {
            Ok(Some(length)) if length <= self.max_message => Ok(length + PROOF),
            Ok(Some(_)) | Err(_) => Err(Step::Dropped),
            Ok(None) => Ok(self.max_message + PROOF),
        }
    }

    fn advance(&mut self, at: usize, length_of: &LengthOf) -> Step {
        let mut chunk = [0u8; CHUNK];
        loop {
            let allowed = match self.allowance(at, length_of) {
                Ok(allowed) => allowed,
                Err(step) => return step,
            };
            let connection = &mut self.pending[at];
            let room = allowed - connection.read.len();
            if room == 0 {
                break;
            }
            match connection.stream.read(&mut chunk[..room.min(CHUNK)]) {
                Ok(0) => return Step::Dropped,
                Ok(n) => connection.read.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Dropped,
            }
            if !connection.knocked && connection.read.len() == NONCE + PROOF {
                connection.handshake.guest = connection.read[..NONCE].try_into().expect("sliced to a nonce");
                if !connection.handshake.verify(&self.key, b"knock", &[], &connection.read[NONCE..]) {
                    return Step::Unproven;
                }
                connection.read.clear();
                connection.knocked = true;
                let welcome = connection.handshake.prove(&self.key, b"welcome", &[]);
                // Thirty-two bytes into a buffer the guest has not filled (it waits for them).
                if !matches!(connection.stream.write(&welcome), Ok(PROOF)) {
                    return Step::Dropped;
                }
            }
        }
        // The whole message and its proof are here (a message whose length is still not known
        // at the largest size is none); a guest waits for the answer, so anything past them is
        // another protocol.
        let connection = &mut self.pending[at];
        if !matches!(length_of(&connection.read), Ok(Some(length)) if length + PROOF == connection.read.len()) {
            return Step::Dropped;
        }
        if !matches!(connection.stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == ErrorKind::WouldBlock) {
            return Step::Dropped;
        }
        let (message, proof) = connection.read.split_at(connection.read.len() - PROOF);
        if !connection.handshake.verify(&self.key, b"message", message, proof) {
            return Step::Unproven;
        }
        Step::Admitted(message.to_vec())
    }
}

enum Step {
    Admitted(Vec<u8>),
    Waiting,
    Dropped,
    Unproven,
}

/// What an error of `accept` means.
#[derive(Debug, PartialEq, Eq)]
enum AcceptFailure {
    /// Nothing more waits.
    Drained,
    /// One connection failed before it was accepted (or a signal came): go on.
    Connection,
    /// The process or the system is out of descriptors or buffers: transient.
    Descriptors,
    /// The listener itself cannot be used.
    Listener,
}

/// Linux's numbers of the errors `accept` reports that `std` gives no kind of their own.
mod errno {
    pub(super) const EMFILE: i32 = 24;
    pub(super) const ENFILE: i32 = 23;
    pub(super) const ENOBUFS: i32 = 105;
    pub(super) const ENOMEM: i32 = 12;
    pub(super) const EPROTO: i32 = 71;
    pub(super) const ENONET: i32 = 64;
    pub(super) const EHOSTDOWN: i32 = 112;
    pub(super) const ENOPROTOOPT: i32 = 92;
    pub(super) const EOPNOTSUPP: i32 = 95;
}

/// Sorts an error of `accept`: Linux passes a new connection's own network errors through
/// `accept` (to be retried, as its manual says), and running out of descriptors or buffers
/// passes; only an error of the listener itself ends the admission.
fn accept_failure(e: &std::io::Error) -> AcceptFailure {
    use errno::*;
    match e.kind() {
        ErrorKind::WouldBlock => return AcceptFailure::Drained,
        ErrorKind::OutOfMemory => return AcceptFailure::Descriptors,
        ErrorKind::Interrupted
        | ErrorKind::ConnectionAborted
        | ErrorKind::ConnectionReset
        | ErrorKind::PermissionDenied
        | ErrorKind::TimedOut
        | ErrorKind::NetworkDown
        | ErrorKind::NetworkUnreachable
        | ErrorKind::HostUnreachable => return AcceptFailure::Connection,
        _ => {}
    }
    match e.raw_os_error() {
        Some(EMFILE | ENFILE | ENOBUFS | ENOMEM) => AcceptFailure::Descriptors,
        Some(EPROTO | ENONET | EHOSTDOWN | ENOPROTOOPT | EOPNOTSUPP) => AcceptFailure::Connection,
        _ => AcceptFailure::Listener,
    }
}

/// The first pause between a guest's attempts; each later one doubles, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// The longest one attempt to connect waits.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(500);
/// A host that closes the connection right after this many knocks in a row holds another key
/// (one such close may be a flood's eviction racing the knock).
const CLOSES_AFTER_KNOCK: u32 = 3;

/// The guest's side: connects to `addr` and runs the handshake's steps 1–3 ([`knock`]),
/// retrying with backoff until `deadline` while the host does not listen, closes the connection
/// before it answers (a flood evicted it) or the connection fails.
///
/// # Errors
/// When `deadline` passes: the last attempt's error if it timed out, else
/// [`KnockError::Unreached`] naming it. At once: a host that does not prove the key or speaks
/// another protocol, and one that closed the connection right after this guest's knock
/// [`CLOSES_AFTER_KNOCK`] times in a row (it holds another key).
pub(crate) fn connect_and_knock(
    addr: SocketAddr,
    key: &JobKey,
    magic: &[u8; 8],
    deadline: Instant,
) -> Result<(TcpStream, Handshake), KnockError> {
    connect_and_knock_with(
        |left| match TcpStream::connect_timeout(&addr, left.min(CONNECT_ATTEMPT)) {
            // While nothing listens at a port of the ephemeral range, a connection to it can be
            // given that very port as its own and meet itself (TCP's simultaneous open): it
            // would hold the host's port and read its own knock. Dropped, it frees the port.
            Ok(stream) if stream.local_addr().ok() == Some(addr) => Err(std::io::Error::new(
                ErrorKind::ConnectionRefused,
                format!("nothing listens at {addr} yet (the connection met itself)"),
            )),
            other => other,
        },
        key,
        magic,
        deadline,
    )
}

/// [`connect_and_knock`] over any connection: `connect(left)` makes one attempt to connect,
/// waiting at most `left`; the same retries, backoff and errors.
///
/// # Errors
/// As [`connect_and_knock`].
pub(crate) fn connect_and_knock_with<S: Wire>(
    mut connect: impl FnMut(Duration) -> std::io::Result<S>,
    key: &JobKey,
    magic: &[u8; 8],
    deadline: Instant,
) -> Result<(S, Handshake), KnockError> {
    let mut backoff = FIRST_BACKOFF;
    let mut closes_after_knock = 0;
    let mut last: Option<KnockError> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(match last {
                Some(e) if e.timed_out() => e,
                Some(e) => KnockError::Unreached(e.to_string()),
                None => KnockError::Unreached("no attempt before the deadline".into()),
            });
        }
        let attempt = match connect(left) {
            Ok(mut stream) => knock(&mut stream, key, magic, deadline).map(|handshake| (stream, handshake)),
            Err(e) => Err(KnockError::Io(e)),
        };
        let e = match attempt {
            Ok(admitted) => return Ok(admitted),
            Err(e @ (KnockError::NotOurs | KnockError::Unproven(_) | KnockError::Malformed(_))) => return Err(e),
            Err(e) => e,
        };
        if matches!(e, KnockError::Closed { after_knock: true }) {
            closes_after_knock += 1;
            if closes_after_knock >= CLOSES_AFTER_KNOCK {
                return Err(e);
            }
        } else {
            closes_after_knock = 0;
        }
        last = Some(e);
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Writes all of `bytes` to `stream` by `deadline` (a stalled reader cannot hold the writer past
/// it). A `TimedOut` error names the bytes left.
pub(crate) fn write_by(stream: &mut impl Wire, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("{} byte(s) still unwritten at the deadline (the peer does not read)", bytes.len()),
            ));
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes each stream's pieces whole to it, to all streams at once (none waits for another),
/// until `deadline`, trying each at least once. Returns each stream's outcome, in order: a stream
/// whose reader stalls gets a `TimedOut` error naming the bytes left. The streams are blocking
/// again afterwards.
pub(crate) fn write_each_by(streams: &[(&TcpStream, &[&[u8]])], deadline: Instant) -> Vec<std::io::Result<()>> {
    let mut outcomes: Vec<Option<std::io::Result<()>>> =
        streams.iter().map(|(stream, _)| stream.set_nonblocking(true).err().map(Err)).collect();
    // Per stream: the piece being written and the bytes of it written.
    let mut at = vec![(0usize, 0usize); streams.len()];
    loop {
        let mut moved = false;
        for (i, (stream, pieces)) in streams.iter().enumerate() {
            while outcomes[i].is_none() {
                let (piece, offset) = &mut at[i];
                let Some(bytes) = pieces.get(*piece) else {
                    outcomes[i] = Some(Ok(()));
                    break;
                };
                if *offset == bytes.len() {
                    (*piece, *offset) = (*piece + 1, 0);
                    continue;
                }
                let mut writer: &TcpStream = stream;
                match writer.write(&bytes[*offset..]) {
                    Ok(0) => outcomes[i] = Some(Err(ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        *offset += n;
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => outcomes[i] = Some(Err(e)),
                }
            }
        }
        if outcomes.iter().all(Option::is_some) {
            break;
        }
        if Instant::now() >= deadline {
            for (i, outcome) in outcomes.iter_mut().enumerate() {
                outcome.get_or_insert_with(|| {
                    let total: usize = streams[i].1.iter().map(|piece| piece.len()).sum();
                    let (piece, offset) = at[i];
                    let written = streams[i].1[..piece].iter().map(|piece| piece.len()).sum::<usize>() + offset;
                    Err(std::io::Error::new(
                        ErrorKind::TimedOut,
                        format!(
                            "{} of {total} byte(s) unwritten at the deadline (the peer does not read)",
                            total - written
                        ),
                    ))
                });
            }
            break;
        }
        if !moved {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    for (stream, _) in streams {
        let _ = stream.set_nonblocking(false);
    }
    outcomes.into_iter().map(|outcome| outcome.expect("every outcome set")).collect()
}

#[cfg(test)]
mod tests;
