//! The channel between two ranks of one job on one host: a Unix stream socket over which the
//! ranks prove the job's key to each other, check each other's user, and pass file descriptors
//! (exported device memory, the shared [`ControlBlock`]), each named by a sealed record.
//!
//! The order on every connection, on both ends:
//! 1. the job's mutual handshake (`crate::auth`: the same proofs as a TCP connection between
//!    ranks, from the same code), under the same admission (a bounded number of unproven
//!    connections, each within its own budget, the oldest evicted first, per user);
//! 2. the peer's credentials from the kernel (`SO_PEERCRED`): the same user id as this process,
//!    else the connection is closed (the listening end waits on for the real rank), the peer's
//!    process id recorded ([`LocalChannel::peer`]);
//! 3. only then descriptors, with `SCM_RIGHTS`: each frame a record sealed with keys derived from
//!    the handshake (`kind`, byte size and index per descriptor; [`FdEntry`]); the receiver
//!    owns every descriptor the kernel hands it at once, checks the record against the kinds it
//!    expects, in order, and on any difference (count, kind, a seal that does not open) closes
//!    every one of them and returns a typed error ([`LocalChannelError::Record`]).
//!
//! Where the socket lives: a path in a fresh directory of its own (`ppnrt-<random>`, mode 0700,
//! in `$XDG_RUNTIME_DIR` when set, else the temporary directory), not Linux's abstract
//! namespace. An abstract socket has no permissions: any process of any user in the network
//! namespace can connect to it (and see its name in `/proc/net/unix`). A socket in a 0700
//! directory can be reached only by its own user (and root): the kernel refuses everyone else
//! before `accept`, and the handshake and `SO_PEERCRED` are the next lines. The directory is
//! made with a random name (a squatter's directory of the same name makes the creation fail,
//! never shared), and removed with the listener. Two ranks in containers that do not share the
//! directory cannot meet here (the connecting rank's wait ends in
//! [`LocalChannelError::Timeout`]).
//!
//! Every wait is bounded by the caller's timeout (one too long for an `Instant`, such as
//! `Duration::MAX`, is as good as none, never a panic): a peer that is slow, stops or dies gives
//! [`LocalChannelError::Timeout`] or [`LocalChannelError::PeerClosed`], never a hang. Threading:
//! a channel is used by one thread at a time (`&mut self`); the control block is shared freely.

use std::fmt;
use std::io::ErrorKind;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::auth::{Admission, JobAccess, JobKey, Listen, Opener, Sealer, UnixWire, connect_and_knock_with, write_by};

mod control_block;
mod frame;
#[cfg(test)]
mod tests;

pub use control_block::{ControlBlock, Side};
pub use frame::{FdEntry, FdKind, MAX_FDS, ReceivedFd};

/// The handshake's magic on a local channel (another protocol than the TCP connections').
const MAGIC: &[u8; 8] = b"PPNRTLC1";
/// How long one connection has for its handshake and message.
const HANDSHAKE_BUDGET: Duration = Duration::from_secs(2);
/// Unproven connections the listener serves at once.
const MAX_PENDING: usize = 16;
/// The connecting rank's message: the purpose it connects for.
const PURPOSE: usize = 8;
const ACCEPTED: u8 = 1;
const NOT_ACCEPTED: u8 = 0;

