//! The rendezvous of the processes of a pipeline that spans processes or hosts: rank 0 listens
//! on an address (`PPNRT_RENDEZVOUS=host:port`), every other rank connects and says who it is,
//! and once the whole world has arrived rank 0 hands each rank the same payload (the NCCL unique
//! id of the pipeline's communicator).
//!
//! Every rank states its rank, the world size and a fingerprint of its configuration; rank 0
//! refuses a rank out of range, a duplicate rank, another world size or another configuration,
//! with a typed [`RendezvousError`] on rank 0 and on the rank concerned (the others learn that the
//! rendezvous failed), never a hang: every wait is bounded by the caller's timeout, and a rank
//! that nobody answers gets [`RendezvousError::Timeout`]. Ranks may start in any order: a
//! connecting rank retries, with backoff, until rank 0 listens or the time is up, also when rank 0
//! closed its connection unanswered (as it may in a flood). Rank 0 serves the handshakes of every
//! connection at once, each within a budget of its own (two seconds), reading no more than the
//! protocol allows (at most a knock before a connection proves the job's key): a connection that
//! is silent, trickles bytes, floods, speaks another protocol or does not prove the key is closed
//! without a word and costs the real ranks nothing; a flood past the connections rank 0 serves at
//! once evicts the oldest unproven ones, never a rank's, and rank 0 running out of file
//! descriptors waits a moment instead of failing. The member table goes to every rank at once
//! within rank 0's timeout: a rank that stops reading it is a [`RendezvousError::Timeout`]
//! naming it, on time.
//!
//! Every connection is admitted as [`crate::auth`] describes: rank 0 and the connecting rank each
//! prove the job's key (the [`JobAccess`] given) before either says anything else, and every
//! message then carries a proof bound to both ends' nonces. A process without the secret learns
//! only a nonce, cannot abort the rendezvous, and cannot pose as rank 0 (every rank finds it out
//! at once: [`RendezvousError::Unauthenticated`]). Without a secret, the address must be a
//! loopback one unless the job chose [`JobAccess::Unauthenticated`]
//! ([`RendezvousError::NoSecret`]).
//!
//! Threading and lifetime: every call blocks its thread for at most the timeout and keeps no
//! state afterwards (rank 0's listener closes when `serve` returns).
//!
//! Beyond the payload, [`Rendezvous::exchange`] gathers a contribution from every rank and hands
//! each rank the whole table, with the address rank 0 reached each rank at (the pipeline uses it
//! for the listening port of each rank's boundary connections).
//!
//! Every rank also says where it runs ([`RankIdentity`]: its host's boot id and name, its user,
//! its devices by UUID with their peer access; `identity.rs`), and every member of the table
//! carries its rank's, so each rank can tell which neighbours share its host and devices.
//!
//! The wire format is private to this crate (all ranks run the same version, magic `PPNRTRV5`):
//! after the handshake, a hello of rank, world size, fingerprint, contribution and identity; a
//! reply of a status byte and either the member table (per rank: address, contribution,
//! identity) or a reason; each with its proof.

use std::fmt;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

mod identity;

use identity::MAX_IDENTITY;
pub use identity::{DeviceIdentity, HostIdentity, MAX_DEVICES, RankIdentity};

use crate::auth::{
    Admission, Admitted, JobAccess, JobKey, KnockError, answer_digest, connect_and_knock, write_each_by,
};

/// Variable holding rank 0's rendezvous address, `host:port`.
pub const RENDEZVOUS_VAR: &str = "PPNRT_RENDEZVOUS";

/// Bytes of the payload rank 0 hands out (an NCCL unique id).
pub const PAYLOAD_BYTES: usize = 128;

/// The most bytes one rank may contribute to [`Rendezvous::exchange`].
pub const MAX_CONTRIBUTION: usize = 64 << 10;

const MAGIC: &[u8; 8] = b"PPNRTRV5";
const MAX_FINGERPRINT: usize = 4096;
/// The most ranks a rendezvous gathers (at least a pipeline's most stages, each of which may
/// have a rank of its own).
pub const MAX_WORLD: usize = 256;

