//! Memory and events shared between processes, through the driver double (its memfd model:
//! `tests/driver_double/cuda_double_ipc.inc`): each test that crosses processes runs this binary
//! again as a child (an ignored test, `--exact`), joined by a Unix socket that carries the
//! exported descriptor (`SCM_RIGHTS`) and the step lines a transport would keep in shared memory.
//! Bytes cross exact, interprocess events order the two processes' streams, an importer's mapping
//! outlives its exporter, bad sizes and handles are typed errors naming the value, and a mapping
//! is released only after every use in its process.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::double::{self, with_double};
use crate::ipc_fd::{accept, connect, finish, listen, read_line, recv_fd, send_fd, send_line, spawn_child};
use crate::scenarios::run_child;
use ppnrt::{
    CudaError, CudaStream, Engine, ExportedMemory, ImportedMemory, IpcError, IpcEvent, IpcEventHandle, LegacyImport,
    LegacyIpcHandle,
};

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

fn ipc_error(result: Result<impl std::fmt::Debug, CudaError>) -> IpcError {
    match result {
        Err(CudaError::Ipc(e)) => e,
        other => panic!("expected an IpcError, got {other:?}"),
    }
}

const LEN: usize = 5000;

/// The exporter (this process, device 0) and the importer (a child, device 1) write and read one
/// allocation; the importer's write is held back on its stream until this process lets it
/// through, so a read that does not wait on the importer's interprocess event sees the old
/// bytes, and the read that waits sees the new ones, exact.
#[test]
fn exported_bytes_reach_another_process_in_event_order() {
    static OPEN: AtomicBool = AtomicBool::new(false);
    with_double("exported_bytes_reach_another_process_in_event_order", |double| {
        let engine = Engine::new(0).unwrap();
        let stream = CudaStream::new(engine.context()).unwrap();
        let mut mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
        assert_eq!(mem.mapped_bytes() % (64 << 10), 0, "rounded to the double's granularity");
        stream.memset_u32(&mut mem.as_view_mut(), 0).unwrap();
        let filled = IpcEvent::new(engine.context()).unwrap();
        let go = IpcEvent::new(engine.context()).unwrap();
        assert!(!filled.is_opened() && !filled.has_timing());

        let (listener, path) = listen("order");
        let child = spawn_child("ipc::child_importer", &path, &[]);
        let mut sock = accept(&listener, &path);
        let mut message = (LEN as u64).to_le_bytes().to_vec();
        message.extend_from_slice(&filled.handle().unwrap().0);
        message.extend_from_slice(&go.handle().unwrap().0);
        send_fd(&sock, mem.export_fd().unwrap().as_fd(), &message);

        // `go`'s record waits behind a gate of this process's device; the child's write waits
        // for `go`, so it has not run until the gate opens.
        let gated = CudaStream::new(engine.context()).unwrap();
        double.gate(&gated, &OPEN);
        go.record(&gated).unwrap();
        send_line(&mut sock, "go 1");
        assert_eq!(read_line(&mut sock), "filled 1");

        // The protocol broken on purpose: a read that does not wait for `filled` reads the bytes
        // from before the child's write.
        let early = CudaStream::new(engine.context()).unwrap();
        let mut stale = vec![1u32; LEN];
        early.memcpy_dtoh(&*mem, &mut stale).unwrap();
        assert!(stale.iter().all(|&x| x == 0), "the child's write ran before its turn");

        // The protocol: the wait binds to the child's record 1, known to have been made.
        stream.wait(&filled).unwrap();
        OPEN.store(true, Ordering::Release);
        let mut got = vec![0u32; LEN];
        stream.memcpy_dtoh(&*mem, &mut got).unwrap();
        assert_eq!(got, pattern(LEN, 7), "the importer's bytes, exact");
        assert!(filled.is_complete().unwrap());
        send_line(&mut sock, "done");
        finish(child, "ipc::child_importer");
        drop(mem);
        double.flush();
    });
}