/// Why a local channel failed; names the step and what was wrong.
///
/// ```
/// use std::time::Duration;
/// use ppnrt::JobAccess;
/// use ppnrt::local_channel::{LocalChannel, LocalChannelError};
///
/// // Nothing listens at this path: the connection gives up within its bound, typed.
/// let nowhere = std::env::temp_dir().join("ppnrt-nobody-listens-here/socket");
/// match LocalChannel::connect(&nowhere, &JobAccess::SameHost, 7, Duration::from_millis(50)) {
///     Err(LocalChannelError::Timeout { .. }) => {}
///     other => panic!("expected a timeout, got {other:?}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LocalChannelError {
    /// A system call failed.
    #[error("local channel: {what}: {reason}")]
    Io {
        /// The step.
        what: String,
        /// The system's error.
        reason: String,
    },
    /// The peer did not answer, read or connect in time (it is slow, stopped or gone).
    #[error("local channel: no {what} within the timeout")]
    Timeout {
        /// What never came.
        what: String,
    },
    /// The peer closed its end.
    #[error("local channel: the peer closed the connection while {what}")]
    PeerClosed {
        /// The step.
        what: String,
    },
    /// The peer does not prove the job's key, or refused this rank.
    #[error("local channel: {what}")]
    Unauthenticated {
        /// What failed.
        what: String,
    },
    /// The peer's process runs as another user (`SO_PEERCRED`).
    #[error("local channel: the peer (pid {pid}) runs as uid {found}, this rank as uid {expected}")]
    WrongUser {
        /// This process's user id.
        expected: u32,
        /// The peer's.
        found: u32,
        /// The peer's process id.
        pid: i32,
    },
    /// A record that is not what the receiver expects; every descriptor that came with it was
    /// closed.
    #[error("local channel: a refused record: {what}")]
    Record {
        /// What was wrong.
        what: String,
    },
    /// A control block that cannot be used.
    #[error("local channel: a refused control block: {what}")]
    Block {
        /// What was wrong.
        what: String,
    },
    /// An earlier call failed with a frame half read or written (or a seal's position spent):
    /// the channel takes no further frame; drop it (the other rank sees it closed).
    #[error("local channel: unusable since an earlier failure ({earlier}); drop it")]
    Broken {
        /// The earlier failure.
        earlier: String,
    },
}

impl LocalChannelError {
    fn io(what: &str, e: std::io::Error) -> LocalChannelError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => LocalChannelError::Timeout { what: what.into() },
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof => {
                LocalChannelError::PeerClosed { what: what.into() }
            }
            _ => LocalChannelError::Io { what: what.into(), reason: e.to_string() },
        }
    }
}

/// A peer's process as the kernel tells it (`SO_PEERCRED`): its credentials when it connected.
///
/// ```
/// use std::os::unix::net::UnixStream;
/// use ppnrt::local_channel::{check_peer, own_uid, peer_credentials};
///
/// let (ours, _theirs) = UnixStream::pair()?;
/// let peer = peer_credentials(&ours)?;
/// assert_eq!(peer.uid, own_uid());
/// assert!(check_peer(peer, own_uid()).is_ok());
/// assert!(check_peer(peer, own_uid().wrapping_add(1)).is_err());
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCredentials {
    /// Its process id in this process's pid namespace (0 when it is not visible there, as for a
    /// peer in another container's pid namespace).
    pub pid: i32,
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
}

impl fmt::Display for PeerCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} (uid {})", self.pid, self.uid)
    }
}

/// The peer's credentials of a connected Unix socket (`SO_PEERCRED`).
///
/// # Errors
/// The system's error.
#[doc(alias = "SO_PEERCRED")]
pub fn peer_credentials(stream: &UnixStream) -> std::io::Result<PeerCredentials> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `getsockopt(SO_PEERCRED)` writes at most `len` bytes (the size of `ucred`, which
    // it fills whole) into `cred`, a live local of that type, and the new length into `len`; the
    // descriptor is borrowed from `stream`, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other(format!("SO_PEERCRED gave {len} bytes")));
    }
    Ok(PeerCredentials { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// This process's user id.
pub fn own_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The check of a peer's credentials: the same user as this process (`uid`).
///
/// # Errors
/// [`LocalChannelError::WrongUser`] naming both users and the peer's process.
pub fn check_peer(peer: PeerCredentials, uid: u32) -> Result<PeerCredentials, LocalChannelError> {
    if peer.uid != uid {
        return Err(LocalChannelError::WrongUser { expected: uid, found: peer.uid, pid: peer.pid });
    }
    Ok(peer)
}

/// How far a timeout too long for an [`Instant`] reaches: as good as never.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant `timeout` from now; a timeout past what an [`Instant`] can hold
/// (`Duration::MAX`, "no timeout") waits [`FOREVER`] rather than overflow.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + FOREVER)
}

/// Connects to the socket at `path` without waiting: a listener whose queue is full (it stopped
/// accepting, or is flooded) is `WouldBlock` at once, which the caller retries within its
/// deadline, where a blocking `connect` would wait for room without any bound.
fn connect_unix(path: &Path) -> std::io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new(path)?;
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    // A Unix stream connects at once or not at all (never "in progress").
    rustix::net::connect(&socket, &addr)?;
    let stream = UnixStream::from(socket);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Where the credentials of a connection come from: the kernel ([`peer_credentials`]); the
/// crate's tests give a stand-in (no test can be another user).
type Credentials = fn(&UnixStream) -> std::io::Result<PeerCredentials>;

/// A Unix listener whose connections come with their credentials, for the admission: a
/// connection's source is its user (a user's unproven connections share a quarter of the bound).
struct CredentialedListener<'a> {
    listener: &'a UnixListener,
    credentials: Credentials,
}

