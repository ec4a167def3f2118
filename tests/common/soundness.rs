//! Soundness scenarios written against the public API only. `tests/gpu/soundness_on_gpu.rs` runs them on
//! the GPUs present; `tests/double/` runs them through the CUDA driver double on any machine.
//! Each one failed on the code before its fix (see docs/RELIABILITY.md).
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use ppnrt::PpError;
use ppnrt::result::context::{get_current, set_current};
use ppnrt::{
    CaptureMode, CudaError, CudaEvent, CudaSlice, CudaStream, DeviceSlice, Engine, Error, PinnedHostBuffer, PpConfig,
    PpNRt, StreamOverride, TransportPolicy, ambient_stream,
};

/// A pinned host slice handed to `htod` / `htod_into` may be overwritten or freed as soon as the
/// call returns: the device must receive what it held during the call.
pub fn pinned_sources_are_read_before_htod_returns(e: &Engine) {
    let n = 1 << 16;
    let mut pinned = PinnedHostBuffer::<u32>::new(e.context(), n, false).unwrap();
    pinned.as_mut_slice().unwrap().fill(1);
    e.spin(2_000_000).unwrap(); // keeps the stream busy (2 ms on a GPU) so that a late read shows
    let first = e.htod(pinned.as_slice().unwrap()).unwrap();
    pinned.as_mut_slice().unwrap().fill(2);
    let mut second = e.alloc::<u32>(n).unwrap();
    e.spin(2_000_000).unwrap();
    e.htod_into(pinned.as_slice().unwrap(), &mut second).unwrap();
    drop(pinned); // freed right after the call
    let (first, second) = (e.dtoh(&first).unwrap(), e.dtoh(&second).unwrap());
    assert!(first.iter().all(|&v| v == 1), "htod read the pinned source after it returned: {:?}", &first[..4]);
    assert!(second.iter().all(|&v| v == 2), "htod_into read the pinned source after it was freed: {:?}", &second[..4]);
}

/// `copy_with_sms` refuses memory its SMs cannot reach (pool memory of another device) with a
/// typed error, before anything runs: the context stays usable, and reachable memory of a peer
/// works (peer access is enabled by the call).
pub fn copy_with_sms_refuses_memory_its_sms_cannot_reach(e0: &Engine, e1: &Engine) {
    let n = 4096;
    let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let pooled_on_1 = e1.htod(&data).unwrap();
    let mut dst_on_0 = e0.alloc::<u32>(n).unwrap();
    let err = e0.copy_with_sms(&pooled_on_1, &mut dst_on_0).unwrap_err();
    assert!(matches!(err, CudaError::NotPeerReachable { device: 0, memory_device: 1, .. }), "{err}");
    let src_on_0 = e0.htod(&data).unwrap();
    let mut pooled_dst_on_1 = e1.alloc::<u32>(n).unwrap();
    let err = e0.copy_with_sms(&src_on_0, &mut pooled_dst_on_1).unwrap_err();
    assert!(matches!(err, CudaError::NotPeerReachable { device: 0, memory_device: 1, .. }), "{err}");
    e0.synchronize().expect("device 0's context survives a refused copy");
    e1.synchronize().expect("device 1's context survives a refused copy");

    let mut persistent_on_1 = e1.alloc_persistent::<u32>(n).unwrap();
    e1.htod_into(&data, &mut persistent_on_1).unwrap();
    let peers = e0.device().peer_info(e1.device()).unwrap().access_supported
        && e1.device().peer_info(e0.device()).unwrap().access_supported;
    match e0.copy_with_sms(&persistent_on_1, &mut dst_on_0) {
        Ok(()) => {
            assert!(peers, "a copy between devices without peer access must be refused");
            assert_eq!(e0.dtoh(&dst_on_0).unwrap(), data);
        }
        Err(CudaError::PeerAccessUnsupported { .. }) => assert!(!peers),
        Err(e) => panic!("unexpected error {e}"),
    }
    e0.synchronize().unwrap();
}