#[test]
#[ignore = "runs in a child process of exported_bytes_reach_another_process_in_event_order"]
fn child_importer() {
    let Some((_serial, double)) = double::setup("child_importer") else { panic!("no double") };
    let mut sock = connect();
    let mut message = [0u8; 8 + 64 + 64];
    let (fd, got) = recv_fd(&sock, &mut message);
    assert_eq!(got, message.len());
    let len = u64::from_le_bytes(message[..8].try_into().unwrap()) as usize;
    let handle = |at: usize| IpcEventHandle(message[at..at + 64].try_into().unwrap());
    let engine = Engine::new(1).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut imported = ImportedMemory::<u32>::import(&stream, fd, len).unwrap();
    // SAFETY: the exporting process keeps its events until this process reports done.
    let filled = unsafe { IpcEvent::open(engine.context(), &handle(8)) }.unwrap();
    // SAFETY: the exporting process keeps its events until this process reports done.
    let go = unsafe { IpcEvent::open(engine.context(), &handle(72)) }.unwrap();
    assert!(filled.is_opened());
    assert_eq!(read_line(&mut sock), "go 1");
    stream.wait(&go).unwrap();
    stream.memcpy_htod(&pattern(len, 7), &mut imported.as_view_mut()).unwrap();
    filled.record(&stream).unwrap();
    send_line(&mut sock, "filled 1");
    assert_eq!(read_line(&mut sock), "done");
    drop(imported);
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// The exporter (a child) writes, drops its export and exits; the mapping this process made
/// before still holds the bytes (the driver frees the memory when the last mapping goes).
#[test]
fn an_imported_mapping_outlives_its_exporter() {
    with_double("an_imported_mapping_outlives_its_exporter", |double| {
        let (listener, path) = listen("outlives");
        let child = spawn_child("ipc::child_exporter_that_exits", &path, &[]);
        let mut sock = accept(&listener, &path);
        let mut len = [0u8; 8];
        let (fd, _) = recv_fd(&sock, &mut len);
        let len = u64::from_le_bytes(len) as usize;
        let engine = Engine::new(0).unwrap();
        let (live_before, _) = double.live_allocations();
        let handles = double.ipc_handles();
        let imported = ImportedMemory::<u32>::import(engine.default_stream(), fd, len).unwrap();
        assert_eq!(double.ipc_handles(), handles, "the mapping holds the memory, not a handle of the import");
        send_line(&mut sock, "imported");
        finish(child, "ipc::child_exporter_that_exits");
        assert_eq!(engine.dtoh(&*imported).unwrap(), pattern(len, 11), "the exporter is gone, its bytes stay");
        drop(imported);
        assert_eq!(double.live_allocations().0, live_before, "the mapping is released with its import");
    });
}

#[test]
#[ignore = "runs in a child process of an_imported_mapping_outlives_its_exporter"]
fn child_exporter_that_exits() {
    let Some((_serial, double)) = double::setup("child_exporter_that_exits") else { panic!("no double") };
    let mut sock = connect();
    let engine = Engine::new(1).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    stream.memcpy_htod(&pattern(LEN, 11), &mut mem.as_view_mut()).unwrap();
    mem.synchronize().unwrap();
    send_fd(&sock, mem.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
    assert_eq!(read_line(&mut sock), "imported");
    drop(mem);
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// Sizes of zero, larger than the export, descriptors that are no export, memory that has no
/// legacy handle and a legacy handle of this very process: each a typed error naming the value.
#[test]
fn bad_sizes_and_handles_are_typed_errors() {
    with_double("bad_sizes_and_handles_are_typed_errors", |double| {
        let engine = Engine::new(0).unwrap();
        let stream = CudaStream::new(engine.context()).unwrap();
        let (live_before, _) = double.live_allocations();
        assert_eq!(
            ipc_error(ExportedMemory::<u32>::alloc(&stream, 0)),
            IpcError::ZeroSize { what: "ExportedMemory::alloc", len: 0, elem_size: 4 }
        );
        let mem = ExportedMemory::<u32>::alloc(&stream, 1000).unwrap();
        assert_eq!(mem.mapped_bytes(), 64 << 10);
        assert!(matches!(
            ipc_error(ImportedMemory::<u32>::import(&stream, mem.export_fd().unwrap(), 0)),
            IpcError::ZeroSize { len: 0, .. }
        ));
        let fd = mem.export_fd().unwrap();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let err = ipc_error(ImportedMemory::<u32>::import(&stream, fd, 20_000));
        assert_eq!(
            err,
            IpcError::SizeMismatch {
                what: "ImportedMemory::import",
                fd: Some(raw),
                bytes: 80_000,
                mapped: 128 << 10,
                exported: None
            }
        );
        assert!(err.to_string().contains("80000") && err.to_string().contains(&format!("fd {raw}")), "{err}");
        let not_an_export: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&not_an_export);
        match ipc_error(ImportedMemory::<u32>::import(&stream, not_an_export, 10)) {
            IpcError::NotAnExport { fd, .. } => assert_eq!(fd, Some(raw)),
            other => panic!("{other:?}"),
        }
        // The whole export, mapped again in this process: another mapping of the same bytes.
        let again = ImportedMemory::<u32>::import(&stream, mem.export_fd().unwrap(), 16 << 10).unwrap();
        assert_eq!(again.mapped_bytes(), 64 << 10);

        let pooled = engine.alloc::<u32>(10).unwrap();
        assert!(matches!(ipc_error(LegacyIpcHandle::of(&pooled)), IpcError::NotShareable { .. }));
        let plain = engine.alloc_persistent::<u32>(10).unwrap();
        let handle = LegacyIpcHandle::of(&plain).unwrap();
        assert_eq!(format!("{handle:?}"), "LegacyIpcHandle(..)", "a capability is not printed");
        // SAFETY: the allocation is this process's own, alive (`plain`); the driver refuses it.
        match ipc_error(unsafe { LegacyImport::<u32>::open(&stream, &handle, 10) }) {
            IpcError::NotAnExport { fd: None, what, .. } => assert_eq!(what, "LegacyImport::open"),
            other => panic!("{other:?}"),
        }
        drop((mem, again, pooled, plain));
        assert_eq!(double.live_allocations().0, live_before, "nothing refused stays allocated");
    });
}

/// A device without virtual memory management, descriptors or interprocess events (as the
/// double's `PPNRT_DOUBLE_NO_IPC=1` makes it) is refused by name, before any allocation.
#[test]
fn a_device_without_ipc_is_refused_by_name() {
    with_double("a_device_without_ipc_is_refused_by_name", |double| {
        run_child("ipc::child_without_ipc", &double.path, &[("PPNRT_DOUBLE_NO_IPC", "1")]);
    });
}

#[test]
#[ignore = "runs in a child process of a_device_without_ipc_is_refused_by_name"]
fn child_without_ipc() {
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, _double)) = double::setup("child_without_ipc") else { panic!("no double") };
    let engine = Engine::new(0).unwrap();
    let support = ppnrt::IpcSupport::of(engine.device()).unwrap();
    assert!(!support.fd_export() && !support.events);
    let missing = "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED";
    assert_eq!(
        ipc_error(ExportedMemory::<u32>::alloc(engine.default_stream(), 10)),
        IpcError::Unsupported { what: "ExportedMemory::alloc", device: 0, missing }
    );
    assert!(matches!(
        ipc_error(IpcEvent::new(engine.context())),
        IpcError::Unsupported { missing: "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED", .. }
    ));
}