impl Listen for CredentialedListener<'_> {
    type Stream = UnixWire;
    type Peer = PeerCredentials;
    type Source = u32;
    fn set_nonblocking(&self, nonblocking: bool) -> std::io::Result<()> {
        self.listener.set_nonblocking(nonblocking)
    }
    fn accept(&self) -> std::io::Result<(UnixWire, PeerCredentials)> {
        let (stream, _) = self.listener.accept()?;
        // A connection whose credentials cannot be read is one that failed: the admission goes on.
        let credentials = (self.credentials)(&stream)
            .map_err(|e| std::io::Error::new(ErrorKind::ConnectionAborted, e.to_string()))?;
        Ok((UnixWire(stream), credentials))
    }
    fn source(peer: &PeerCredentials) -> u32 {
        peer.uid
    }
}

/// The listening end: the rank that creates the socket (in a private directory, see the module
/// docs) and waits for the one rank it expects.
///
/// ```no_run
/// use ppnrt::JobAccess;
/// use ppnrt::local_channel::{LocalChannel, LocalListener};
/// use std::time::Duration;
///
/// let listener = LocalListener::bind(&JobAccess::SameHost, 3)?;
/// let path = listener.path().to_path_buf(); // told to the other rank (e.g. at the rendezvous)
/// let channel = listener.accept(Duration::from_secs(10))?;
/// println!("connected to {}", channel.peer());
/// # Ok::<(), ppnrt::local_channel::LocalChannelError>(())
/// ```
pub struct LocalListener {
    listener: UnixListener,
    dir: PathBuf,
    path: PathBuf,
    key: JobKey,
    purpose: u64,
}

