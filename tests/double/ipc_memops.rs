//! Stream memory operations ordering two processes through memory one exports and the other
//! imports (the double's model: `tests/driver_double/cuda_double_ipc.inc`, run on its progress
//! thread): data written before a flag's write-value is read exact after the other process's
//! wait-value; a wait whose writer process died is released by this process from another stream,
//! and every use after touches live memory; a later write still waits for a wait that a
//! write-value released; bad input is a typed error naming the value.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::double::{self, with_double};
use crate::ipc_fd::{accept, connect, finish, listen, read_line, recv_fd, send_fd, send_line, spawn_child};
use crate::scenarios::run_child;
use ppnrt::{CudaError, CudaStream, Engine, ExportedMemory, ImportedMemory, IpcError, MemOpsSupport, WaitCondition};

const LEN: usize = 4096;

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// Whether `stream` runs dry within `within` (polled: the double runs a stream under polling).
fn idle_within(stream: &CudaStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if stream.is_idle().unwrap() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// This process (device 0) exports a data buffer and two flag words ("filled", "consumed"); a
/// child (device 1) imports them, copies its data in behind a gate of its own device, then
/// writes "filled" = 1. This process's stream waits for "filled" >= 1 and reads: exact, though
/// a read that does not wait sees the bytes from before. It then writes "consumed" = 1, which
/// releases the child's wait for it.
#[test]
fn a_flag_word_orders_two_processes() {
    with_double("a_flag_word_orders_two_processes", |double| {
        let engine = Engine::new(0).unwrap();
        let stream = CudaStream::new(engine.context()).unwrap();
        let mut data = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
        let mut flags = ExportedMemory::<u64>::alloc(&stream, 2).unwrap();
        stream.memset_u32(&mut data.as_view_mut(), 0).unwrap();
        stream.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
        stream.synchronize().unwrap();

        let (listener, path) = listen("memops-order");
        let child = spawn_child("ipc_memops::child_sender", &path, &[]);
        let mut sock = accept(&listener, &path);
        send_fd(&sock, data.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
        send_fd(&sock, flags.export_fd().unwrap().as_fd(), &2u64.to_le_bytes());
        assert_eq!(read_line(&mut sock), "queued");

        // The protocol broken on purpose: a read that does not wait for "filled" reads the bytes
        // from before the child's copy (held behind its gate for a while).
        let early = CudaStream::new(engine.context()).unwrap();
        let mut stale = vec![1u32; LEN];
        early.memcpy_dtoh(&*data, &mut stale).unwrap();
        assert!(stale.iter().all(|&x| x == 0), "the child's copy ran before its turn");

        stream.wait_value_u64(&*flags, 0, 1, WaitCondition::GEQ).unwrap();
        let mut got = vec![0u32; LEN];
        stream.memcpy_dtoh(&*data, &mut got).unwrap();
        assert_eq!(got, pattern(LEN, 21), "the sender's bytes, exact, after its flag");
        stream.write_value_u64(&mut flags.as_view_mut(), 1, 1).unwrap();
        assert_eq!(read_line(&mut sock), "consumed");
        send_line(&mut sock, "done");
        finish(child, "ipc_memops::child_sender");
        assert_eq!(engine.dtoh(&*flags).unwrap(), [1, 1]);
        drop((data, flags));
        double.flush();
    });
}

#[test]
#[ignore = "runs in a child process of a_flag_word_orders_two_processes"]
fn child_sender() {
    static OPEN: AtomicBool = AtomicBool::new(false);
    let Some((_serial, double)) = double::setup("child_sender") else { panic!("no double") };
    let mut sock = connect();
    let mut len = [0u8; 8];
    let (data_fd, _) = recv_fd(&sock, &mut len);
    let data_len = u64::from_le_bytes(len) as usize;
    let (flags_fd, _) = recv_fd(&sock, &mut len);
    let engine = Engine::new(1).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut data = ImportedMemory::<u32>::import(&stream, data_fd, data_len).unwrap();
    let mut flags = ImportedMemory::<u64>::import(&stream, flags_fd, u64::from_le_bytes(len) as usize).unwrap();
    double.gate(&stream, &OPEN);
    stream.memcpy_htod(&pattern(data_len, 21), &mut data.as_view_mut()).unwrap();
    stream.write_value_u64(&mut flags.as_view_mut(), 0, 1).unwrap();
    stream.wait_value_u64(&*flags, 1, 1, WaitCondition::GEQ).unwrap();
    send_line(&mut sock, "queued");
    // The parent reads early meanwhile; its ordered read waits for the flag, written after this.
    std::thread::sleep(Duration::from_millis(200));
    OPEN.store(true, Ordering::Release);
    // Returns once the parent's "consumed" write released the wait.
    stream.synchronize().unwrap();
    send_line(&mut sock, "consumed");
    assert_eq!(read_line(&mut sock), "done");
    drop((data, flags));
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// The exporter (a child) of the flag and the data exits while this process's stream waits on
/// the flag: this process releases the wait itself, writing the awaited value from another
/// stream, and the reads after the wait (and the release of the mappings) touch live memory.
/// The pattern a boundary uses to report a dead peer without a hang.
#[test]
fn a_wait_on_a_dead_exporter_is_released_by_its_own_process() {
    with_double("a_wait_on_a_dead_exporter_is_released_by_its_own_process", |double| {
        let (listener, path) = listen("memops-dead");
        let child = spawn_child("ipc_memops::child_exporter_that_dies", &path, &[]);
        let mut sock = accept(&listener, &path);
        let mut len = [0u8; 8];
        let (data_fd, _) = recv_fd(&sock, &mut len);
        let data_len = u64::from_le_bytes(len) as usize;
        let (flags_fd, _) = recv_fd(&sock, &mut len);
        let engine = Engine::new(0).unwrap();
        let waiting = CudaStream::new(engine.context()).unwrap();
        let data = ImportedMemory::<u32>::import(&waiting, data_fd, data_len).unwrap();
        let mut flags = ImportedMemory::<u64>::import(&waiting, flags_fd, u64::from_le_bytes(len) as usize).unwrap();
        let mut received = engine.alloc::<u32>(data_len).unwrap();
        waiting.wait_value_u64(&*flags, 0, 1, WaitCondition::GEQ).unwrap();
        waiting.memcpy_dtod(&*data, &mut received).unwrap();
        send_line(&mut sock, "waiting");
        finish(child, "ipc_memops::child_exporter_that_dies");
        assert!(!idle_within(&waiting, Duration::from_millis(50)), "the wait held its stream");

        // The release: the awaited value, written by this process from another stream.
        let releasing = CudaStream::new(engine.context()).unwrap();
        releasing.write_value_u64(&mut flags.as_view_mut(), 0, 1).unwrap();
        if !idle_within(&waiting, Duration::from_secs(10)) {
            // Leak what waits (its drop would wait forever) and fail.
            std::mem::forget((data, flags, received, waiting, releasing));
            panic!("the write-value from another stream did not release the wait");
        }
        assert_eq!(engine.dtoh(&received).unwrap(), pattern(data_len, 31), "the dead exporter's bytes stay");
        let violations = double.violations();
        drop((data, flags));
        assert_eq!(double.violations(), violations, "{}", double.last_violation());
    });
}

#[test]
#[ignore = "runs in a child process of a_wait_on_a_dead_exporter_is_released_by_its_own_process"]
fn child_exporter_that_dies() {
    let Some((_serial, double)) = double::setup("child_exporter_that_dies") else { panic!("no double") };
    let mut sock = connect();
    let engine = Engine::new(1).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut data = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    let mut flags = ExportedMemory::<u64>::alloc(&stream, 1).unwrap();
    stream.memcpy_htod(&pattern(LEN, 31), &mut data.as_view_mut()).unwrap();
    stream.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
    stream.synchronize().unwrap();
    send_fd(&sock, data.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
    send_fd(&sock, flags.export_fd().unwrap().as_fd(), &1u64.to_le_bytes());
    assert_eq!(read_line(&mut sock), "waiting");
    // Dies without writing the flag: the export goes with this process.
    drop((data, flags));
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// A write-value is not ordered after the wait-values it releases, but a later write of the same
/// memory is: a memset on a third stream stays queued while a wait on the memory is unmet, though
/// a write-value (of too small a value) came between. The wait is then released through a second
/// mapping of the same memory (as another process would), which the memset does not hold up.
#[test]
fn a_later_write_still_waits_for_a_released_wait() {
    with_double("a_later_write_still_waits_for_a_released_wait", |_double| {
        let engine = Engine::new(0).unwrap();
        let [waiting, signalling, writing]: [Arc<CudaStream>; 3] =
            std::array::from_fn(|_| CudaStream::new(engine.context()).unwrap());
        let mut flags = ExportedMemory::<u64>::alloc(&waiting, 2).unwrap();
        let mut alias = ImportedMemory::<u64>::import(&signalling, flags.export_fd().unwrap(), 2).unwrap();
        waiting.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
        waiting.synchronize().unwrap();
        waiting.wait_value_u64(&*flags, 0, 5, WaitCondition::GEQ).unwrap();
        signalling.write_value_u64(&mut flags.as_view_mut(), 0, 1).unwrap();
        assert!(idle_within(&signalling, Duration::from_secs(10)), "a write-value does not wait for the wait");
        writing.memset_bytes(&mut flags.as_view_mut().slice_mut(1..).unwrap(), 7).unwrap();
        let ran_early = idle_within(&writing, Duration::from_millis(100));
        signalling.write_value_u64(&mut alias.as_view_mut(), 0, 5).unwrap();
        assert!(idle_within(&waiting, Duration::from_secs(10)) && idle_within(&writing, Duration::from_secs(10)));
        assert!(!ran_early, "the memset ran while a wait on the memory was unmet");
        assert_eq!(engine.dtoh(&*flags).unwrap(), [5, 0x0707_0707_0707_0707]);
        drop((alias, flags));
    });
}

/// An index past the flags, a flushing wait on a device that cannot flush remote writes, and
/// flags of another device than the stream's: each a typed error naming the value, with nothing
/// enqueued.
#[test]
fn bad_flag_words_are_typed_errors() {
    with_double("bad_flag_words_are_typed_errors", |double| {
        let engine = Engine::new(0).unwrap();
        let stream = CudaStream::new(engine.context()).unwrap();
        let support = MemOpsSupport::of(engine.device()).unwrap();
        assert!(support.ops_64 && !support.flush_remote_writes, "{support:?}");
        let mut flags = engine.alloc_zeroed::<u64>(2).unwrap();
        engine.synchronize().unwrap();
        let pending = double.pending();
        let err = stream.write_value_u64(&mut flags, 2, 1).unwrap_err();
        assert_eq!(err, CudaError::OutOfBounds { what: "CudaStream::write_value_u64", start: 2, end: 3, len: 2 });
        assert!(err.to_string().contains("2..3"), "{err}");
        assert_eq!(
            stream.wait_value_u64(&flags.slice(1..).unwrap(), 1, 1, WaitCondition::EQ).unwrap_err(),
            CudaError::OutOfBounds { what: "CudaStream::wait_value_u64", start: 1, end: 2, len: 1 }
        );
        let flush = WaitCondition::GEQ.flush_remote_writes();
        assert!(flush.flushes() && !WaitCondition::GEQ.flushes());
        assert_eq!(
            stream.wait_value_u64(&flags, 0, 1, flush).unwrap_err(),
            CudaError::Ipc(IpcError::Unsupported {
                what: "CudaStream::wait_value_u64",
                device: 0,
                missing: "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES"
            })
        );
        let other = Engine::new(1).unwrap();
        let mut theirs = other.alloc_zeroed::<u64>(1).unwrap();
        other.synchronize().unwrap();
        assert!(matches!(
            stream.write_value_u64(&mut theirs, 0, 1).unwrap_err(),
            CudaError::WrongDevice { what: "CudaStream::write_value_u64", expected: 0, found: 1 }
        ));
        assert_eq!(double.pending(), pending, "nothing was enqueued");
        run_child("ipc_memops::child_without_memops", &double.path, &[("PPNRT_DOUBLE_NO_IPC", "1")]);
    });
}

#[test]
#[ignore = "runs in a child process of bad_flag_words_are_typed_errors"]
fn child_without_memops() {
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, _double)) = double::setup("child_without_memops") else { panic!("no double") };
    let engine = Engine::new(0).unwrap();
    assert!(!MemOpsSupport::of(engine.device()).unwrap().ops_64);
    let mut flags = engine.alloc_zeroed::<u64>(1).unwrap();
    let expected = |what| {
        CudaError::Ipc(IpcError::Unsupported {
            what,
            device: 0,
            missing: "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
        })
    };
    let stream = engine.default_stream();
    assert_eq!(stream.write_value_u64(&mut flags, 0, 1).unwrap_err(), expected("CudaStream::write_value_u64"));
    assert_eq!(
        stream.wait_value_u64(&flags, 0, 1, WaitCondition::GEQ).unwrap_err(),
        expected("CudaStream::wait_value_u64")
    );
}

/// The double's own check, reached through the raw driver (the crate's release waits for every
/// pending memory operation, so it never gets here): a wait-value and a write-value on freed
/// memory are each a violation when they run, and the wait does not hold its stream. In a child
/// process: the violations it makes stay out of this process's count.
#[test]
fn a_memop_on_freed_memory_is_a_violation_of_the_double() {
    with_double("a_memop_on_freed_memory_is_a_violation_of_the_double", |double| {
        run_child("ipc_memops::child_memop_on_freed_memory", &double.path, &[]);
    });
}

#[test]
#[ignore = "runs in a child process of a_memop_on_freed_memory_is_a_violation_of_the_double"]
fn child_memop_on_freed_memory() {
    use crate::raw_driver::raw;
    use ppnrt::DeviceSlice;
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, double)) = double::setup("child_memop_on_freed_memory") else { panic!("no double") };
    let engine = Engine::new(0).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let flags = engine.alloc_zeroed::<u64>(1).unwrap();
    let addr = flags.device_ptr();
    drop(flags);
    engine.synchronize().unwrap();
    let before = double.violations();
    {
        let _bound = engine.context().bind().unwrap();
        raw!(cuStreamWaitValue64_v2(stream.raw(), addr, 1, 0));
        raw!(cuStreamWriteValue64_v2(stream.raw(), addr, 1, 0));
    }
    assert!(idle_within(&stream, Duration::from_secs(10)), "a wait on freed memory held its stream");
    assert_eq!(double.violations(), before + 2, "{}", double.last_violation());
    assert!(double.last_violation().contains("freed memory"), "{}", double.last_violation());
}