/// A reply carries every rank's address and contribution.
const MAX_REPLY: usize = 64 << 20;
// The largest member table (every rank at every bound: an address as text, at most 45 bytes,
// its contribution and its identity, each length-prefixed) fits a reply.
const _: () = assert!(MAX_WORLD * (3 * 4 + 45 + MAX_CONTRIBUTION + MAX_IDENTITY) <= MAX_REPLY);
/// How long one connection to rank 0 has to deliver its whole hello (a rank sends it at once):
/// a connection that is silent, or trickles bytes, is dropped then, and the rendezvous goes on.
const HELLO_BUDGET: Duration = Duration::from_secs(2);
/// Connections whose hellos rank 0 reads at once; a newcomer past them evicts the oldest that
/// has not proved the job's key (see [`crate::auth`]).
const MAX_PENDING_HELLOS: usize = 4 * MAX_WORLD;
/// The longest hello: rank, world size, fingerprint, contribution and identity, each
/// length-prefixed.
const MAX_HELLO: usize = 20 + MAX_FINGERPRINT + MAX_CONTRIBUTION + MAX_IDENTITY;
const OK: u8 = 0;
const REFUSED: u8 = 1;

/// A failed rendezvous; names the address, the ranks and what disagreed.
///
/// ```
/// use ppnrt::{JobAccess, RendezvousError, rendezvous::Rendezvous};
/// use std::time::Duration;
///
/// let rendezvous = Rendezvous {
///     addr: "127.0.0.1:29500".into(),
///     rank: 2,
///     world: 2,
///     fingerprint: "2 stages".into(),
///     timeout: Duration::from_secs(1),
///     access: JobAccess::SameHost,
/// };
/// let err = rendezvous.join().unwrap_err(); // refused before any connection
/// assert_eq!(err, RendezvousError::RankOutOfRange { rank: 2, world: 2 });
/// assert_eq!(err.to_string(), "rank 2 is not in 0..2");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The address could not be resolved or bound.
    #[error("rendezvous address {addr:?}: {reason}")]
    Address {
        /// The address given.
        addr: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The time ran out: rank 0 still missed some ranks, or a rank found no rank 0 (or no reply).
    #[error("rendezvous at {addr} timed out after {waited:?}: {waiting_for}")]
    Timeout {
        /// The address.
        addr: String,
        /// How long the call waited.
        waited: Duration,
        /// What never came.
        waiting_for: String,
    },
    /// More ranks than a rendezvous gathers ([`MAX_WORLD`]).
    #[error("a world of {world} ranks is more than a rendezvous gathers ({max})")]
    WorldOutOfRange {
        /// The world size given.
        world: usize,
        /// [`MAX_WORLD`].
        max: usize,
    },
    /// A rank outside `0..world` (or a world of fewer than two ranks).
    #[error("rank {rank} is not in 0..{world}")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// Two processes claimed the same rank.
    #[error("rank {rank} joined twice")]
    DuplicateRank {
        /// The rank.
        rank: usize,
    },
    /// A rank states another world size than rank 0.
    #[error("rank {rank} states a world of {found} rank(s), rank 0 one of {expected}")]
    WorldSizeMismatch {
        /// The rank.
        rank: usize,
        /// Rank 0's world size.
        expected: usize,
        /// The rank's.
        found: usize,
    },
    /// A rank runs another configuration than rank 0.
    #[error("rank {rank} runs another configuration: {found:?}, rank 0 runs {expected:?}")]
    ConfigMismatch {
        /// The rank.
        rank: usize,
        /// Rank 0's fingerprint.
        expected: String,
        /// The rank's.
        found: String,
    },
    /// Rank 0 refused this rank, or the rendezvous failed elsewhere; rank 0's reason.
    #[error("rank 0 refused the rendezvous: {reason}")]
    Refused {
        /// Rank 0's reason.
        reason: String,
    },
    /// The other end of the connection does not prove the job secret: a process that is not a
    /// rank of this job holds rank 0's address, or the ranks were given different secrets.
    #[error("rendezvous at {addr}: {what}")]
    Unauthenticated {
        /// The address.
        addr: String,
        /// What failed.
        what: String,
    },
    /// No job secret, and an address other ranks reach from other hosts.
    #[error(
        "rendezvous at {addr}: ranks on other hosts meet only with a job secret: set the same \
         PPNRT_JOB_SECRET (for example `export PPNRT_JOB_SECRET=$(openssl rand -hex 32)`) or \
         PPNRT_JOB_SECRET_FILE on every rank, or PPNRT_ALLOW_UNAUTHENTICATED=1 on a network nobody \
         else reaches (see SECURITY.md); without either, use a loopback address"
    )]
    NoSecret {
        /// The address.
        addr: String,
    },
    /// A peer sent something that is not this crate's rendezvous.
    #[error("rendezvous at {addr}: {what}")]
    Protocol {
        /// The address.
        addr: String,
        /// What was wrong.
        what: String,
    },
}