impl LocalListener {
    /// Creates a fresh private directory and listens in it for the rank that connects for
    /// `purpose` (for example a boundary's index), proving `access`'s key.
    ///
    /// # Errors
    /// [`LocalChannelError::Io`] when the directory or the socket cannot be made.
    pub fn bind(access: &JobAccess, purpose: u64) -> Result<LocalListener, LocalChannelError> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|dir| dir.is_absolute() && dir.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let mut name = [0u8; 12];
        getrandom::fill(&mut name)
            .map_err(|e| LocalChannelError::Io { what: "naming the directory".into(), reason: e.to_string() })?;
        let dir = base.join(format!("ppnrt-{}", name.iter().map(|b| format!("{b:02x}")).collect::<String>()));
        // Created, never reused: a directory of that name already there is an error.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| LocalChannelError::io(&format!("creating {}", dir.display()), e))?;
        let path = dir.join("channel");
        let listener = UnixListener::bind(&path).map_err(|e| {
            let _ = std::fs::remove_dir(&dir);
            LocalChannelError::io(&format!("binding {}", path.display()), e)
        })?;
        Ok(LocalListener { listener, dir, path, key: access.key(), purpose })
    }

    /// The socket's path, for the connecting rank.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits up to `timeout` for the rank that connects for this listener's purpose, proves the
    /// job's key and runs as this process's user; connections that do not are closed and cost
    /// it nothing. The socket's path is removed once it is admitted.
    ///
    /// # Errors
    /// [`LocalChannelError::Timeout`] naming the connections refused meanwhile;
    /// [`LocalChannelError::Io`] for a listener that fails.
    pub fn accept(self, timeout: Duration) -> Result<LocalChannel, LocalChannelError> {
        self.accept_with(timeout, peer_credentials)
    }

    fn accept_with(self, timeout: Duration, credentials: Credentials) -> Result<LocalChannel, LocalChannelError> {
        let listener = CredentialedListener { listener: &self.listener, credentials };
        let io = |e: std::io::Error| LocalChannelError::io("listening", e);
        let mut admission =
            Admission::new(&listener, self.key.clone(), MAGIC, HANDSHAKE_BUDGET.min(timeout), MAX_PENDING, PURPOSE)
                .map_err(io)?;
        let deadline = deadline_after(timeout);
        let uid = own_uid();
        let mut other_users = Vec::new();
        let purpose_named = |read: &[u8]| Ok((read.len() >= PURPOSE).then_some(PURPOSE));
        loop {
            if Instant::now() >= deadline {
                let users = if other_users.is_empty() {
                    String::new()
                } else {
                    format!("; refused as other users: {}", other_users.join(", "))
                };
                return Err(LocalChannelError::Timeout {
                    what: format!("rank connected for purpose {} {}{}", self.purpose, admission.refusals(), users),
                });
            }
            let Some(mut admitted) = admission.poll(&purpose_named).map_err(io)? else {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            // Only a peer of this user goes on; any other is closed without an answer.
            let peer = match check_peer(admitted.peer, uid) {
                Ok(peer) => peer,
                Err(e) => {
                    other_users.push(e.to_string());
                    continue;
                }
            };
            let purpose = u64::from_le_bytes(admitted.message[..PURPOSE].try_into().expect("eight bytes"));
            let fresh = purpose == self.purpose;
            let answer = admitted.handshake.answer(&self.key, &[if fresh { ACCEPTED } else { NOT_ACCEPTED }]);
            if write_by(&mut admitted.stream, &answer, deadline).is_err() || !fresh {
                continue;
            }
            let (from_guest, to_guest) = admitted.handshake.record_keys(&self.key, &purpose.to_le_bytes());
            let mut channel = LocalChannel {
                stream: admitted.stream.0,
                peer,
                sealer: Sealer::new(to_guest),
                opener: Opener::new(from_guest),
                timeout: deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10)),
                broken: None,
            };
            // The guest's first frame says it read the answer whole: only then may this end
            // send (a frame sent earlier would reach the guest inside the answer).
            let ready = channel.recv_bytes(0)?;
            debug_assert!(ready.is_empty(), "at most 0 bytes were asked");
            channel.timeout = timeout;
            return Ok(channel);
        }
    }
}

impl fmt::Debug for LocalListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalListener")
            .field("path", &self.path)
            .field("purpose", &self.purpose)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for LocalChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalChannel").field("peer", &self.peer).field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// An admitted channel to the other rank (either end). A send that fails, or a receive that fails
