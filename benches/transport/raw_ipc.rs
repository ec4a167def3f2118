//! The raw two-process IPC loop: the same workloads as the processes table (the isolated hop over
//! stages [0, 1, 0], the pipelined step at 32 KiB, the stream of 64 MiB steps) made by two
//! processes with the driver's calls alone, no pipeline. Each rank exports its inbound slots
//! (`cuMemCreate`, POSIX descriptors over the local channel) and two flag words per slot
//! (`filled[s]`, `consumed[s]`), the other maps them, and a step is a copy into the peer's slot
//! between two flag operations; as in the table, the receiver copies the step out of its slot
//! into a buffer of its own (what `rx` returns), and its stream frees the slot after that copy. Two places for the flag words, chosen by [`FLAGS_VAR`]:
//! - `device`: exported device memory; both sides wait on the device (`cuStreamWaitValue64`);
//! - `host`: a page of a memfd both processes map and register (`cuMemHostRegister`); the GPU
//!   writes the words (`cuStreamWriteValue64`) and each side waits for them on the host, so no
//!   stream ever waits for the other process.
//!
//! The slot count is two, as in the table's pipelines.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ppnrt::local_channel::{FdEntry, FdKind, LocalChannel, LocalListener};
use ppnrt::rendezvous::Rendezvous;
use ppnrt::sys::{CUdeviceptr, CUstream, CUstreamWaitValue_flags, CUstreamWriteValue_flags};
use ppnrt::{CudaStream, DeviceSlice, Engine, ExportedMemory, ImportedMemory};

use super::median;
use super::raw_driver::raw;

/// `device` or `host`: where the raw loop's flag words live.
pub(super) const FLAGS_VAR: &str = "PPNRT_BENCH_RAW_FLAGS";
const SLOTS: usize = 2;
const SLOT_BYTES: usize = super::processes::LARGE * 4;
const SMALL_BYTES: usize = super::processes::SMALL * 4;
/// The flag words: `filled[s]` at word 8·s, `consumed[s]` at word 8·(SLOTS + s), a 64-byte line
/// each.
const FLAG_WORDS: usize = 8 * 2 * SLOTS;
const PAGE: usize = 4096;
const WAIT: Duration = Duration::from_secs(60);

fn filled(s: usize) -> usize {
    8 * s
}

fn consumed(s: usize) -> usize {
    8 * (SLOTS + s)
}

/// Flag words of one direction, as this process reaches them.
enum Words {
    /// In device memory (exported or imported): reached by the GPU only.
    Device { base: CUdeviceptr, _keep: Box<dyn std::any::Any> },
    /// In a shared host page, registered with the driver: the host reads, the GPU writes.
    Host { host: *mut u64, device: CUdeviceptr, _fd: OwnedFd },
}

impl Words {
    fn device_ptr(&self, word: usize) -> CUdeviceptr {
        match self {
            Words::Device { base, .. } | Words::Host { device: base, .. } => base + (word * 8) as CUdeviceptr,
        }
    }

    /// Waits on the host until `word >= value` (host words only).
    fn wait_host(&self, word: usize, value: u64) {
        let Words::Host { host, .. } = self else { unreachable!("a device word is waited on by the GPU") };
        // SAFETY: the page is mapped for the process's life and only reached through atomics.
        let atomic = unsafe { AtomicU64::from_ptr(host.add(word)) };
        let start = Instant::now();
        while atomic.load(Ordering::Acquire) < value {
            std::hint::spin_loop();
            assert!(start.elapsed() < WAIT, "the raw IPC loop waited {WAIT:?} for word {word} to reach {value}");
        }
    }

    /// `stream` waits until `word >= value`: on the GPU for device words, on the host for host
    /// words.
    fn wait(&self, stream: CUstream, word: usize, value: u64) {
        match self {
            Words::Device { .. } => raw!(cuStreamWaitValue64_v2(
                stream,
                self.device_ptr(word),
                value,
                CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ.0
            )),
            Words::Host { .. } => self.wait_host(word, value),
        }
    }

    /// On `stream`, after its earlier work: `word = value`.
    fn write(&self, stream: CUstream, word: usize, value: u64) {
        raw!(cuStreamWriteValue64_v2(
            stream,
            self.device_ptr(word),
            value,
            CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0
        ));
    }
}

/// One rank's two directions: its inbound slots and words (exported), the peer's (imported).
struct Rank {
    stream: Arc<CudaStream>,
    inbound_slots: CUdeviceptr,
    inbound: Words,
    outbound_slots: CUdeviceptr,
    outbound: Words,
    _keep: (ExportedMemory<u8>, ImportedMemory<u8>, LocalChannel),
}

/// A host page both processes map: a memfd, mapped shared and registered with the driver.
fn host_page(fd: OwnedFd) -> Words {
    use rustix::mm::{MapFlags, ProtFlags};
    // SAFETY: a fresh shared mapping of a page of the memfd, not aliased by any Rust reference.
    let host = unsafe {
        rustix::mm::mmap(std::ptr::null_mut(), PAGE, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
    }
    .expect("mapping the flag page")
    .cast::<u64>();
    raw!(cuMemHostRegister_v2(host.cast(), PAGE, 0x2 /* DEVICEMAP */ | 0x1 /* PORTABLE */));
    let mut device: CUdeviceptr = 0;
    raw!(cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0));
    Words::Host { host, device, _fd: fd }
}