/// One rank as [`Rendezvous::exchange`] returns it.
///
/// ```no_run
/// # use ppnrt::{JobAccess, rendezvous::Rendezvous};
/// # use std::time::Duration;
/// # let rendezvous = Rendezvous { addr: "127.0.0.1:29500".into(), rank: 1, world: 2, fingerprint: "2 stages".into(), timeout: Duration::from_secs(10), access: JobAccess::SameHost };
/// for (rank, member) in rendezvous.exchange(b"my part")?.iter().enumerate() {
///     println!("rank {rank} at {}: {} bytes", member.addr, member.bytes.len());
/// }
/// # Ok::<(), ppnrt::RendezvousError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The address rank 0 reached the rank at (for rank 0: the address the others reached it at).
    pub addr: IpAddr,
    /// The rank's contribution.
    pub bytes: Vec<u8>,
    /// Where the rank runs: its host, its user, the devices it reported (see
    /// [`Rendezvous::exchange_as`]).
    pub identity: RankIdentity,
}

/// One rank's part in a rendezvous.
///
/// ```no_run
/// use ppnrt::{JobAccess, rendezvous::Rendezvous};
/// use std::time::Duration;
///
/// // Run in every process, each with its own rank; rank 0 listens at `addr`.
/// let rank: usize = std::env::var("RANK").map_or(0, |r| r.parse().unwrap());
/// let rendezvous = Rendezvous {
///     addr: "127.0.0.1:29500".into(),
///     rank,
///     world: 2,
///     fingerprint: "2 stages on 2 ranks".into(), // must be the same in every rank
///     timeout: Duration::from_secs(30),
///     access: JobAccess::SameHost,
/// };
/// let members = rendezvous.exchange(format!("rank {rank}").as_bytes())?;
/// assert_eq!(members.len(), 2);
/// # Ok::<(), ppnrt::RendezvousError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// Rank 0's address, `host:port`.
    pub addr: String,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// A description of the configuration every rank must share (compared as text).
    pub fingerprint: String,
    /// The bound on every wait.
    pub timeout: Duration,
    /// How the ranks recognise each other: the job secret they prove, or no secret (then only
    /// on loopback addresses unless [`JobAccess::Unauthenticated`]).
    pub access: JobAccess,
}

impl Rendezvous {
    /// Rank 0: listens, waits for every other rank, checks each, and hands out `payload`.
    /// Returns `payload` when the whole world arrived and agreed.
    ///
    /// # Errors
    /// [`RendezvousError`]: the address, a refused rank (which is told why, as are the ranks
    /// already connected), or the time running out before every rank arrived.
    pub fn serve(&self, payload: &[u8; PAYLOAD_BYTES]) -> Result<[u8; PAYLOAD_BYTES], RendezvousError> {
        if self.rank != 0 {
            self.check_rank()?;
            return Err(RendezvousError::RankOutOfRange { rank: self.rank, world: 1 });
        }
        self.exchange(payload)?;
        Ok(*payload)
    }

    /// Any rank but 0: connects to rank 0 (retrying until it listens), says who it is, and
    /// returns the payload rank 0 hands out.
    ///
    /// # Errors
    /// [`RendezvousError`]: the address, rank 0's refusal, or the time running out.
    pub fn join(&self) -> Result<[u8; PAYLOAD_BYTES], RendezvousError> {
        if self.rank == 0 {
            self.check_rank()?;
            return Err(RendezvousError::RankOutOfRange { rank: 0, world: self.world });
        }
        let members = self.exchange(&[])?;
        members[0].bytes.as_slice().try_into().map_err(|_| RendezvousError::Protocol {
            addr: self.addr.clone(),
            what: format!("rank 0 handed out {} bytes, not {PAYLOAD_BYTES}", members[0].bytes.len()),
        })
    }