/// The legacy path: another process opens a `cuMemAlloc` allocation from its 64 bytes, reads it
/// exact; a size larger than the allocation is refused naming both, and a second open of the same
/// handle in one context is refused (the driver would hand out the same address twice). An
/// import used after its exporter freed the allocation (undefined behaviour: the import does not
/// keep the memory) is a violation of the double in the importer.
#[test]
fn legacy_handles_open_in_another_process() {
    with_double("legacy_handles_open_in_another_process", |_double| {
        let engine = Engine::new(0).unwrap();
        let slice = engine.alloc_persistent::<u32>(256).unwrap();
        let mut slice = slice;
        engine.htod_into(&pattern(256, 3), &mut slice).unwrap();
        engine.synchronize().unwrap();
        let handle = LegacyIpcHandle::of(&slice).unwrap();
        let (listener, path) = listen("legacy");
        let child = spawn_child("ipc::child_legacy_importer", &path, &[]);
        let mut sock = accept(&listener, &path);
        std::io::Write::write_all(&mut sock, &handle.0).unwrap();
        assert_eq!(read_line(&mut sock), "closed");
        // The exporter keeps its allocation until every importer has closed; here it frees it
        // while the child holds another import, which the child then uses.
        assert_eq!(read_line(&mut sock), "opened");
        drop(slice);
        send_line(&mut sock, "freed");
        finish(child, "ipc::child_legacy_importer");
    });
}

