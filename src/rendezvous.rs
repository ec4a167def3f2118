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
//! connecting rank retries until rank 0 listens or the time is up.
//!
//! Threading and lifetime: every call blocks its thread for at most the timeout and keeps no
//! state afterwards (rank 0's listener closes when `serve` returns).
//!
//! The wire format is private to this crate (all ranks run the same version): a hello of magic,
//! rank, world size and fingerprint; a reply of a status byte and either the payload or a reason.

use std::fmt;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Environment variable with rank 0's rendezvous address, `host:port`.
pub const RENDEZVOUS_VAR: &str = "PPNRT_RENDEZVOUS";

/// Bytes of the payload rank 0 hands out (an NCCL unique id).
pub const PAYLOAD_BYTES: usize = 128;

const MAGIC: &[u8; 8] = b"PPNRTRV1";
const MAX_FINGERPRINT: usize = 4096;
const OK: u8 = 0;
const REFUSED: u8 = 1;

/// A failed rendezvous; names the address, the ranks and what disagreed.
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
    /// A peer sent something that is not this crate's rendezvous.
    #[error("rendezvous at {addr}: {what}")]
    Protocol {
        /// The address.
        addr: String,
        /// What was wrong.
        what: String,
    },
}

/// One rank's part in a rendezvous.
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
}