    /// Every rank: contributes `contribution` (at most [`MAX_CONTRIBUTION`] bytes) and returns
    /// every rank's, in rank order, each with the address rank 0 reached that rank at (rank 0's
    /// own: the address the other ranks reached it at). Rank 0 listens; the others connect.
    ///
    /// # Errors
    /// [`RendezvousError`]: the address, a refused rank, or the time running out.
    pub fn exchange(&self, contribution: &[u8]) -> Result<Vec<Member>, RendezvousError> {
        self.exchange_as(&RankIdentity::of_this_process(Vec::new()), contribution)
    }

    /// [`exchange`](Self::exchange), this rank reporting `identity` (its host, its user, its
    /// devices: [`RankIdentity::of_this_process`]); every member returned carries its rank's.
    ///
    /// # Errors
    /// As [`exchange`](Self::exchange); [`RendezvousError::Protocol`] for an identity past the
    /// bounds (a name over 256 bytes, more than [`MAX_DEVICES`] devices).
    pub fn exchange_as(&self, identity: &RankIdentity, contribution: &[u8]) -> Result<Vec<Member>, RendezvousError> {
        self.check_rank()?;
        let identity_bytes = identity.encode().ok_or_else(|| RendezvousError::Protocol {
            addr: self.addr.clone(),
            what: format!("this rank's identity is past the bounds ({identity})"),
        })?;
        if contribution.len() > MAX_CONTRIBUTION {
            return Err(RendezvousError::Protocol {
                addr: self.addr.clone(),
                what: format!("a contribution of {} bytes (at most {MAX_CONTRIBUTION})", contribution.len()),
            });
        }
        if self.rank == 0 {
            self.gather(identity, contribution)
        } else {
            self.contribute(&identity_bytes, contribution)
        }
    }

    fn gather(&self, identity: &RankIdentity, contribution: &[u8]) -> Result<Vec<Member>, RendezvousError> {
        let listener = TcpListener::bind(self.resolve()?)
            .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?;
        let key = self.access.key();
        let mut admission = Admission::new(&listener, key.clone(), MAGIC, HELLO_BUDGET, MAX_PENDING_HELLOS, MAX_HELLO)
            .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?;
        let start = Instant::now();
        // The whole exchange, the member table's delivery included, ends by then.
        let deadline = start + self.timeout;
        let mut joined: Vec<Option<(Admitted, Member)>> = (0..self.world).map(|_| None).collect();
        let missing = |joined: &[Option<(Admitted, Member)>]| -> Vec<usize> {
            (1..joined.len()).filter(|r| joined[*r].is_none()).collect()
        };
        while !missing(&joined).is_empty() {
            let waited = start.elapsed();
            if waited >= self.timeout {
                let error = RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    waited,
                    waiting_for: format!("rank(s) {:?} never joined{}", missing(&joined), admission.refusals()),
                };
                refuse_all(&mut joined, &key, &error);
                return Err(error);
            }
            // Every connection's handshake and hello is served at once, each within its own
            // budget and reading no more than the protocol allows: a silent, trickling, flooding
            // or unproven connection costs the others nothing and is closed without a word.
            let admitted = admission
                .poll(&hello_length)
                .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?;
            let Some(admitted) = admitted else {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            let (rank, world, fingerprint, bytes, identity) = parse_hello(&admitted.message);
            let refusal = if world != self.world {
                Some(RendezvousError::WorldSizeMismatch { rank, expected: self.world, found: world })
            } else if rank == 0 || rank >= self.world {
                Some(RendezvousError::RankOutOfRange { rank, world: self.world })
            } else if joined[rank].is_some() {
                Some(RendezvousError::DuplicateRank { rank })
            } else if fingerprint != self.fingerprint {
                Some(RendezvousError::ConfigMismatch { rank, expected: self.fingerprint.clone(), found: fingerprint })
            } else if identity.is_none() {
                Some(RendezvousError::Protocol {
                    addr: self.addr.clone(),
                    what: format!("rank {rank}'s identity is malformed"),
                })
            } else {
                None
            };
            if let Some(error) = refusal {
                let _ = send_replies([&admitted], &key, &reply(REFUSED, told(&error).as_bytes()), deadline);
                refuse_all(&mut joined, &key, &error);
                return Err(error);
            }
            let identity = identity.expect("checked above");
            let member = Member { addr: admitted.peer.ip(), bytes, identity };
            joined[rank] = Some((admitted, member));
        }
        // Rank 0 is reached at the address the others connected to.
        let own = joined
            .iter()
            .flatten()
            .find_map(|(admitted, _)| admitted.stream.local_addr().ok())
            .map_or(self.resolve()?.ip(), |local| local.ip());
        let mut members = vec![Member { addr: own, bytes: contribution.to_vec(), identity: identity.clone() }];
        members.extend(joined.iter().skip(1).flatten().map(|(_, member)| member.clone()));
        let table = encode_members(&members);
        // To every rank at once, by the deadline: a rank that stops reading holds no other rank
        // and not rank 0 past its timeout (a rank that vanished learns nothing; it fails on its
        // own side).
        let outcomes =
            send_replies(joined.iter().flatten().map(|(admitted, _)| admitted), &key, &reply(OK, &table), deadline);
        let unread: Vec<usize> = outcomes
            .iter()
            .zip(1..)
            .filter_map(|(outcome, rank)| {
                outcome.as_ref().err().filter(|e| e.kind() == ErrorKind::TimedOut).map(|_| rank)
            })
            .collect();
        if !unread.is_empty() {
            return Err(RendezvousError::Timeout {
                addr: self.addr.clone(),
                waited: start.elapsed(),
                waiting_for: format!(
                    "rank(s) {unread:?} did not take the member table of {} bytes (they stopped reading)",
                    table.len()
                ),
            });
        }
        Ok(members)
    }

