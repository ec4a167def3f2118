//! What the handshake (`handshake.rs`) and the admission (`admission.rs`) need of a connection
//! ([`Wire`]) and of a listener ([`Listen`]): a TCP connection between hosts, or a Unix stream
//! socket between the ranks of one host (the local channel, `local_channel.rs`). The handshake's proofs and the
//! admission's bounds are the same on both.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connection the handshake runs on.
pub(crate) trait Wire: Read + Write {
    /// As `TcpStream::set_read_timeout`.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// As `TcpStream::set_write_timeout`.
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// As `TcpStream::set_nonblocking`.
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    /// Reads without taking (as `TcpStream::peek`).
    fn peek(&self, buf: &mut [u8]) -> io::Result<usize>;
}

/// A listener the admission serves.
pub(crate) trait Listen {
    /// Its connections.
    type Stream: Wire;
    /// Who a connection comes from, as `accept` tells (shown in the refusals).
    type Peer: Copy + fmt::Display;
    /// What the connections of one source share (its share of the pending bound).
    type Source: Copy + Eq;
    /// As `TcpListener::set_nonblocking`.
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    /// The next connection and who it comes from.
    fn accept(&self) -> io::Result<(Self::Stream, Self::Peer)>;
    /// The source of a connection from `peer`.
    fn source(peer: &Self::Peer) -> Self::Source;
}

impl Wire for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        TcpStream::set_nonblocking(self, nonblocking)
    }
    fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        TcpStream::peek(self, buf)
    }
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    type Peer = SocketAddr;
    /// A source is an address: one host's connections share a quarter of the bound.
    type Source = IpAddr;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        TcpListener::set_nonblocking(self, nonblocking)
    }
    fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        TcpListener::accept(self)
    }
    fn source(peer: &SocketAddr) -> IpAddr {
        peer.ip()
    }
}

/// A Unix stream socket for the handshake: its writes never raise `SIGPIPE` (`MSG_NOSIGNAL`;
/// `std`'s `write` on a Unix socket may, in a host program that did not ignore the signal) when
/// the peer has gone; they fail with `BrokenPipe` instead.
pub(crate) struct UnixWire(pub(crate) UnixStream);

impl Read for UnixWire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for UnixWire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(rustix::net::send(&self.0, buf, rustix::net::SendFlags::NOSIGNAL)?)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Wire for UnixWire {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.set_write_timeout(timeout)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        self.0.set_nonblocking(nonblocking)
    }
    fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(rustix::net::recv(&self.0, buf, rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT)?.0)
    }
}