#[test]
#[ignore = "runs in a child process of legacy_handles_open_in_another_process"]
fn child_legacy_importer() {
    let Some((_serial, double)) = double::setup("child_legacy_importer") else { panic!("no double") };
    let mut sock = connect();
    let mut bytes = [0u8; 64];
    std::io::Read::read_exact(&mut sock, &mut bytes).unwrap();
    let handle = LegacyIpcHandle(bytes);
    let engine = Engine::new(1).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    assert_eq!(
        // SAFETY: the exporting process keeps the allocation until this process reports closed.
        ipc_error(unsafe { LegacyImport::<u32>::open(&stream, &handle, 257) }),
        IpcError::SizeMismatch {
            what: "LegacyImport::open",
            fd: None,
            bytes: 1028,
            mapped: 1028,
            exported: Some(1024)
        }
    );
    // SAFETY: the exporting process keeps the allocation until this process reports closed.
    let opened = unsafe { LegacyImport::<u32>::open(&stream, &handle, 256) }.unwrap();
    assert_eq!(engine.dtoh(&*opened).unwrap(), pattern(256, 3));
    assert!(matches!(
        // SAFETY: the exporting process keeps the allocation until this process reports closed.
        ipc_error(unsafe { LegacyImport::<u32>::open(&stream, &handle, 256) }),
        IpcError::NotShareable { .. }
    ));
    // The first opening is untouched by the refused second one.
    assert_eq!(engine.dtoh(&*opened).unwrap(), pattern(256, 3));
    drop(opened);
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
    send_line(&mut sock, "closed");
    // SAFETY: not met on purpose: the exporter frees the allocation while this import
    // lives, and the driver double below counts the use after it as a violation.
    let reopened = unsafe { LegacyImport::<u32>::open(&stream, &handle, 256) }.unwrap();
    send_line(&mut sock, "opened");
    assert_eq!(read_line(&mut sock), "freed");
    let _ = engine.dtoh(&*reopened);
    assert_eq!(double.violations(), 1, "a use after the exporter's free is caught");
    assert!(double.last_violation().contains("exporter freed it"), "{}", double.last_violation());
    drop(reopened);
}

/// A mapping (imported or exported) with uses still queued is released only after them: its
/// drop waits for every use, as a `cuMemAlloc` allocation's free does (the double counts a use of
/// unmapped memory as a violation, which `with_double` checks).
#[test]
fn a_mapping_is_released_after_its_pending_uses() {
    with_double("a_mapping_is_released_after_its_pending_uses", |double| {
        let engine = Engine::new(0).unwrap();
        let (stream, other) = (CudaStream::new(engine.context()).unwrap(), CudaStream::new(engine.context()).unwrap());
        let (live_before, _) = double.live_allocations();
        let handles = double.ipc_handles();
        let mut mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
        let mut imported = ImportedMemory::<u32>::import(&other, mem.export_fd().unwrap(), LEN).unwrap();
        other.memcpy_htod(&pattern(LEN, 5), &mut imported.as_view_mut()).unwrap();
        imported.synchronize().unwrap();
        assert_eq!(engine.dtoh(&*mem).unwrap(), pattern(LEN, 5), "two mappings, one memory");
        other.memcpy_htod(&pattern(LEN, 6), &mut imported.as_view_mut()).unwrap();
        stream.memset_u32(&mut mem.as_view_mut(), 9).unwrap();
        assert!(double.pending() > 0, "the double has run neither use yet");
        let violations = double.violations();
        drop(imported);
        drop(mem);
        assert_eq!(double.violations(), violations, "{}", double.last_violation());
        assert_eq!(double.pending(), 0);
        assert_eq!(double.live_allocations().0, live_before);
        assert_eq!(double.ipc_handles(), handles, "the export's handle is released with it");
    });
}

/// An exported descriptor reaches another process only when passed, never by inheritance across
/// an `exec`: the double hands it out inheritable, as a driver may.
#[test]
fn an_exported_descriptor_is_close_on_exec() {
    with_double("an_exported_descriptor_is_close_on_exec", |_double| {
        let engine = Engine::new(0).unwrap();
        let stream = CudaStream::new(engine.context()).unwrap();
        let mem = ExportedMemory::<u32>::alloc(&stream, 1000).unwrap();
        for _ in 0..2 {
            let fd = mem.export_fd().unwrap();
            let flags = rustix::io::fcntl_getfd(&fd).unwrap();
            assert!(flags.contains(rustix::io::FdFlags::CLOEXEC), "{flags:?}");
        }
    });
}