    fn contribute(&self, identity: &[u8], contribution: &[u8]) -> Result<Vec<Member>, RendezvousError> {
        let addr = self.resolve()?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        let key = self.access.key();
        let failed = |e: KnockError, waiting_for: &str| match e {
            e if e.timed_out() => RendezvousError::Timeout {
                addr: self.addr.clone(),
                waited: start.elapsed(),
                waiting_for: waiting_for.to_string(),
            },
            e @ (KnockError::NotOurs | KnockError::Unproven(_) | KnockError::Closed { after_knock: true }) => {
                RendezvousError::Unauthenticated { addr: self.addr.clone(), what: e.to_string() }
            }
            KnockError::Closed { after_knock: false } => {
                RendezvousError::Refused { reason: "rank 0 closed the connection without an answer".into() }
            }
            e => RendezvousError::Protocol { addr: self.addr.clone(), what: e.to_string() },
        };
        // Nothing about this rank goes out before rank 0 proved the job's key. Retries while rank
        // 0 does not listen yet, or closed the connection unanswered (a flood evicted it).
        let (mut stream, handshake) = connect_and_knock(addr, &key, MAGIC, deadline)
            .map_err(|e| failed(e, "rank 0 (never listening, or no handshake with it)"))?;
        let fingerprint = self.fingerprint.as_bytes();
        let mut hello = Vec::with_capacity(20 + fingerprint.len() + contribution.len() + identity.len());
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.world as u32).to_le_bytes());
        hello.extend_from_slice(&(fingerprint.len() as u32).to_le_bytes());
        hello.extend_from_slice(fingerprint);
        hello.extend_from_slice(&(contribution.len() as u32).to_le_bytes());
        hello.extend_from_slice(contribution);
        hello.extend_from_slice(&(identity.len() as u32).to_le_bytes());
        hello.extend_from_slice(identity);
        handshake
            .send_message(&mut stream, &key, &hello, deadline)
            .map_err(|e| failed(KnockError::Io(e), "rank 0 to read this rank's hello"))?;
        let reply = handshake
            .read_answer(&mut stream, &key, deadline, reply_length)
            .map_err(|e| failed(e, "rank 0's answer (other ranks missing?)"))?;
        let body = &reply[5..];
        match reply[0] {
            OK => decode_members(body, self.world).ok_or_else(|| RendezvousError::Protocol {
                addr: self.addr.clone(),
                what: format!("a malformed member table of {} bytes", body.len()),
            }),
            REFUSED => Err(RendezvousError::Refused { reason: String::from_utf8_lossy(body).into_owned() }),
            other => Err(RendezvousError::Protocol {
                addr: self.addr.clone(),
                what: format!("reply status {other} with {} bytes", body.len()),
            }),
        }
    }

    /// Checks that this rendezvous may run with its access: without a secret, only on loopback
    /// addresses unless the job opted out ([`JobAccess::Unauthenticated`]).
    fn check_access(&self, addr: SocketAddr) -> Result<(), RendezvousError> {
        if matches!(self.access, JobAccess::SameHost) && !addr.ip().is_loopback() {
            return Err(RendezvousError::NoSecret { addr: self.addr.clone() });
        }
        Ok(())
    }

    /// The address of this host's interface on the way to rank 0, where the other ranks reach
    /// this one: for rank 0 its rendezvous address, for the others the source address of the
    /// route to it (found without sending anything).
    ///
    /// # Errors
    /// [`RendezvousError::Address`] for an address that does not resolve or has no route;
    /// [`RendezvousError::NoSecret`] as [`exchange`](Self::exchange).
    pub fn local_interface(&self) -> Result<IpAddr, RendezvousError> {
        let addr = self.resolve()?;
        if self.rank == 0 || addr.ip().is_unspecified() {
            return Ok(addr.ip());
        }
        let unroutable =
            |e: std::io::Error| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() };
        let any: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("an address");
        let probe = std::net::UdpSocket::bind(any).map_err(unroutable)?;
        probe.connect(addr).map_err(unroutable)?;
        Ok(probe.local_addr().map_err(unroutable)?.ip())
    }

    fn check_rank(&self) -> Result<(), RendezvousError> {
        if self.world > MAX_WORLD {
            return Err(RendezvousError::WorldOutOfRange { world: self.world, max: MAX_WORLD });
        }
        if self.world < 2 || self.rank >= self.world {
            return Err(RendezvousError::RankOutOfRange { rank: self.rank, world: self.world });
        }
        Ok(())
    }

    fn resolve(&self) -> Result<SocketAddr, RendezvousError> {
        let addr = self.resolve_any()?;
        self.check_access(addr)?;
        Ok(addr)
    }

    fn resolve_any(&self) -> Result<SocketAddr, RendezvousError> {
        self.addr
            .to_socket_addrs()
            .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?
            .next()
            .ok_or_else(|| RendezvousError::Address {
                addr: self.addr.clone(),
                reason: "resolves to no address".into(),
            })
    }
}

