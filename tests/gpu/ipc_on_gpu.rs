//! Memory and events shared between two processes on the GPUs present (the double tier's `ipc`
//! scenarios through the real driver): the exporter's bytes reach a child process that imports
//! them from a POSIX descriptor passed over a Unix socket, the two processes' streams are
//! ordered by interprocess events, an import outlives its exporter's process, and a probe says
//! what a stream capture takes of an interprocess wait, a copy into an import and a record (the
//! driver does not document it; the probe prints what it found). Stream memory operations on an
//! exported flag order the two processes too, and a wait on a flag whose exporter's process died
//! is released by the waiting process itself; a probe says whether a capture takes them. The
//! importer runs on device 1 where it is a peer of device 0, else on device 0 beside its
//! exporter.

use std::os::fd::AsFd;

use crate::common::needs::{Needs, requires};
use crate::common::{say, under_sanitizer};
use crate::ipc_fd::{accept, connect, finish, listen, read_line, recv_fd, send_fd, send_line, spawn_child};
use ppnrt::{
    CaptureMode, CudaStream, Engine, ExportedMemory, ImportedMemory, IpcEvent, IpcEventHandle, IpcSupport,
    LegacyImport, LegacyIpcHandle, MemOpsSupport, WaitCondition,
};

const CHILD_VAR: &str = "PPNRT_IPC_GPU_CHILD";
const DEVICE_VAR: &str = "PPNRT_IPC_GPU_DEVICE";
/// 32 KiB of `u32`.
const LEN: usize = 8 << 10;

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// Device 1 where it is a peer of device 0 (the importer maps device 0's memory), else device 0.
fn other_device(count: i32) -> &'static str {
    let peer = count > 1
        && ppnrt::Device::get(1)
            .and_then(|one| ppnrt::Device::get(0)?.peer_info(&one))
            .is_ok_and(|info| info.access_supported);
    if peer { "1" } else { "0" }
}

fn child_engine() -> Engine {
    assert!(std::env::var_os(CHILD_VAR).is_some(), "run through the parent test");
    let device = std::env::var(DEVICE_VAR).map_or(0, |d| d.parse().unwrap());
    Engine::new(device).unwrap()
}