impl Rendezvous {
    /// Rank 0: listens, waits for every other rank, checks each, and hands out `payload`.
    /// Returns `payload` when the whole world arrived and agreed.
    ///
    /// # Errors
    /// [`RendezvousError`]: the address, a refused rank (which is told why, as are the ranks
    /// already connected), or the time running out before every rank arrived.
    pub fn serve(&self, payload: &[u8; PAYLOAD_BYTES]) -> Result<[u8; PAYLOAD_BYTES], RendezvousError> {
        self.check_rank()?;
        if self.rank != 0 {
            return Err(RendezvousError::RankOutOfRange { rank: self.rank, world: 1 });
        }
        let listener = TcpListener::bind(self.resolve()?)
            .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() })?;
        let start = Instant::now();
        let mut joined: Vec<Option<TcpStream>> = (0..self.world).map(|_| None).collect();
        let missing = |joined: &[Option<TcpStream>]| -> Vec<usize> {
            (1..joined.len()).filter(|r| joined[*r].is_none()).collect()
        };
        while !missing(&joined).is_empty() {
            let waited = start.elapsed();
            if waited >= self.timeout {
                let error = RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    waited,
                    waiting_for: format!("rank(s) {:?} never joined", missing(&joined)),
                };
                refuse_all(&mut joined, &error);
                return Err(error);
            }
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(RendezvousError::Address { addr: self.addr.clone(), reason: e.to_string() }),
            };
            let mut stream = stream;
            let remaining = self.timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
            let hello = stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_read_timeout(Some(remaining)))
                .map_err(|e| e.to_string())
                .and_then(|()| read_hello(&mut stream));
            let (rank, world, fingerprint) = match hello {
                Ok(hello) => hello,
                // Not one of ours (or too slow to speak): ignore it and keep waiting.
                Err(_) => continue,
            };
            let refusal = if world != self.world {
                Some(RendezvousError::WorldSizeMismatch { rank, expected: self.world, found: world })
            } else if rank == 0 || rank >= self.world {
                Some(RendezvousError::RankOutOfRange { rank, world: self.world })
            } else if joined[rank].is_some() {
                Some(RendezvousError::DuplicateRank { rank })
            } else if fingerprint != self.fingerprint {
                Some(RendezvousError::ConfigMismatch { rank, expected: self.fingerprint.clone(), found: fingerprint })
            } else {
                None
            };
            if let Some(error) = refusal {
                let _ = reply(&mut stream, REFUSED, error.to_string().as_bytes());
                refuse_all(&mut joined, &error);
                return Err(error);
            }
            joined[rank] = Some(stream);
        }
        for stream in joined.iter_mut().flatten() {
            // A rank that vanished now learns nothing; it fails on its own side.
            let _ = reply(stream, OK, payload);
        }
        Ok(*payload)
    }

    /// Any rank but 0: connects to rank 0 (retrying until it listens), says who it is, and
    /// returns the payload rank 0 hands out.
    ///
    /// # Errors
    /// [`RendezvousError`]: the address, rank 0's refusal, or the time running out.
    pub fn join(&self) -> Result<[u8; PAYLOAD_BYTES], RendezvousError> {
        self.check_rank()?;
        if self.rank == 0 {
            return Err(RendezvousError::RankOutOfRange { rank: 0, world: self.world });
        }
        let addr = self.resolve()?;
        let start = Instant::now();
        let mut stream = loop {
            let remaining = self.timeout.saturating_sub(start.elapsed());
            if remaining.is_zero() {
                return Err(RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    waited: start.elapsed(),
                    waiting_for: "rank 0 never listened".into(),
                });
            }
            match TcpStream::connect_timeout(&addr, remaining.min(Duration::from_millis(500))) {
                Ok(stream) => break stream,
                Err(_) => std::thread::sleep(Duration::from_millis(20).min(remaining)),
            }
        };
        let io = |e: std::io::Error| RendezvousError::Protocol { addr: self.addr.clone(), what: e.to_string() };
        let remaining = self.timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
        stream.set_read_timeout(Some(remaining)).map_err(io)?;
        let fingerprint = self.fingerprint.as_bytes();
        let mut hello = Vec::with_capacity(20 + fingerprint.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.world as u32).to_le_bytes());
        hello.extend_from_slice(&(fingerprint.len() as u32).to_le_bytes());
        hello.extend_from_slice(fingerprint);
        stream.write_all(&hello).map_err(io)?;
        let mut status = [0u8; 1];
        if let Err(e) = stream.read_exact(&mut status) {
            return Err(match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    waited: start.elapsed(),
                    waiting_for: "rank 0's answer (other ranks missing?)".into(),
                },
                _ => RendezvousError::Refused { reason: format!("rank 0 closed the connection: {e}") },
            });
        }
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(io)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FINGERPRINT {
            return Err(RendezvousError::Protocol { addr: self.addr.clone(), what: format!("a reply of {len} bytes") });
        }
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).map_err(io)?;
        match status[0] {
            OK if body.len() == PAYLOAD_BYTES => {
                let mut payload = [0u8; PAYLOAD_BYTES];
                payload.copy_from_slice(&body);
                Ok(payload)
            }
            REFUSED => Err(RendezvousError::Refused { reason: String::from_utf8_lossy(&body).into_owned() }),
            other => Err(RendezvousError::Protocol {
                addr: self.addr.clone(),
                what: format!("reply status {other} with {} bytes", body.len()),
            }),
        }
    }

    fn check_rank(&self) -> Result<(), RendezvousError> {
        if self.world < 2 || self.rank >= self.world {
            return Err(RendezvousError::RankOutOfRange { rank: self.rank, world: self.world });
        }
        Ok(())
    }

    fn resolve(&self) -> Result<SocketAddr, RendezvousError> {
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

fn read_hello(stream: &mut TcpStream) -> Result<(usize, usize, String), String> {
    let mut head = [0u8; 20];
    stream.read_exact(&mut head).map_err(|e| e.to_string())?;
    if &head[..8] != MAGIC {
        return Err("not a ppnrt rendezvous".into());
    }
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("four bytes")) as usize;
    let (rank, world, len) = (word(8), word(12), word(16));
    if len > MAX_FINGERPRINT {
        return Err(format!("a fingerprint of {len} bytes"));
    }
    let mut fingerprint = vec![0u8; len];
    stream.read_exact(&mut fingerprint).map_err(|e| e.to_string())?;
    Ok((rank, world, String::from_utf8_lossy(&fingerprint).into_owned()))
}

fn reply(stream: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut message = Vec::with_capacity(5 + body.len());
    message.push(status);
    message.extend_from_slice(&(body.len() as u32).to_le_bytes());
    message.extend_from_slice(body);
    stream.write_all(&message)
}

/// Tells every rank already connected that the rendezvous failed, and why.
fn refuse_all(joined: &mut [Option<TcpStream>], error: &RendezvousError) {
    let reason = format!("the rendezvous failed: {error}");
    for stream in joined.iter_mut().flatten() {
        let _ = reply(stream, REFUSED, reason.as_bytes());
    }
}

impl fmt::Display for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} of {} at {}", self.rank, self.world, self.addr)
    }
}