fn setup(primary: &Engine, on_host: bool) -> Rank {
    let rank: usize = std::env::var("PPNRT_RANK").unwrap().parse().unwrap();
    let access = ppnrt::JobAccess::from_env().expect("the job's access settings");
    let stream = CudaStream::new(primary.context()).unwrap();
    raw!(cuCtxSetCurrent(primary.context().raw()));
    let listener = (rank == 1).then(|| LocalListener::bind(&access, 7).unwrap());
    let path = listener.as_ref().map(|l| l.path().as_os_str().as_encoded_bytes().to_vec()).unwrap_or_default();
    let meet = Rendezvous {
        addr: std::env::var("PPNRT_RENDEZVOUS").unwrap(),
        rank,
        world: 2,
        fingerprint: "raw-ipc".into(),
        timeout: WAIT,
        access: access.clone(),
    };
    let members = meet.exchange(&path).unwrap();
    let mut channel = match listener {
        Some(listener) => listener.accept(WAIT).unwrap(),
        None => {
            // SAFETY: the bytes came from the peer's `OsStr` of a path on this host.
            let path = unsafe { std::ffi::OsStr::from_encoded_bytes_unchecked(&members[1].bytes) };
            LocalChannel::connect(std::path::Path::new(path), &access, 7, WAIT).unwrap()
        }
    };
    // Inbound: slots, and the flag words with consumed[s] = s (slot s is free for step s).
    let mut slots = ExportedMemory::<u8>::alloc(&stream, SLOTS * SLOT_BYTES).unwrap();
    let inbound_slots = slots.as_view_mut().device_ptr();
    let mut initial = vec![0u64; FLAG_WORDS];
    for s in 0..SLOTS {
        initial[consumed(s)] = s as u64;
    }
    let (inbound, flags_fd) = if on_host {
        let fd = rustix::fs::memfd_create("ppnrt-bench-flags", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, PAGE as u64).unwrap();
        let passed = fd.try_clone().unwrap();
        let words = host_page(fd);
        let Words::Host { host, .. } = &words else { unreachable!() };
        for (w, value) in initial.iter().enumerate() {
            // SAFETY: the page is mapped; the peer has not seen it yet.
            unsafe { AtomicU64::from_ptr(host.add(w)) }.store(*value, Ordering::Release);
        }
        (words, passed)
    } else {
        let mut flags = ExportedMemory::<u64>::alloc(&stream, FLAG_WORDS).unwrap();
        let base = flags.as_view_mut().device_ptr();
        raw!(cuMemcpyHtoDAsync_v2(base, initial.as_ptr().cast(), FLAG_WORDS * 8, stream.raw()));
        raw!(cuStreamSynchronize(stream.raw()));
        let fd = flags.export_fd().unwrap();
        (Words::Device { base, _keep: Box::new(flags) }, fd)
    };
    let entries = [
        FdEntry { kind: FdKind::SlotMemory, bytes: (SLOTS * SLOT_BYTES) as u64, index: 0 },
        FdEntry { kind: FdKind::Flags, bytes: (FLAG_WORDS * 8) as u64, index: 0 },
    ];
    let slots_fd = slots.export_fd().unwrap();
    let send = |channel: &mut LocalChannel| channel.send_fds(&entries, &[slots_fd.as_fd(), flags_fd.as_fd()]).unwrap();
    let receive = |channel: &mut LocalChannel| channel.recv_fds(&[FdKind::SlotMemory, FdKind::Flags]).unwrap();
    let received = if rank == 0 {
        send(&mut channel);
        receive(&mut channel)
    } else {
        let received = receive(&mut channel);
        send(&mut channel);
        received
    };
    let mut received = received.into_iter();
    let peer_slots_fd = received.next().unwrap().fd;
    let peer_flags_fd = received.next().unwrap().fd;
    let mut peer_slots = ImportedMemory::<u8>::import(&stream, peer_slots_fd, SLOTS * SLOT_BYTES).unwrap();
    let outbound_slots = peer_slots.as_view_mut().device_ptr();
    let outbound = if on_host {
        host_page(peer_flags_fd)
    } else {
        let mut flags = ImportedMemory::<u64>::import(&stream, peer_flags_fd, FLAG_WORDS).unwrap();
        let base = flags.as_view_mut().device_ptr();
        Words::Device { base, _keep: Box::new(flags) }
    };
    raw!(cuStreamSynchronize(stream.raw()));
    // Both sides' initial words are in place before either sends.
    if rank == 0 {
        channel.send_bytes(&[1]).unwrap();
        channel.recv_bytes(1).unwrap();
    } else {
        channel.recv_bytes(1).unwrap();
        channel.send_bytes(&[1]).unwrap();
    }
    Rank { stream, inbound_slots, inbound, outbound_slots, outbound, _keep: (slots, peer_slots, channel) }
}