#[test]
fn memory_and_events_cross_processes_on_a_gpu() {
    let Some(gpus) = requires("memory_and_events_cross_processes_on_a_gpu", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    let support = IpcSupport::of(engine.device()).unwrap();
    if !support.fd_export() || !support.events {
        say(&format!("memory_and_events_cross_processes_on_a_gpu: device 0 offers {support:?}: nothing to cross"));
        return;
    }
    let importer = other_device(gpus.count());
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    stream.memset_u32(&mut mem.as_view_mut(), 0).unwrap();
    let filled = IpcEvent::new(engine.context()).unwrap();
    let go = IpcEvent::new(engine.context()).unwrap();
    let (listener, path) = listen("gpu-order");
    let child = spawn_child("ipc_on_gpu::child_importer_on_gpu", &path, &[(CHILD_VAR, "1"), (DEVICE_VAR, importer)]);
    let mut sock = accept(&listener, &path);
    let mut message = (LEN as u64).to_le_bytes().to_vec();
    message.extend_from_slice(&filled.handle().unwrap().0);
    message.extend_from_slice(&go.handle().unwrap().0);
    send_fd(&sock, mem.export_fd().unwrap().as_fd(), &message);
    // `go` is recorded behind 300 ms of device work: the child's write, which waits for it,
    // comes late, and only the wait on `filled` makes this process read it.
    engine.spin(300_000_000).unwrap();
    go.record(engine.default_stream()).unwrap();
    send_line(&mut sock, "go 1");
    assert_eq!(read_line(&mut sock), "filled 1");
    stream.wait(&filled).unwrap();
    let mut got = vec![0u32; LEN];
    stream.memcpy_dtoh(&*mem, &mut got).unwrap();
    assert_eq!(got, pattern(LEN, 7), "the importer's bytes, exact, after its event");
    send_line(&mut sock, "done");
    finish(child, "ipc_on_gpu::child_importer_on_gpu");
}

#[test]
#[ignore = "runs in a child process of memory_and_events_cross_processes_on_a_gpu"]
fn child_importer_on_gpu() {
    let engine = child_engine();
    let mut sock = connect();
    let mut message = [0u8; 8 + 64 + 64];
    let (fd, _) = recv_fd(&sock, &mut message);
    let len = u64::from_le_bytes(message[..8].try_into().unwrap()) as usize;
    let handle = |at: usize| IpcEventHandle(message[at..at + 64].try_into().unwrap());
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut imported = ImportedMemory::<u32>::import(&stream, fd, len).unwrap();
    // SAFETY: the exporting process keeps its events until this process reports done.
    let filled = unsafe { IpcEvent::open(engine.context(), &handle(8)) }.unwrap();
    // SAFETY: the exporting process keeps its events until this process reports done.
    let go = unsafe { IpcEvent::open(engine.context(), &handle(72)) }.unwrap();
    assert_eq!(read_line(&mut sock), "go 1");
    stream.wait(&go).unwrap();
    stream.memcpy_htod(&pattern(len, 7), &mut imported.as_view_mut()).unwrap();
    filled.record(&stream).unwrap();
    send_line(&mut sock, "filled 1");
    assert_eq!(read_line(&mut sock), "done");
}

#[test]
fn an_import_outlives_its_exporters_process_on_a_gpu() {
    let Some(gpus) = requires("an_import_outlives_its_exporters_process_on_a_gpu", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    if !IpcSupport::of(engine.device()).unwrap().fd_export() {
        say("an_import_outlives_its_exporters_process_on_a_gpu: device 0 cannot export descriptors");
        return;
    }
    let exporter = other_device(gpus.count());
    let (listener, path) = listen("gpu-outlives");
    let child = spawn_child("ipc_on_gpu::child_exporter_on_gpu", &path, &[(CHILD_VAR, "1"), (DEVICE_VAR, exporter)]);
    let mut sock = accept(&listener, &path);
    let mut len = [0u8; 8];
    let (fd, _) = recv_fd(&sock, &mut len);
    let len = u64::from_le_bytes(len) as usize;
    let imported = ImportedMemory::<u32>::import(engine.default_stream(), fd, len).unwrap();
    send_line(&mut sock, "imported");
    finish(child, "ipc_on_gpu::child_exporter_on_gpu");
    assert_eq!(engine.dtoh(&*imported).unwrap(), pattern(len, 11), "the exporter's process is gone, its bytes stay");
}

#[test]
#[ignore = "runs in a child process of an_import_outlives_its_exporters_process_on_a_gpu"]
fn child_exporter_on_gpu() {
    let engine = child_engine();
    let mut sock = connect();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    stream.memcpy_htod(&pattern(LEN, 11), &mut mem.as_view_mut()).unwrap();
    mem.synchronize().unwrap();
    send_fd(&sock, mem.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
    assert_eq!(read_line(&mut sock), "imported");
    drop(mem);
}

/// The legacy path on the device: another process opens a `cuMemAlloc` allocation from its 64
/// bytes and reads it exact, while the exporter keeps it.
#[test]
fn a_legacy_handle_opens_in_another_process_on_a_gpu() {
    let Some(gpus) = requires("a_legacy_handle_opens_in_another_process_on_a_gpu", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    let mut slice = engine.alloc_persistent::<u32>(LEN).unwrap();
    engine.htod_into(&pattern(LEN, 31), &mut slice).unwrap();
    engine.synchronize().unwrap();
    let handle = LegacyIpcHandle::of(&slice).unwrap();
    let (listener, path) = listen("gpu-legacy");
    let importer = other_device(gpus.count());
    let child =
        spawn_child("ipc_on_gpu::child_legacy_importer_on_gpu", &path, &[(CHILD_VAR, "1"), (DEVICE_VAR, importer)]);
    let mut sock = accept(&listener, &path);
    std::io::Write::write_all(&mut sock, &handle.0).unwrap();
    assert_eq!(read_line(&mut sock), "closed");
    finish(child, "ipc_on_gpu::child_legacy_importer_on_gpu");
    drop(slice);
}

#[test]
#[ignore = "runs in a child process of a_legacy_handle_opens_in_another_process_on_a_gpu"]
fn child_legacy_importer_on_gpu() {
    let engine = child_engine();
    let mut sock = connect();
    let mut bytes = [0u8; 64];
    std::io::Read::read_exact(&mut sock, &mut bytes).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    // SAFETY: the exporting process keeps the allocation until this process reports closed.
    let opened = unsafe { LegacyImport::<u32>::open(&stream, &LegacyIpcHandle(bytes), LEN) }.unwrap();
    assert_eq!(engine.dtoh(&*opened).unwrap(), pattern(LEN, 31));
    drop(opened);
    send_line(&mut sock, "closed");
}

/// What a capture takes: a wait node on an interprocess event, a copy into an imported mapping,
/// a record node of an interprocess event, and the graph's launch. Printed, not asserted (each
/// refusal must still be a typed error, and a graph that launches must deliver the bytes).
#[test]
fn a_capture_of_interprocess_work_is_probed() {
    let Some(gpus) = requires("a_capture_of_interprocess_work_is_probed", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    let support = IpcSupport::of(engine.device()).unwrap();
    if !support.fd_export() || !support.events {
        say("a_capture_of_interprocess_work_is_probed: device 0 lacks descriptor export or IPC events");
        return;
    }
    let stream = CudaStream::new(engine.context()).unwrap();
    let mem = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    let mut imported = ImportedMemory::<u32>::import(&stream, mem.export_fd().unwrap(), LEN).unwrap();
    let src = engine.htod(&pattern(LEN, 21)).unwrap();
    let (before, after) = (IpcEvent::new(engine.context()).unwrap(), IpcEvent::new(engine.context()).unwrap());
    before.record(&stream).unwrap();
    let capture = stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let waited = capture.wait_external(&before);
    let copied = stream.memcpy_dtod(&src, &mut imported.as_view_mut());
    let recorded = capture.record_external(&after);
    let graph = capture.end();
    say(&format!(
        "IPC capture probe: wait node {waited:?}, copy into an import {copied:?}, record node {recorded:?}, end {:?}",
        graph.as_ref().map(|_| "a graph")
    ));
    if let Ok(graph) = graph {
        let launched = graph.instantiate().and_then(|mut exec| {
            exec.launch(&stream)?;
            stream.synchronize()
        });
        say(&format!("IPC capture probe: launch {launched:?}"));
        if launched.is_ok() && copied.is_ok() {
            assert_eq!(engine.dtoh(&*mem).unwrap(), pattern(LEN, 21), "the graph's copy lands in the export");
            assert!(after.is_complete().unwrap());
        }
    }
}

/// Stream memory operations order two processes on the device: the child (the sender, on the
/// peer device where there is one) copies into this process's exported buffer behind 300 ms of
/// device work and then writes "filled" = 1 into an exported flag; this process's stream waits
/// for it (GEQ) and reads the bytes exact, then writes "consumed" = 1, which the child waits for.
#[test]
fn a_flag_word_orders_two_processes_on_a_gpu() {
    let Some(gpus) = requires("a_flag_word_orders_two_processes_on_a_gpu", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    let support = MemOpsSupport::of(engine.device()).unwrap();
    if !IpcSupport::of(engine.device()).unwrap().fd_export() || !support.ops_64 {
        say(&format!("a_flag_word_orders_two_processes_on_a_gpu: device 0 offers {support:?}: nothing to order"));
        return;
    }
    let sender = other_device(gpus.count());
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut data = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    let mut flags = ExportedMemory::<u64>::alloc(&stream, 2).unwrap();
    stream.memset_u32(&mut data.as_view_mut(), 0).unwrap();
    stream.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
    stream.synchronize().unwrap();
    let (listener, path) = listen("gpu-memops");
    let child = spawn_child("ipc_on_gpu::child_flag_sender_on_gpu", &path, &[(CHILD_VAR, "1"), (DEVICE_VAR, sender)]);
    let mut sock = accept(&listener, &path);
    send_fd(&sock, data.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
    send_fd(&sock, flags.export_fd().unwrap().as_fd(), &2u64.to_le_bytes());
    assert_eq!(read_line(&mut sock), "queued");
    stream.wait_value_u64(&*flags, 0, 1, WaitCondition::GEQ).unwrap();
    let mut got = vec![0u32; LEN];
    stream.memcpy_dtoh(&*data, &mut got).unwrap();
    assert_eq!(got, pattern(LEN, 41), "the sender's bytes, exact, after its flag");
    stream.write_value_u64(&mut flags.as_view_mut(), 1, 1).unwrap();
    assert_eq!(read_line(&mut sock), "consumed");
    finish(child, "ipc_on_gpu::child_flag_sender_on_gpu");
    assert_eq!(engine.dtoh(&*flags).unwrap(), [1, 1]);
}

#[test]
#[ignore = "runs in a child process of a_flag_word_orders_two_processes_on_a_gpu"]
fn child_flag_sender_on_gpu() {
    let engine = child_engine();
    let sock = connect();
    let mut len = [0u8; 8];
    let (data_fd, _) = recv_fd(&sock, &mut len);
    let data_len = u64::from_le_bytes(len) as usize;
    let (flags_fd, _) = recv_fd(&sock, &mut len);
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut data = ImportedMemory::<u32>::import(&stream, data_fd, data_len).unwrap();
    let mut flags = ImportedMemory::<u64>::import(&stream, flags_fd, u64::from_le_bytes(len) as usize).unwrap();
    let src = engine.htod(&pattern(data_len, 41)).unwrap();
    engine.synchronize().unwrap();
    // The copy and the flag come after 300 ms of device work on the copying stream.
    {
        let _on = ppnrt::StreamOverride::new(stream.clone()).unwrap();
        engine.spin(300_000_000).unwrap();
    }
    stream.memcpy_dtod(&src, &mut data.as_view_mut()).unwrap();
    stream.write_value_u64(&mut flags.as_view_mut(), 0, 1).unwrap();
    stream.wait_value_u64(&*flags, 1, 1, WaitCondition::GEQ).unwrap();
    let mut sock = sock;
    send_line(&mut sock, "queued");
    stream.synchronize().unwrap();
    send_line(&mut sock, "consumed");
}

/// The exporter's process exits while this process's stream waits on the exporter's flag: this
/// process releases the wait with a write-value from another stream; the stream's reads after
/// the wait are of the mapping, which stays valid (compute-sanitizer's memcheck says so where it
/// runs), and nothing hangs.
#[test]
fn a_wait_on_a_dead_exporter_is_released_on_a_gpu() {
    let Some(gpus) = requires("a_wait_on_a_dead_exporter_is_released_on_a_gpu", Needs::gpus(1)) else { return };
    if under_sanitizer() {
        // The tool runs the streams' work one after another: the release, on a second stream,
        // would wait behind the wait it releases.
        say(
            "SKIPPED a_wait_on_a_dead_exporter_is_released_on_a_gpu: under compute-sanitizer, which serialises streams",
        );
        return;
    }
    let engine = gpus.engine(0);
    let support = MemOpsSupport::of(engine.device()).unwrap();
    if !IpcSupport::of(engine.device()).unwrap().fd_export() || !support.ops_64 {
        say(&format!("a_wait_on_a_dead_exporter_is_released_on_a_gpu: device 0 offers {support:?}"));
        return;
    }
    let exporter = other_device(gpus.count());
    let (listener, path) = listen("gpu-memops-dead");
    let child =
        spawn_child("ipc_on_gpu::child_flag_exporter_on_gpu", &path, &[(CHILD_VAR, "1"), (DEVICE_VAR, exporter)]);
    let mut sock = accept(&listener, &path);
    let mut len = [0u8; 8];
    let (data_fd, _) = recv_fd(&sock, &mut len);
    let data_len = u64::from_le_bytes(len) as usize;
    let (flags_fd, _) = recv_fd(&sock, &mut len);
    let waiting = CudaStream::new(engine.context()).unwrap();
    let data = ImportedMemory::<u32>::import(&waiting, data_fd, data_len).unwrap();
    let mut flags = ImportedMemory::<u64>::import(&waiting, flags_fd, u64::from_le_bytes(len) as usize).unwrap();
    let mut received = engine.alloc::<u32>(data_len).unwrap();
    waiting.wait_value_u64(&*flags, 0, 1, WaitCondition::GEQ).unwrap();
    waiting.memcpy_dtod(&*data, &mut received).unwrap();
    send_line(&mut sock, "waiting");
    finish(child, "ipc_on_gpu::child_flag_exporter_on_gpu");
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!waiting.is_idle().unwrap(), "the wait held its stream");
    let releasing = CudaStream::new(engine.context()).unwrap();
    releasing.write_value_u64(&mut flags.as_view_mut(), 0, 1).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !waiting.is_idle().unwrap() {
        if std::time::Instant::now() > deadline {
            std::mem::forget((data, flags, received, waiting, releasing));
            panic!("the write-value from another stream did not release the wait");
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(engine.dtoh(&received).unwrap(), pattern(data_len, 51), "the dead exporter's bytes stay");
    drop((data, flags));
}

#[test]
#[ignore = "runs in a child process of a_wait_on_a_dead_exporter_is_released_on_a_gpu"]
fn child_flag_exporter_on_gpu() {
    let engine = child_engine();
    let mut sock = connect();
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut data = ExportedMemory::<u32>::alloc(&stream, LEN).unwrap();
    let mut flags = ExportedMemory::<u64>::alloc(&stream, 1).unwrap();
    stream.memcpy_htod(&pattern(LEN, 51), &mut data.as_view_mut()).unwrap();
    stream.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
    stream.synchronize().unwrap();
    send_fd(&sock, data.export_fd().unwrap().as_fd(), &(LEN as u64).to_le_bytes());
    send_fd(&sock, flags.export_fd().unwrap().as_fd(), &1u64.to_le_bytes());
    assert_eq!(read_line(&mut sock), "waiting");
    drop((data, flags));
}

/// What a capture takes of a wait-value and a write-value (the crate refuses both on a
/// capturing stream until a GPU says): captured through the raw driver on an exported flag,
/// launched, and the flag read back. Printed, not asserted.
#[test]
fn a_capture_of_memops_is_probed() {
    use ppnrt::DeviceSlice;
    use ppnrt::sys::{CUgraph, CUgraphExec, CUresult, CUstreamCaptureMode};
    let Some(gpus) = requires("a_capture_of_memops_is_probed", Needs::gpus(1)) else { return };
    let engine = gpus.engine(0);
    let support = MemOpsSupport::of(engine.device()).unwrap();
    if !IpcSupport::of(engine.device()).unwrap().fd_export() || !support.ops_64 {
        say(&format!("a_capture_of_memops_is_probed: device 0 offers {support:?}"));
        return;
    }
    let stream = CudaStream::new(engine.context()).unwrap();
    let mut flags = ExportedMemory::<u64>::alloc(&stream, 2).unwrap();
    stream.memset_bytes(&mut flags.as_view_mut(), 0).unwrap();
    stream.write_value_u64(&mut flags.as_view_mut(), 0, 3).unwrap();
    stream.synchronize().unwrap();
    let refused = stream.begin_capture(CaptureMode::ThreadLocal).map(|capture| {
        let wait = stream.wait_value_u64(&*flags, 0, 1, WaitCondition::GEQ);
        drop(capture.end());
        wait
    });
    say(&format!("memops capture probe: the crate's wait-value in a capture: {refused:?}"));
    let api = crate::raw_driver::api();
    let _bound = engine.context().bind().unwrap();
    let (raw_stream, word) = (stream.raw(), flags.device_ptr());
    let call = |name: &str, code: CUresult| {
        say(&format!("memops capture probe: {name}: {code:?}"));
        code == CUresult::CUDA_SUCCESS
    };
    // SAFETY: a live stream of the bound context; the flags stay alive (`flags`) and the stream
    // is synchronised before they drop.
    unsafe {
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if !call("begin", api.cuStreamBeginCapture_v2.as_ref().unwrap()(raw_stream, mode)) {
            return;
        }
        let waited = call("wait-value", api.cuStreamWaitValue64_v2.as_ref().unwrap()(raw_stream, word, 3, 0));
        let wrote = call("write-value", api.cuStreamWriteValue64_v2.as_ref().unwrap()(raw_stream, word + 8, 9, 0));
        let mut graph: CUgraph = std::ptr::null_mut();
        let ended = call("end", api.cuStreamEndCapture.as_ref().unwrap()(raw_stream, &mut graph));
        if !(ended && waited && wrote) {
            if !graph.is_null() {
                api.cuGraphDestroy.as_ref().unwrap()(graph);
            }
            return;
        }
        let mut exec: CUgraphExec = std::ptr::null_mut();
        if call("instantiate", api.cuGraphInstantiateWithFlags.as_ref().unwrap()(&mut exec, graph, 0)) {
            let launched = call("launch", api.cuGraphLaunch.as_ref().unwrap()(exec, raw_stream));
            call("synchronize", api.cuStreamSynchronize.as_ref().unwrap()(raw_stream));
            if launched {
                drop(_bound);
                assert_eq!(engine.dtoh(&*flags).unwrap(), [3, 9], "the graph's write-value lands");
                say("memops capture probe: a graph holds a wait-value and a write-value");
            }
            api.cuGraphExecDestroy.as_ref().unwrap()(exec);
        }
        api.cuGraphDestroy.as_ref().unwrap()(graph);
    }
}