/// Guards dropped in any order leave the newest live guard's stream ambient, and the engine
/// allocates on it.
pub fn stream_overrides_drop_in_any_order(e: &Engine) {
    let streams: Vec<Arc<CudaStream>> = (0..3).map(|_| CudaStream::new(e.context()).unwrap()).collect();
    let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    for order in orders {
        let mut guards: Vec<Option<StreamOverride>> =
            streams.iter().map(|s| Some(StreamOverride::new(Arc::clone(s)).unwrap())).collect();
        for &dropped in &order {
            guards[dropped] = None;
            let ambient = ambient_stream().unwrap();
            match (0..3).rev().find(|&j| guards[j].is_some()) {
                Some(newest) => {
                    let ambient = ambient.expect("a guard is alive");
                    assert!(Arc::ptr_eq(&ambient, &streams[newest]), "order {order:?}: after dropping {dropped}");
                    let owned = e.alloc::<u32>(4).unwrap();
                    assert!(Arc::ptr_eq(owned.stream(), &streams[newest]), "order {order:?}: alloc owner");
                }
                None => assert!(ambient.is_none(), "order {order:?}: no guard is alive"),
            }
        }
    }
}

/// Every call leaves the thread's current context as it found it (a context of another device,
/// or none).
pub fn calls_leave_the_current_context_as_they_found_it(e0: &Engine, e1: &Engine) {
    for before in [e0.context().raw(), std::ptr::null_mut()] {
        // SAFETY: `before` is e0's live primary context, or null (no context).
        unsafe { set_current(before) }.unwrap();
        let check = |what: &str| assert_eq!(get_current().unwrap(), before, "{what} changed the current context");
        let mut x = e1.htod(&[1u32; 256]).unwrap();
        check("Engine::htod");
        e1.fill_u32(&mut x, 3).unwrap();
        check("Engine::fill_u32");
        assert_eq!(e1.dtoh(&x).unwrap(), vec![3u32; 256]);
        check("Engine::dtoh");
        let event = CudaEvent::new(e1.context(), false).unwrap();
        event.record(e1.default_stream()).unwrap();
        event.synchronize().unwrap();
        check("CudaEvent");
        let stream = CudaStream::new(e1.context()).unwrap();
        let mut y = CudaSlice::<u32>::alloc(&stream, 256).unwrap();
        stream.memcpy_dtod(&x, &mut y).unwrap();
        stream.synchronize().unwrap();
        check("CudaStream");
        // Copies across the devices, on either device's stream, and pinned copies: each finds
        // its addresses with the stream's context, whatever is current.
        let mut z = CudaSlice::<u32>::alloc_persistent(e0.default_stream(), 256).unwrap();
        stream.memcpy_dtod(&y, &mut z).unwrap();
        let mut w = CudaSlice::<u32>::alloc_persistent(&stream, 256).unwrap();
        e0.default_stream().memcpy_dtod(&z, &mut w).unwrap();
        let mut pinned = PinnedHostBuffer::<u32>::new(e1.context(), 256, false).unwrap();
        stream.memcpy_dtoh_pinned(&w, &mut pinned).unwrap();
        assert_eq!(pinned.as_slice().unwrap(), &[3u32; 256][..], "copies with {before:?} current");
        pinned.as_mut_slice().unwrap().fill(9);
        stream.memcpy_htod_pinned(&pinned, &mut y).unwrap();
        e1.fill_u32(&mut w, 1).unwrap(); // a launch on e1's stream
        assert_eq!(e1.dtoh(&y).unwrap(), vec![9u32; 256]);
        assert_eq!(e1.dtoh(&w).unwrap(), vec![1u32; 256]);
        check("copies across devices, pinned copies, a launch");
        drop((x, y, z, w, pinned, event, stream));
        check("drops");
        let rt = PpNRt::new(PpConfig::with_devices(&[1, 0]), e0).unwrap();
        let sent = {
            let _stage = rt.enter(0).unwrap();
            rt.engine(0, e0).unwrap().htod(&[5u32; 64]).unwrap()
        };
        let slot = rt.tx(0, &sent, 64).unwrap();
        let got = rt.rx::<u32>(0, slot, 64).unwrap();
        rt.synchronize().unwrap();
        check("PpNRt tx/rx");
        assert_eq!(e0.dtoh(&got).unwrap(), vec![5u32; 64]);
        drop((got, sent, rt));
        check("PpNRt drop");
    }
}