impl Rank {
    /// Step `k` into the peer's slot: once the slot is free, copy `bytes` from `src`, mark it
    /// filled.
    fn send(&self, k: u64, src: CUdeviceptr, bytes: usize) {
        let (s, stream) = ((k % SLOTS as u64) as usize, self.stream.raw());
        self.outbound.wait(stream, consumed(s), k);
        raw!(cuMemcpyAsync(self.outbound_slots + (s * SLOT_BYTES) as CUdeviceptr, src, bytes, stream));
        self.outbound.write(stream, filled(s), k + 1);
    }

    /// Step `k` in this rank's slot: waits until it is filled.
    fn receive(&self, k: u64) {
        let s = (k % SLOTS as u64) as usize;
        self.inbound.wait(self.stream.raw(), filled(s), k + 1);
    }

    /// On the stream: copies `bytes` of step `k`'s slot into `dst`, as the pipeline's `rx` copies
    /// a step out of its slot into the stage's own buffer.
    fn copy_out(&self, k: u64, dst: CUdeviceptr, bytes: usize) {
        let s = (k % SLOTS as u64) as usize;
        let src = self.inbound_slots + (s * SLOT_BYTES) as CUdeviceptr;
        raw!(cuMemcpyAsync(dst, src, bytes, self.stream.raw()));
    }

    /// After the stream's reads of step `k`'s slot: free it for step `k + SLOTS`.
    fn release(&self, k: u64) {
        let s = (k % SLOTS as u64) as usize;
        self.inbound.write(self.stream.raw(), consumed(s), k + SLOTS as u64);
    }

    fn synchronize(&self) {
        raw!(cuStreamSynchronize(self.stream.raw()));
    }
}

/// A source of `bytes` bytes of varied values (never timed on zeros).
fn source(primary: &Engine, bytes: usize) -> ppnrt::CudaSlice<f32> {
    let x = primary.htod(&(0..bytes / 4).map(|i| (i % 977) as f32 * 0.25 + 1.0).collect::<Vec<_>>()).unwrap();
    primary.synchronize().unwrap();
    x
}

/// The isolated hop: rank 0 sends step `t`, rank 1 copies it back into rank 0's slot, rank 0
/// waits for it; half the round trip (µs, median) on rank 0.
pub(super) fn hop(primary: &Engine) -> Option<f64> {
    let on_host = std::env::var(FLAGS_VAR).is_ok_and(|v| v == "host");
    let rank = setup(primary, on_host);
    let first = std::env::var("PPNRT_RANK").unwrap() == "0";
    let x = source(primary, SMALL_BYTES);
    // Rank 0's own buffer for the step that comes back (what `rx` returns).
    let y = source(primary, SMALL_BYTES);
    let mut halves = Vec::new();
    for t in 0..330u64 {
        if first {
            let start = Instant::now();
            rank.send(t, x.device_ptr(), SMALL_BYTES);
            rank.receive(t);
            rank.copy_out(t, y.device_ptr(), SMALL_BYTES);
            rank.release(t);
            rank.synchronize();
            if t >= 30 {
                halves.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            rank.receive(t);
            rank.copy_out(t, y.device_ptr(), SMALL_BYTES);
            rank.release(t);
            rank.send(t, y.device_ptr(), SMALL_BYTES);
        }
    }
    rank.synchronize();
    (!halves.is_empty()).then(|| median(&mut halves))
}

/// Rank 0 streams steps to rank 1: 2,000 of 32 KiB, then 45 of 64 MiB, timed on rank 1 after
/// its fifth step. Returns (µs per 32 KiB step, GB/s at 64 MiB) on rank 1.
pub(super) fn stream(primary: &Engine) -> (Option<f64>, Option<f64>) {
    let on_host = std::env::var(FLAGS_VAR).is_ok_and(|v| v == "host");
    let rank = setup(primary, on_host);
    let sends = std::env::var("PPNRT_RANK").unwrap() == "0";
    let x = source(primary, SLOT_BYTES);
    // The receiver's own buffer each step is copied into (what `rx` returns).
    let y = source(primary, SLOT_BYTES);
    let mut t = 0u64;
    let mut run = |bytes: usize, steps: usize| -> Option<f64> {
        let mut first = None;
        for k in 0..steps {
            if sends {
                rank.send(t, x.device_ptr(), bytes);
            } else {
                rank.receive(t);
                rank.copy_out(t, y.device_ptr(), bytes);
                rank.release(t);
                if k == 4 {
                    rank.synchronize();
                    first = Some(Instant::now());
                }
            }
            t += 1;
        }
        rank.synchronize();
        first.map(|first| first.elapsed().as_secs_f64() * 1e6 / (steps - 5) as f64)
    };
    let step = run(SMALL_BYTES, 2000);
    let large = run(SLOT_BYTES, 45);
    (step, large.map(|us| SLOT_BYTES as f64 / (us * 1e3)))
}