/// once any byte of its frame came, leaves the channel broken (a frame half read or written, a
/// seal's position spent): every later call is [`LocalChannelError::Broken`] naming that
/// failure, and the channel is to be dropped. A receive that timed out before any byte of a
/// frame came leaves it whole.
///
/// ```no_run
/// use std::time::Duration;
/// use ppnrt::JobAccess;
/// use ppnrt::local_channel::{LocalChannel, LocalListener};
///
/// # fn run(access: JobAccess) -> Result<(), ppnrt::local_channel::LocalChannelError> {
/// // The receiving rank listens for boundary 3 and tells the sender the path (at the rendezvous).
/// let listener = LocalListener::bind(&access, 3)?;
/// let path = listener.path().to_path_buf();
/// let sender = std::thread::spawn({
///     let access = access.clone();
///     move || -> Result<(), ppnrt::local_channel::LocalChannelError> {
///         let mut channel = LocalChannel::connect(&path, &access, 3, Duration::from_secs(5))?;
///         channel.send_bytes(b"hello")
///     }
/// });
/// let mut channel = listener.accept(Duration::from_secs(5))?;
/// assert_eq!(channel.recv_bytes(64)?, b"hello");
/// println!("peer pid {}", channel.peer().pid);
/// sender.join().unwrap()?;
/// # Ok(())
/// # }
/// ```
pub struct LocalChannel {
    stream: UnixStream,
    peer: PeerCredentials,
    sealer: Sealer,
    opener: Opener,
    timeout: Duration,
    /// The failure that left the channel mid-frame, if one did.
    broken: Option<String>,
}

impl LocalChannel {
    /// Connects to the listener at `path` for `purpose`, proving `access`'s key, within
    /// `timeout` (retrying, with backoff, while nothing listens there yet).
    ///
    /// # Errors
    /// [`LocalChannelError::Timeout`]; [`LocalChannelError::Unauthenticated`] for a listener
    /// that does not prove the key or does not take this purpose;
    /// [`LocalChannelError::WrongUser`] for a listener of another user.
    pub fn connect(
        path: &Path,
        access: &JobAccess,
        purpose: u64,
        timeout: Duration,
    ) -> Result<LocalChannel, LocalChannelError> {
        LocalChannel::connect_with(path, access, purpose, timeout, peer_credentials)
    }

    fn connect_with(
        path: &Path,
        access: &JobAccess,
        purpose: u64,
        timeout: Duration,
        credentials: Credentials,
    ) -> Result<LocalChannel, LocalChannelError> {
        let key = access.key();
        let deadline = deadline_after(timeout);
        let (mut stream, handshake) =
            connect_and_knock_with(|_| connect_unix(path).map(UnixWire), &key, MAGIC, deadline).map_err(|e| {
                if e.timed_out() {
                    LocalChannelError::Timeout {
                        what: format!("listener at {} (or no handshake with it)", path.display()),
                    }
                } else {
                    LocalChannelError::Unauthenticated { what: format!("the listener at {}: {e}", path.display()) }
                }
            })?;
        // Nothing past the handshake goes to a process of another user.
        let peer = (credentials)(&stream.0).map_err(|e| LocalChannelError::io("reading the peer's credentials", e))?;
        let peer = check_peer(peer, own_uid())?;
        handshake
            .send_message(&mut stream, &key, &purpose.to_le_bytes(), deadline)
            .map_err(|e| LocalChannelError::io("naming the purpose", e))?;
        let answer = handshake
            .read_answer(&mut stream, &key, deadline, |read: &[u8]| Ok((!read.is_empty()).then_some(1)))
            .map_err(|e| match e {
                e if e.timed_out() => LocalChannelError::Timeout { what: "answer from the listener".into() },
                e => LocalChannelError::Unauthenticated { what: format!("the listener's answer: {e}") },
            })?;
        if answer != [ACCEPTED] {
            return Err(LocalChannelError::Unauthenticated {
                what: format!("the listener does not take purpose {purpose}"),
            });
        }
        let (to_host, from_host) = handshake.record_keys(&key, &purpose.to_le_bytes());
        let mut channel = LocalChannel {
            stream: stream.0,
            peer,
            sealer: Sealer::new(to_host),
            opener: Opener::new(from_host),
            timeout,
            broken: None,
        };
        // The answer was read whole: the listener may send from now on (see `accept`).
        channel.send_bytes(&[])?;
        Ok(channel)
    }

    /// The peer's process (its credentials, checked to be this process's user).
    pub fn peer(&self) -> PeerCredentials {
        self.peer
    }