/// Filled slots whose receiver gave up can be discarded; the ring then goes on, a discarded slot
/// cannot be received, and growing its buffer waits for the copy that filled it.
pub fn discarded_slots_are_free_again(primary: &Engine, devices: &[i32]) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(1), primary).unwrap();
    let e0 = rt.engine(0, primary).unwrap().clone();
    let _stage = rt.enter(0).unwrap();
    let small = e0.htod(&[7u32; 1024]).unwrap();
    let slot = rt.tx(0, &small, 1024).unwrap();
    assert!(matches!(rt.tx(0, &small, 1024), Err(Error::Pipeline(PpError::SlotState { .. }))), "the ring is full");
    assert_eq!(rt.discard_unreceived(0).unwrap(), 1);
    assert_eq!(rt.discard_unreceived(0).unwrap(), 0);
    let err = rt.rx::<u32>(0, slot, 1024).unwrap_err();
    assert!(err.to_string().contains("discarded"), "{err}");
    let big_n = 1 << 18;
    let big_data: Vec<u32> = (0..big_n as u32).collect();
    let big = e0.htod(&big_data).unwrap();
    let slot = rt.tx(0, &big, big_n).unwrap();
    let got = rt.rx::<u32>(0, slot, big_n).unwrap();
    assert_eq!(e0.dtoh(&got).unwrap(), big_data);
    rt.synchronize().unwrap();
}

/// Two consumers on two streams read a received slot by other means (a raw-address checksum, as
/// another library's kernel would), each ordered with `order_on`; the first is held back 2 ms.
/// Both must read the step's data: the next `tx` (the slot itself is lent) or the reuse of the
/// copy's memory (host-staged: the guard holds a copy, freed when it drops) waits for both.
pub fn order_on_orders_every_consumer(primary: &Engine, devices: &[i32], transport: TransportPolicy) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(1).with_transport(transport), primary).unwrap();
    let (e0, e1) = (rt.engine(0, primary).unwrap().clone(), rt.engine(1, primary).unwrap().clone());
    let n = 1 << 16;
    let send = |seed: u32| {
        let _stage = rt.enter(0).unwrap();
        let mut x = e0.alloc::<u32>(n).unwrap();
        e0.fill_pattern(&mut x, seed).unwrap();
        rt.tx(0, &x, n).unwrap()
    };
    let checksum = e1.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_checksum_u32").unwrap();
    let consumers = [e1.stream().unwrap(), rt.stage_stream(1).unwrap().clone()];
    let slot = send(3);
    let mut sums: Vec<CudaSlice<u64>> = consumers
        .iter()
        .map(|stream| {
            let mut sum = CudaSlice::<u64>::alloc(stream, 1).unwrap();
            stream.memset_bytes(&mut sum, 0).unwrap();
            sum
        })
        .collect();
    {
        let mut received = rt.rx_in_place::<u32>(0, slot, n).unwrap();
        let address = received.view().unwrap().device_ptr();
        for (at, (stream, sum)) in consumers.iter().zip(&mut sums).enumerate() {
            received.order_on(stream).unwrap();
            if at == 0 {
                let _on = StreamOverride::new(Arc::clone(stream)).unwrap();
                e1.spin(2_000_000).unwrap();
            }
            // SAFETY: ppnrt_checksum_u32(const uint32_t*, uint64_t, unsigned long long*) reads n
            // words at `address` (the lent slot or the guard's copy, alive while `received` is,
            // and ordered by `order_on`) into sum[0].
            unsafe { stream.launch(&checksum, ppnrt::LaunchConfig::for_elements(n, 4), (address, n as u64, sum)) }
                .unwrap();
        }
    }
    // What would overwrite the data under a consumer not waited for: the next step into the
    // slot, and new memory of the receiving stage (where a freed copy's block goes first).
    send(4);
    let reuse = {
        let _stage = rt.enter(1).unwrap();
        let mut reuse = e1.alloc::<u32>(n).unwrap();
        e1.fill_pattern(&mut reuse, 5).unwrap();
        reuse
    };
    rt.stage_stream(0).unwrap().synchronize().unwrap();
    // Then the receiving stage's stream: consumer 0's stream runs last.
    rt.stage_stream(1).unwrap().synchronize().unwrap();
    let expected = ppnrt::kernels::checksum(&(0..n as u64).map(|i| ppnrt::kernels::pattern(3, i)).collect::<Vec<_>>());
    for (at, sum) in sums.iter().enumerate() {
        assert_eq!(e1.dtoh(sum).unwrap()[0], expected, "{devices:?} {transport:?}: consumer {at} read other data");
    }
    drop(reuse);
}