/// A hello: rank, world size, configuration fingerprint, contribution, identity (`None`: malformed).
type Hello = (usize, usize, String, Vec<u8>, Option<RankIdentity>);

/// The length of the hello whose first bytes are `read`, once it is known; an error for bytes
/// that are no hello (sizes past the bounds).
fn hello_length(read: &[u8]) -> Result<Option<usize>, String> {
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(read.get(at..at + 4)?.try_into().expect("four bytes")) as usize)
    };
    let Some(fingerprint_len) = word(8) else { return Ok(None) };
    if fingerprint_len > MAX_FINGERPRINT {
        return Err(format!("a fingerprint of {fingerprint_len} bytes"));
    }
    let Some(len) = word(12 + fingerprint_len) else { return Ok(None) };
    if len > MAX_CONTRIBUTION {
        return Err(format!("a contribution of {len} bytes"));
    }
    let Some(identity_len) = word(16 + fingerprint_len + len) else { return Ok(None) };
    if identity_len > MAX_IDENTITY {
        return Err(format!("an identity of {identity_len} bytes"));
    }
    Ok(Some(20 + fingerprint_len + len + identity_len))
}

/// The hello in `message` (whole, as [`hello_length`] measured it).
fn parse_hello(message: &[u8]) -> Hello {
    let word = |at: usize| u32::from_le_bytes(message[at..at + 4].try_into().expect("four bytes")) as usize;
    let fingerprint_len = word(8);
    let fingerprint = String::from_utf8_lossy(&message[12..12 + fingerprint_len]).into_owned();
    let len = word(12 + fingerprint_len);
    let contribution = message[16 + fingerprint_len..16 + fingerprint_len + len].to_vec();
    let identity = RankIdentity::decode(&message[20 + fingerprint_len + len..]);
    (word(0), word(4), fingerprint, contribution, identity)
}