    /// Sends `fds`, each named by its entry of `entries` (in order), in one sealed frame, within
    /// the channel's timeout.
    ///
    /// # Errors
    /// [`LocalChannelError::Record`] for lists of different lengths or more than [`MAX_FDS`];
    /// [`LocalChannelError::Timeout`] or [`LocalChannelError::PeerClosed`] for a peer that does
    /// not read; [`LocalChannelError::Broken`] after a failure that left the channel mid-frame.
    #[doc(alias = "SCM_RIGHTS")]
    pub fn send_fds(&mut self, entries: &[FdEntry], fds: &[BorrowedFd<'_>]) -> Result<(), LocalChannelError> {
        if entries.len() != fds.len() || fds.len() > MAX_FDS {
            return Err(LocalChannelError::Record {
                what: format!("{} entries for {} descriptor(s) (at most {MAX_FDS})", entries.len(), fds.len()),
            });
        }
        self.send_raw(&frame::encode(entries), fds)
    }

    fn send_raw(&mut self, body: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), LocalChannelError> {
        self.whole()?;
        let sent = frame::send(&self.stream, &mut self.sealer, body, fds, deadline_after(self.timeout));
        // The seal's position is spent whether or not the frame went whole.
        if let Err(e) = &sent {
            self.broken = Some(e.to_string());
        }
        sent
    }

    fn receive(&mut self, max: usize) -> Result<(Vec<u8>, Vec<OwnedFd>), LocalChannelError> {
        self.whole()?;
        let mut torn = false;
        let received = frame::receive(&self.stream, &mut self.opener, max, deadline_after(self.timeout), &mut torn);
        if let (Err(e), true) = (&received, torn) {
            self.broken = Some(e.to_string());
        }
        received
    }

    /// Refuses a call on a channel an earlier failure left mid-frame.
    fn whole(&self) -> Result<(), LocalChannelError> {
        match &self.broken {
            Some(earlier) => Err(LocalChannelError::Broken { earlier: earlier.clone() }),
            None => Ok(()),
        }
    }

    /// Receives one frame of descriptors, within the channel's timeout, expecting exactly the
    /// kinds of `expected`, in order: returns each descriptor with its entry. A record of another
    /// count or kinds, one with more or fewer descriptors than it names, or one whose seal does
    /// not open is refused, and every descriptor that came with it is closed.
    ///
    /// # Errors
    /// [`LocalChannelError::Record`], [`LocalChannelError::Unauthenticated`] as above;
    /// [`LocalChannelError::Timeout`] for a peer that sends nothing in time;
    /// [`LocalChannelError::PeerClosed`]; [`LocalChannelError::Broken`] after a failure that left
    /// the channel mid-frame.
    pub fn recv_fds(&mut self, expected: &[FdKind]) -> Result<Vec<ReceivedFd>, LocalChannelError> {
        let (body, fds) = self.receive(frame::MAX_BODY)?;
        frame::match_expected(&body, fds, expected)
    }

    /// Sends `bytes` (at most 64 KiB) as one sealed frame, no descriptor.
    ///
    /// # Errors
    /// As [`send_fds`](Self::send_fds).
    pub fn send_bytes(&mut self, bytes: &[u8]) -> Result<(), LocalChannelError> {
        if bytes.len() > frame::MAX_BODY {
            return Err(LocalChannelError::Record {
                what: format!("{} bytes (at most {})", bytes.len(), frame::MAX_BODY),
            });
        }
        self.send_raw(bytes, &[])
    }

    /// Receives one frame of bytes (at most `max` of them) that carries no descriptor.
    ///
    /// # Errors
    /// As [`recv_fds`](Self::recv_fds); a frame with descriptors is refused (they are closed).
    pub fn recv_bytes(&mut self, max: usize) -> Result<Vec<u8>, LocalChannelError> {
        let max = max.min(frame::MAX_BODY);
        let (body, fds) = self.receive(max)?;
        if !fds.is_empty() {
            return Err(LocalChannelError::Record {
                what: format!("{} descriptor(s) with a frame that should carry none", fds.len()),
            });
        }
        Ok(body)
    }
}