/// While stream `a` is being captured, work on another stream `b` that needs a buffer last
/// written on `a` before the capture began runs at once, after that write, and stays out of the
/// capture: an eager copy on `b`, and a host wait from another thread. The capture ends holding
/// its own work only. (The buffer's write had no event yet: one recorded on `a` now would land in
/// the capture, and `b` waiting for it would join the capture, its copy captured instead of run.)
pub fn work_beside_a_capture_waits_for_the_writes_before_it(e: &Engine) {
    let n = 1 << 16;
    let a = CudaStream::new(e.context()).unwrap();
    let b = CudaStream::new(e.context()).unwrap();
    let mut x = CudaSlice::<u32>::alloc(&a, n).unwrap();
    let mut z = CudaSlice::<u32>::alloc(&a, n).unwrap();
    let mut y = CudaSlice::<u32>::alloc(&b, n).unwrap();
    let mut scratch = CudaSlice::<u32>::alloc(&a, 16).unwrap();
    {
        // A long write on `a`: the copy on `b` and the host wait must wait for it.
        let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
        e.spin(2_000_000).unwrap();
        a.memset_u32(&mut x, 7).unwrap();
        a.memset_u32(&mut z, 9).unwrap();
    }
    let capture = a.begin_capture(CaptureMode::ThreadLocal).unwrap();
    a.memset_u32(&mut scratch, 1).unwrap();
    b.memcpy_dtod(&x, &mut y).expect("a copy on another stream during the capture");
    std::thread::scope(|s| {
        s.spawn(|| z.synchronize().expect("a host wait from another thread during the capture")).join().unwrap();
    });
    let graph = capture.end().expect("the capture ends with its own work only");
    assert_eq!(graph.node_count(), 1, "the capture took in work of another stream");
    let mut host = vec![0u32; n];
    b.memcpy_dtoh(&y, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 7), "the copy on b did not run after x's write: {:?}", &host[..4]);
    let mut host = vec![0u32; n];
    a.memcpy_dtoh(&z, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 9));
    // The stream captured is usable again, and so is the graph.
    let mut exec = graph.instantiate().unwrap();
    exec.launch(&a).unwrap();
    let mut host = vec![0u32; 16];
    a.memcpy_dtoh(&scratch, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 1));
}

/// One thread begins and ends captures of stream `s` while another keeps writing a buffer on `s`
/// and copying it on a second stream: each write lands either outside every capture (and runs,
/// ordered for the copies) or inside one, and then that graph holds the buffer; never in a capture
/// unbeknown to the crate (a graph node on memory the graph does not hold). The copies' waits for
/// the writes never join a capture either.
pub fn work_racing_a_capture_lands_inside_it_or_outside_it(e: &Engine, captures: usize) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let n = 1 << 10;
    let s = CudaStream::new(e.context()).unwrap();
    let b = CudaStream::new(e.context()).unwrap();
    let mut x = CudaSlice::<u32>::alloc(&s, n).unwrap();
    let mut y = CudaSlice::<u32>::alloc(&b, n).unwrap();
    // Initialised before any capture: a write the first capture takes in leaves x as it was.
    s.memset_u32(&mut x, 0).unwrap();
    b.memset_u32(&mut y, 0).unwrap();
    let stop = AtomicBool::new(false);
    let (mut with_nodes, mut writes) = (0usize, 0u32);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut value = 0u32;
            while !stop.load(Ordering::Relaxed) {
                value += 1;
                s.memset_u32(&mut x, value).expect("a write on a stream another thread captures");
                b.memcpy_dtod(&x, &mut y).expect("a copy on another stream of what that write wrote");
            }
            value
        });
        for _ in 0..captures {
            let capture = s.begin_capture(CaptureMode::ThreadLocal).expect("begin");
            for _ in 0..200 {
                std::hint::spin_loop();
            }
            let graph = capture.end().expect("the capture holds only work it knows of");
            assert_eq!(
                graph.node_count() > 0,
                graph.footprint_len() > 0,
                "a graph of {} node(s) holding {} buffer(s): work landed in the capture unbeknown to the crate",
                graph.node_count(),
                graph.footprint_len()
            );
            with_nodes += usize::from(graph.node_count() > 0);
        }
        stop.store(true, Ordering::Relaxed);
        writes = writer.join().unwrap();
    });
    // Both streams are usable, and ordered, afterwards.
    s.memset_u32(&mut x, u32::MAX).unwrap();
    b.memcpy_dtod(&x, &mut y).unwrap();
    let mut host = vec![0u32; n];
    b.memcpy_dtoh(&y, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == u32::MAX), "the last copy did not see the last write: {:?}", &host[..4]);
    println!(
        "work_racing_a_capture_lands_inside_it_or_outside_it: {captures} captures, {with_nodes} took in some of the \
         {writes} writes of the other thread"
    );
}
