//! What the interprocess tests need to reach another process: a Unix socket between a test and
//! its child (a path the child is told in `PPNRT_IPC_SOCKET`), a file descriptor passed over it
//! with `SCM_RIGHTS`, and short text lines (the step counter a transport would keep in shared
//! memory). The minimum for the tests; no channel of the crate.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The variable naming the socket's path in the child.
pub const SOCKET_VAR: &str = "PPNRT_IPC_SOCKET";

/// A listening socket at a fresh path, and the path.
pub fn listen(name: &str) -> (UnixListener, PathBuf) {
    let path = std::env::temp_dir().join(format!("ppnrt-ipc-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    (UnixListener::bind(&path).expect("bind the test's socket"), path)
}

/// Runs the ignored test `name` of this binary as a child process, told the socket's `path`,
/// with `env` set; its output is piped (read by [`finish`]).
pub fn spawn_child(name: &str, path: &std::path::Path, env: &[(&str, &str)]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(SOCKET_VAR, path)
        .env("PPNRT_DOUBLE_CHILD", "1")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the child")
}

/// Accepts the child's connection, with a deadline, and removes the socket's `path`.
pub fn accept(listener: &UnixListener, path: &std::path::Path) -> UnixStream {
    let stream = accept_within(listener);
    let _ = std::fs::remove_file(path);
    stream
}

fn accept_within(listener: &UnixListener) -> UnixStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                return stream;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("the child never connected: {e}"),
        }
    }
}

/// The child's end: connects to the socket its parent named.
pub fn connect() -> UnixStream {
    let path = std::env::var_os(SOCKET_VAR).expect("run through the parent test");
    let stream = UnixStream::connect(path).expect("connect to the parent");
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    stream
}

/// Waits for the child and panics with its output unless it passed.
pub fn finish(child: Child, name: &str) {
    let output = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains("1 passed"), "child {name} failed:\n{text}");
}

/// Sends one line (no newline inside).
pub fn send_line(stream: &mut UnixStream, line: &str) {
    stream.write_all(format!("{line}\n").as_bytes()).expect("send a line");
}

/// Reads one line, byte by byte (nothing is read past it).
pub fn read_line(stream: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8];
    loop {
        stream.read_exact(&mut byte).expect("read a line");
        if byte[0] == b'\n' {
            return String::from_utf8(line).unwrap();
        }
        line.push(byte[0]);
    }
}

/// Sends `fd` and `payload` (at least one byte) in one message.
pub fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) {
    assert!(!payload.is_empty());
    let raw = fd.as_raw_fd();
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec { iov_base: payload.as_ptr().cast_mut().cast(), iov_len: payload.len() };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control holds CMSG_SPACE bytes, so the first header and its data fit.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
    }
    // SAFETY: msg points at live buffers for the call.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, 0) };
    assert_eq!(sent, payload.len() as isize, "sendmsg: {}", std::io::Error::last_os_error());
}

/// Receives a descriptor and up to `payload.len()` bytes sent by [`send_fd`].
pub fn recv_fd(stream: &UnixStream, payload: &mut [u8]) -> (OwnedFd, usize) {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers for the call.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(got > 0, "recvmsg: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel filled msg_control; the header is checked before its data is read.
    let fd = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        assert!(!cmsg.is_null() && (*cmsg).cmsg_type == libc::SCM_RIGHTS, "no descriptor came");
        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>())
    };
    // SAFETY: SCM_RIGHTS gave this process a new descriptor that nothing else owns.
    (unsafe { OwnedFd::from_raw_fd(fd) }, got as usize)
}