/// The length of rank 0's reply (status, length, body) whose first bytes are `read`.
fn reply_length(read: &[u8]) -> Result<Option<usize>, String> {
    let Some(len) = read.get(1..5) else { return Ok(None) };
    let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize;
    if len > MAX_REPLY {
        return Err(format!("a reply of {len} bytes"));
    }
    Ok(Some(5 + len))
}

/// The member table: per rank, its address as text, its contribution and its identity, each
/// length-prefixed.
fn encode_members(members: &[Member]) -> Vec<u8> {
    let mut out = Vec::new();
    for member in members {
        // Each identity was decoded from its rank's hello (or is rank 0's own, checked before it
        // listened): within the bounds.
        let identity = member.identity.encode().unwrap_or_default();
        for field in [member.addr.to_string().as_bytes(), member.bytes.as_slice(), identity.as_slice()] {
            out.extend_from_slice(&(field.len() as u32).to_le_bytes());
            out.extend_from_slice(field);
        }
    }
    out
}

fn decode_members(mut body: &[u8], world: usize) -> Option<Vec<Member>> {
    let mut field = || -> Option<Vec<u8>> {
        let len = u32::from_le_bytes(body.get(..4)?.try_into().ok()?) as usize;
        let value = body.get(4..4 + len)?.to_vec();
        body = &body[4 + len..];
        Some(value)
    };
    let members = (0..world)
        .map(|_| {
            let addr = String::from_utf8(field()?).ok()?.parse().ok()?;
            let bytes = field()?;
            Some(Member { addr, bytes, identity: RankIdentity::decode(&field()?)? })
        })
        .collect::<Option<Vec<_>>>()?;
    body.is_empty().then_some(members)
}

/// Rank 0's reply (status, length, body), the same for every rank it goes to.
fn reply(status: u8, body: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(5 + body.len());
    message.push(status);
    message.extend_from_slice(&(body.len() as u32).to_le_bytes());
    message.extend_from_slice(body);
    message
}

/// Sends `message`, each with its own proof, to every rank in `to` at once, by `deadline` (see
/// [`write_each_by`]); the outcomes in order.
fn send_replies<'a>(
    to: impl IntoIterator<Item = &'a Admitted>,
    key: &JobKey,
    message: &[u8],
    deadline: Instant,
) -> Vec<std::io::Result<()>> {
    let digest = answer_digest(message);
    let proofs: Vec<_> =
        to.into_iter().map(|admitted| (&admitted.stream, admitted.handshake.answer_proof(key, &digest))).collect();
    let pieces: Vec<[&[u8]; 2]> = proofs.iter().map(|(_, proof)| [message, &proof[..]]).collect();
    let streams: Vec<_> = proofs.iter().zip(&pieces).map(|((stream, _), pieces)| (*stream, &pieces[..])).collect();
    write_each_by(&streams, deadline)
}

/// Tells every rank already connected that the rendezvous failed, and why: a short message each,
/// written in one attempt that does not wait (a rank that does not read it learns it from its
/// own timeout).
fn refuse_all(joined: &mut [Option<(Admitted, Member)>], key: &JobKey, error: &RendezvousError) {
    let reason = format!("the rendezvous failed: {}", told(error));
    let _ = send_replies(
        joined.iter().flatten().map(|(admitted, _)| admitted),
        key,
        &reply(REFUSED, reason.as_bytes()),
        Instant::now(),
    );
}

/// What rank 0 tells the connections it refuses about `error`: never its own configuration (a
/// connection may be anyone's), only what the connection sent.
fn told(error: &RendezvousError) -> String {
    match error {
        RendezvousError::ConfigMismatch { rank, found, .. } => {
            format!("rank {rank} runs another configuration than rank 0: {found:?}")
        }
        other => other.to_string(),
    }
}

impl fmt::Display for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} of {} at {}", self.rank, self.world, self.addr)
    }
}

#[cfg(test)]
mod tests;
