//! The ordering rule against any program: random sequences of the safe layer's operations (kernel
//! writes, copies within and across devices, the SM copy kernel, pageable and pinned host copies,
//! host reads and writes of a pinned buffer, frees and fresh allocations, graphs captured from
//! these and launched on any stream of their device) on five streams of two devices, with no join
//! anywhere. Through the double, queued work runs as late as anything lets it, so every operation
//! the rule failed to order shows up as a value that differs from what the program, run one
//! operation after the other, holds, or as an access to freed memory.

use super::*;
use ppnrt::KernelArgList;
use proptest::prelude::*;

/// Elements of every buffer (all alike: a buffer holds one value).
const LEN: usize = 64;
/// Streams: device 0's default stream and two of its own, device 1's default stream and one.
const STREAM_DEVICES: [usize; 5] = [0, 0, 0, 1, 1];
/// Device buffers: on device 0 pool memory and `cuMemAlloc` memory, the same on device 1.
const BUFFERS: [(usize, bool); 4] = [(0, false), (0, true), (1, false), (1, true)];

/// One operation of a program. Stream and buffer fields are indices, reduced modulo what they
/// index; a stream that must be of a buffer's device is taken among that device's streams.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// A kernel sets every element of buffer `b` to `value`, on a stream of its device.
    Fill { s: usize, b: usize, value: u32 },
    /// `memcpy_dtod` from buffer `src` into buffer `dst` on any stream.
    Copy { s: usize, src: usize, dst: usize },
    /// The SM copy kernel (`Engine::copy_with_sms`) from `src` into `dst` on a stream of `dst`'s
    /// device (refused, with nothing changed, for pool memory of the other device).
    SmCopy { s: usize, src: usize, dst: usize },
    /// The helper copy kernel launched with a `KernelArgList` from `src` into `dst`, on a stream
    /// of `dst`'s device, its slices passed as `form` says: 0 `&mut` slice and `&` slice, 1 views
    /// by value and the length as a caller's parameter (made at the launch), 2 `&mut` and `&`
    /// views, 3 the source through a caller's parameter that hands the kernel its memory (made at
    /// the launch); refused, with nothing changed, for pool memory of the other device.
    ListCopy { s: usize, src: usize, dst: usize, form: usize },
    /// `memcpy_htod` of `value`s into buffer `b` on a stream of its device.
    Write { s: usize, b: usize, value: u32 },
    /// `memcpy_dtoh` of buffer `b` on a stream of its device: the values must be the program's.
    Read { s: usize, b: usize },
    /// `memcpy_dtoh_pinned` of buffer `b` into the pinned buffer, on a stream of its device.
    ToPinned { s: usize, b: usize },
    /// `memcpy_htod_pinned` of the pinned buffer into buffer `b`, on a stream of its device.
    FromPinned { s: usize, b: usize },
    /// The host reads the pinned buffer (`as_slice`): the values must be the program's.
    HostRead,
    /// The host writes `value`s into the pinned buffer (`as_mut_slice`).
    HostWrite { value: u32 },
    /// Buffer `b` is dropped and made anew (same device and kind), owned by a stream of its
    /// device, then written with `value` there. A graph that holds the old buffer keeps it.
    Renew { s: usize, b: usize, value: u32 },
    /// A capture of a stream of device `device` records `ops` (kernel writes, copies and SM
    /// copies on that stream) into a graph, which is instantiated and kept (the oldest of
    /// [`GRAPHS`] dropped); nothing runs yet.
    Capture { device: usize, s: usize, ops: Vec<Captured> },
    /// Graph `g` (of those kept, if any) launched on a stream of its device.
    Launch { g: usize, s: usize },
}

/// An operation a capture records.
#[derive(Clone, Debug)]
pub(crate) enum Captured {
    /// A kernel sets buffer `b` (taken among the capture's device's buffers) to `value`.
    Fill { b: usize, value: u32 },
    /// `memcpy_dtod` from `src` into `dst`, neither pool memory of the other device.
    Copy { src: usize, dst: usize },
    /// The SM copy kernel from `src` into `dst` (taken among the capture's device's buffers).
    SmCopy { src: usize, dst: usize },
}

/// A caller's kernel parameter (its code runs at the launch): a length.
struct Length(u64);

impl ppnrt::KernelParam for Length {
    type Raw = u64;
    fn raw_param(&self) -> u64 {
        self.0
    }
}

/// A caller's kernel parameter that passes a slice, handing the kernel its memory (read).
struct Forwarded<'s>(&'s CudaSlice<u32>);

impl ppnrt::KernelParam for Forwarded<'_> {
    type Raw = u64;
    fn raw_param(&self) -> u64 {
        self.0.device_ptr()
    }
    fn buffer_use(&self) -> Option<ppnrt::BufferUse<'_>> {
        ppnrt::KernelParam::buffer_use(self.0)
    }
}

/// Graphs kept at a time.
const GRAPHS: usize = 3;

/// A captured operation as the model runs it at a launch: on allocations, not buffer slots (a
/// graph holds what it captured, also after the slot got a fresh buffer).
#[derive(Clone, Copy, Debug)]
enum Recorded {
    Fill { id: usize, value: u32 },
    Copy { src: usize, dst: usize },
}

fn captured() -> impl Strategy<Value = Captured> {
    let b = 0usize..4;
    prop_oneof![
        (b.clone(), 1u32..1000).prop_map(|(b, value)| Captured::Fill { b, value }),
        (b.clone(), b.clone()).prop_map(|(src, dst)| Captured::Copy { src, dst }),
        (b.clone(), b).prop_map(|(src, dst)| Captured::SmCopy { src, dst }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let s = 0usize..5;
    let b = 0usize..4;
    prop_oneof![
        (0usize..2, s.clone(), proptest::collection::vec(captured(), 1..5)).prop_map(|(device, s, ops)| Op::Capture {
            device,
            s,
            ops
        }),
        (0usize..GRAPHS, s.clone()).prop_map(|(g, s)| Op::Launch { g, s }),
        (s.clone(), b.clone(), 1u32..1000).prop_map(|(s, b, value)| Op::Fill { s, b, value }),
        (s.clone(), b.clone(), b.clone()).prop_map(|(s, src, dst)| Op::Copy { s, src, dst }),
        (s.clone(), b.clone(), b.clone()).prop_map(|(s, src, dst)| Op::SmCopy { s, src, dst }),
        (s.clone(), b.clone(), b.clone(), 0usize..4).prop_map(|(s, src, dst, form)| Op::ListCopy { s, src, dst, form }),
        (s.clone(), b.clone(), 1u32..1000).prop_map(|(s, b, value)| Op::Write { s, b, value }),
        (s.clone(), b.clone()).prop_map(|(s, b)| Op::Read { s, b }),
        (s.clone(), b.clone()).prop_map(|(s, b)| Op::ToPinned { s, b }),
        (s.clone(), b.clone()).prop_map(|(s, b)| Op::FromPinned { s, b }),
        Just(Op::HostRead),
        (1u32..1000).prop_map(|value| Op::HostWrite { value }),
        (s, b, 1u32..1000).prop_map(|(s, b, value)| Op::Renew { s, b, value }),
    ]
}

/// The program's state beside the crate's: the buffers and what each holds.
struct Program<'a> {
    engines: &'a [Engine; 2],
    /// `ppnrt_copy_bytes(dst, src, n16, tail)` of each device.
    copy_kernels: &'a [ppnrt::Function; 2],
    streams: Vec<Arc<CudaStream>>,
    buffers: Vec<CudaSlice<u32>>,
    /// The allocation each buffer slot holds now (an index of `values`).
    ids: Vec<usize>,
    pinned: PinnedHostBuffer<u32>,
    /// What each allocation holds, one operation after the other (allocations a graph still
    /// holds included).
    values: Vec<u32>,
    pinned_value: u32,
    /// The graphs kept, newest last: each with its device and what it does at a launch.
    graphs: Vec<(ppnrt::GraphExec, usize, Vec<Recorded>)>,
}

impl Program<'_> {
    /// Stream `s` among those of `device`.
    fn stream_of(&self, device: usize, s: usize) -> Arc<CudaStream> {
        let on: Vec<&Arc<CudaStream>> =
            self.streams.iter().zip(STREAM_DEVICES).filter(|(_, d)| *d == device).map(|(s, _)| s).collect();
        Arc::clone(on[s % on.len()])
    }

    /// What buffer slot `b` holds.
    fn value(&self, b: usize) -> u32 {
        self.values[self.ids[b]]
    }

    /// Buffer slot `b` now holds `value`.
    fn set(&mut self, b: usize, value: u32) {
        let id = self.ids[b];
        self.values[id] = value;
    }

    /// Buffer slot `b` among those of `device`.
    fn buffer_of(device: usize, b: usize) -> usize {
        let on: Vec<usize> = (0..BUFFERS.len()).filter(|&i| BUFFERS[i].0 == device).collect();
        on[b % on.len()]
    }

    /// Two distinct buffers `src` and `dst` (as indices), their states split for one borrow each.
    fn pair(&mut self, src: usize, dst: usize) -> (&CudaSlice<u32>, &mut CudaSlice<u32>) {
        assert_ne!(src, dst);
        if src < dst {
            let (low, high) = self.buffers.split_at_mut(dst);
            (&low[src], &mut high[0])
        } else {
            let (low, high) = self.buffers.split_at_mut(src);
            (&high[0], &mut low[dst])
        }
    }

    /// Captures `ops` on stream `s` of `device` into a graph and keeps it instantiated.
    fn capture(&mut self, device: usize, s: usize, ops: &[Captured]) {
        let stream = self.stream_of(device, s);
        let engine = &self.engines[device];
        let capture = stream.begin_capture(ppnrt::CaptureMode::Relaxed).unwrap();
        let mut recorded = Vec::new();
        for op in ops {
            match *op {
                Captured::Fill { b, value } => {
                    let b = Self::buffer_of(device, b);
                    engine.test_kernels().unwrap().fill_u32(&stream, &mut self.buffers[b], value).unwrap();
                    recorded.push(Recorded::Fill { id: self.ids[b], value });
                }
                Captured::Copy { src, dst } => {
                    // Pool memory of the other device is copied by `cuMemcpyPeerAsync`, which a
                    // capture refuses.
                    let foreign_pool = |b: usize| BUFFERS[b].0 != device && !BUFFERS[b].1;
                    if src == dst || foreign_pool(src) || foreign_pool(dst) {
                        continue;
                    }
                    let (from, to) = self.pair(src, dst);
                    stream.memcpy_dtod(from, to).unwrap();
                    recorded.push(Recorded::Copy { src: self.ids[src], dst: self.ids[dst] });
                }
                Captured::SmCopy { src, dst } => {
                    let (src, dst) = (Self::buffer_of(device, src), Self::buffer_of(device, dst));
                    if src == dst {
                        continue;
                    }
                    let (from, to) = self.pair(src, dst);
                    let _on = StreamOverride::new(Arc::clone(&stream)).unwrap();
                    engine.copy_with_sms(from, to).unwrap();
                    recorded.push(Recorded::Copy { src: self.ids[src], dst: self.ids[dst] });
                }
            }
        }
        let exec = capture.end().unwrap().instantiate().unwrap();
        if self.graphs.len() == GRAPHS {
            // Its launches stay ordered; the memory it alone held is freed after them.
            self.graphs.remove(0);
        }
        self.graphs.push((exec, device, recorded));
    }

    fn run(&mut self, op: &Op) {
        match *op {
            Op::Fill { s, b, value } => {
                let device = BUFFERS[b].0;
                let stream = self.stream_of(device, s);
                self.engines[device].test_kernels().unwrap().fill_u32(&stream, &mut self.buffers[b], value).unwrap();
                self.set(b, value);
            }
            Op::Copy { s, src, dst } => {
                if src == dst {
                    return;
                }
                let stream = Arc::clone(&self.streams[s]);
                let (from, to) = self.pair(src, dst);
                stream.memcpy_dtod(from, to).unwrap();
                self.set(dst, self.value(src));
            }
            Op::SmCopy { s, src, dst } => {
                if src == dst {
                    return;
                }
                let device = BUFFERS[dst].0;
                let stream = self.stream_of(device, s);
                let engine = &self.engines[device];
                let (from, to) = self.pair(src, dst);
                let _on = StreamOverride::new(stream).unwrap();
                match engine.copy_with_sms(from, to) {
                    Ok(()) => self.set(dst, self.value(src)),
                    // Pool memory of the other device: refused before anything is enqueued.
                    Err(CudaError::NotPeerReachable { .. }) => {
                        assert!(BUFFERS[src].0 != device && !BUFFERS[src].1, "a reachable source was refused");
                    }
                    Err(e) => panic!("SmCopy {src} -> {dst}: {e}"),
                }
            }
            Op::ListCopy { s, src, dst, form } => {
                if src == dst {
                    return;
                }
                let device = BUFFERS[dst].0;
                let stream = self.stream_of(device, s);
                let kernels = self.copy_kernels;
                let kernel = &kernels[device];
                let (from, to) = self.pair(src, dst);
                let n16 = (LEN * 4 / 16) as u64;
                let config = ppnrt::LaunchConfig::for_elements(LEN * 4 / 16 + 1, 4);
                // SAFETY: ppnrt_copy_bytes(uint4* dst, const uint4* src, uint64_t n16, uint64_t
                // tail) copies n16 × 16 bytes, the whole of both buffers (LEN u32 each); the list
                // passes exactly those four parameters.
                let launched = unsafe {
                    match form {
                        0 => stream.launch(kernel, config, KernelArgList::new().arg(to).arg(from).arg(n16).arg(0u64)),
                        1 => stream.launch(
                            kernel,
                            config,
                            KernelArgList::new().arg(to.as_view_mut()).arg(from.as_view()).arg(Length(n16)).arg(0u64),
                        ),
                        3 => stream.launch(
                            kernel,
                            config,
                            KernelArgList::new().arg(to).arg(Forwarded(from)).arg(Length(n16)).arg(0u64),
                        ),
                        _ => {
                            let (mut to, from) = (to.as_view_mut(), from.as_view());
                            // The views by reference: the list's path for a `&` parameter.
                            #[allow(clippy::needless_borrows_for_generic_args)]
                            let list = KernelArgList::new().arg(&mut to).arg(&from).arg(n16).arg(ppnrt::by_value(0u64));
                            stream.launch(kernel, config, list)
                        }
                    }
                };
                match launched {
                    Ok(()) => self.set(dst, self.value(src)),
                    Err(CudaError::NotPeerReachable { .. }) => {
                        assert!(BUFFERS[src].0 != device && !BUFFERS[src].1, "a reachable source was refused");
                    }
                    Err(e) => panic!("ListCopy {src} -> {dst} (form {form}): {e}"),
                }
            }
            Op::Write { s, b, value } => {
                let stream = self.stream_of(BUFFERS[b].0, s);
                stream.memcpy_htod(&[value; LEN], &mut self.buffers[b]).unwrap();
                self.set(b, value);
            }
            Op::Read { s, b } => {
                let stream = self.stream_of(BUFFERS[b].0, s);
                let mut host = vec![0u32; LEN];
                stream.memcpy_dtoh(&self.buffers[b], &mut host).unwrap();
                assert_eq!(host, vec![self.value(b); LEN], "buffer {b} read on stream {s}");
            }
            Op::ToPinned { s, b } => {
                let stream = self.stream_of(BUFFERS[b].0, s);
                stream.memcpy_dtoh_pinned(&self.buffers[b], &mut self.pinned).unwrap();
                self.pinned_value = self.value(b);
            }
            Op::FromPinned { s, b } => {
                let stream = self.stream_of(BUFFERS[b].0, s);
                stream.memcpy_htod_pinned(&self.pinned, &mut self.buffers[b]).unwrap();
                self.set(b, self.pinned_value);
            }
            Op::HostRead => {
                assert_eq!(self.pinned.as_slice().unwrap(), &[self.pinned_value; LEN][..], "the pinned buffer");
            }
            Op::HostWrite { value } => {
                self.pinned.as_mut_slice().unwrap().fill(value);
                self.pinned_value = value;
            }
            Op::Renew { s, b, value } => {
                let (device, persistent) = BUFFERS[b];
                let stream = self.stream_of(device, s);
                let mut fresh = if persistent {
                    CudaSlice::<u32>::alloc_persistent(&stream, LEN).unwrap()
                } else {
                    CudaSlice::<u32>::alloc(&stream, LEN).unwrap()
                };
                stream.memcpy_htod(&[value; LEN], &mut fresh).unwrap();
                // The old buffer's free waits for every use of it, on any stream (and for the
                // graphs that hold it).
                self.buffers[b] = fresh;
                self.ids[b] = self.values.len();
                self.values.push(value);
            }
            Op::Capture { device, s, ref ops } => self.capture(device, s, ops),
            Op::Launch { g, s } => {
                if self.graphs.is_empty() {
                    return;
                }
                let g = g % self.graphs.len();
                let stream = self.stream_of(self.graphs[g].1, s);
                self.graphs[g].0.launch(&stream).unwrap();
                for recorded in self.graphs[g].2.clone() {
                    match recorded {
                        Recorded::Fill { id, value } => self.values[id] = value,
                        Recorded::Copy { src, dst } => self.values[dst] = self.values[src],
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::PROPTEST_CASES, ..ProptestConfig::default() })]

    #[test]
    fn any_program_of_the_safe_layer_reads_what_it_wrote(ops in proptest::collection::vec(op(), 1..48)) {
        with_double("any_program_of_the_safe_layer_reads_what_it_wrote", |_| {
            let engines = [Engine::new(0).unwrap(), Engine::new(1).unwrap()];
            let streams: Vec<Arc<CudaStream>> = STREAM_DEVICES
                .iter()
                .enumerate()
                .map(|(i, &d)| {
                    if i == 0 || i == 3 {
                        Arc::clone(engines[d].default_stream())
                    } else {
                        CudaStream::new(engines[d].context()).unwrap()
                    }
                })
                .collect();
            for engine in &engines {
                // The helper modules loaded before any capture.
                engine.test_kernels().unwrap();
                let (a, mut b) = (engine.alloc_zeroed::<u32>(LEN).unwrap(), engine.alloc_zeroed::<u32>(LEN).unwrap());
                engine.copy_with_sms(&a, &mut b).unwrap();
            }
            let mut values = Vec::new();
            let buffers = BUFFERS
                .iter()
                .enumerate()
                .map(|(b, &(d, persistent))| {
                    let value = 1000 + b as u32;
                    values.push(value);
                    let stream = &streams[if d == 0 { 0 } else { 3 }];
                    let mut buffer = if persistent {
                        CudaSlice::<u32>::alloc_persistent(stream, LEN).unwrap()
                    } else {
                        CudaSlice::<u32>::alloc(stream, LEN).unwrap()
                    };
                    stream.memcpy_htod(&[value; LEN], &mut buffer).unwrap();
                    buffer
                })
                .collect();
            let mut pinned = PinnedHostBuffer::<u32>::new(engines[0].context(), LEN, false).unwrap();
            pinned.as_mut_slice().unwrap().fill(7);
            let ids = (0..BUFFERS.len()).collect();
            let copy_kernels = engines.each_ref().map(|e| {
                ppnrt::Module::load_ptx(e.context(), "helpers", ppnrt::kernels::HELPERS_PTX)
                    .unwrap()
                    .function("ppnrt_copy_bytes")
                    .unwrap()
            });
            let mut program =
                Program { engines: &engines, copy_kernels: &copy_kernels, streams, buffers, ids, pinned, values, pinned_value: 7, graphs: Vec::new() };
            for op in &ops {
                program.run(op);
            }
            // Every buffer, read last, holds what the program wrote last.
            for b in 0..BUFFERS.len() {
                program.run(&Op::Read { s: b, b });
            }
            program.run(&Op::HostRead);
        });
    }
}

/// One operation of a boundary's program (a pipeline of two stages).
#[derive(Clone, Debug)]
pub(crate) enum BoundaryOp {
    /// The TX stage's input is set to `value` by a kernel on its stage stream (`side`: on another
    /// stream of its device), then sent with `tx`.
    Tx { value: u32, side: bool },
    /// Slot `k` received (`rx`, `rx_into` a buffer of the RX stage's, or `rx_in_place`), or the
    /// oldest filled slot when `oldest`; what was received is kept.
    Rx { k: usize, oldest: bool, how: Receive },
    /// Kept reception `i` read, by a copy on the RX stage's stream (`side`: on another stream of
    /// its device).
    Check { i: usize, side: bool },
    /// Kept reception `i` dropped (a guard gives its slot back).
    Release { i: usize },
    /// `discard_unreceived`.
    Discard,
    /// Kept reception `i` read back (`readback` of a received buffer, which it takes, when
    /// `take`; else `readback_of`), the values collected later.
    ReadBack { i: usize, take: bool },
    /// Readback `i` collected (`PendingReadback::wait`), or dropped unread when `drop`.
    Collect { i: usize, drop: bool },
    /// The host waits for one stream (the TX stage's, the RX stage's, or either side stream): the
    /// double runs its queue then, so work that should have waited for another stream's runs
    /// before it.
    Sync { stream: usize },
}

/// How a boundary op receives.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Receive {
    Fresh,
    Into,
    InPlace,
}

fn boundary_op() -> impl Strategy<Value = BoundaryOp> {
    let how = prop_oneof![Just(Receive::Fresh), Just(Receive::Into), Just(Receive::InPlace)];
    prop_oneof![
        3 => (1u32..1000, any::<bool>()).prop_map(|(value, side)| BoundaryOp::Tx { value, side }),
        3 => (0usize..3, any::<bool>(), how).prop_map(|(k, oldest, how)| BoundaryOp::Rx { k, oldest, how }),
        2 => (0usize..8, any::<bool>()).prop_map(|(i, side)| BoundaryOp::Check { i, side }),
        1 => (0usize..8).prop_map(|i| BoundaryOp::Release { i }),
        1 => Just(BoundaryOp::Discard),
        2 => (0usize..4).prop_map(|stream| BoundaryOp::Sync { stream }),
        1 => (0usize..8, any::<bool>()).prop_map(|(i, take)| BoundaryOp::ReadBack { i, take }),
        1 => (0usize..4, prop::bool::weighted(0.2)).prop_map(|(i, drop)| BoundaryOp::Collect { i, drop }),
    ]
}

/// A slot as the model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ModelSlot {
    /// Writable: never filled, received, discarded, or lent (a write gives it another buffer).
    Writable,
    /// Filled with a step of this value, not received yet.
    Filled(u32),
}

/// What a reception keeps: a buffer, or a guard of the slot, with the value it must hold.
enum Kept<'a> {
    Buffer(CudaSlice<u32>, u32),
    Guard(ppnrt::ReceivedSlot<'a, u32>, u32),
}

impl Kept<'_> {
    /// The step's value it must hold.
    fn value(&self) -> u32 {
        match self {
            Kept::Buffer(_, value) | Kept::Guard(_, value) => *value,
        }
    }

    /// What it holds, read by a copy on `stream` (ordered by the crate's rule), then to the host.
    fn read_on(&self, stream: &Arc<CudaStream>) -> Vec<u32> {
        let view = match self {
            Kept::Buffer(b, _) => b.as_view(),
            Kept::Guard(g, _) => g.view().unwrap(),
        };
        let mut copy = CudaSlice::<u32>::alloc(stream, LEN).unwrap();
        stream.memcpy_dtod(&view, &mut copy).unwrap();
        let mut host = vec![0u32; LEN];
        stream.memcpy_dtoh(&copy, &mut host).unwrap();
        host
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::PROPTEST_CASES / 4, ..ProptestConfig::default() })]

    /// Any program of `tx`, `rx`, `rx_into`, `rx_in_place` (guards held across later writes),
    /// reads of what was received on any stream, readbacks, drops and discards, over a local, a peer and a
    /// host-staged boundary of 1–3 slots: every call the ring refuses is refused with the slot's
    /// state and changes nothing, and everything received holds the step that was sent.
    #[test]
    fn any_program_of_a_boundary_delivers_each_step_as_sent(
        transport in 0usize..3,
        slots in 1usize..4,
        ops in proptest::collection::vec(boundary_op(), 1..40),
    ) {
        with_double("any_program_of_a_boundary_delivers_each_step_as_sent", |_| {
            let primary = Engine::new(0).unwrap();
            let config = match transport {
                0 => PpConfig::with_devices(&[0, 0]),
                1 => PpConfig::with_devices(&[0, 1]),
                _ => PpConfig::with_devices(&[0, 1]).with_transport(TransportPolicy::Staged),
            };
            let rt = PpNRt::new(config.with_slots(slots), &primary).unwrap();
            let (e0, e1) = (rt.engine(0, &primary).unwrap(), rt.engine(1, &primary).unwrap());
            let (tx_stream, rx_stream) = (rt.stage_stream(0).unwrap(), rt.stage_stream(1).unwrap());
            let (tx_side, rx_side) = (CudaStream::new(e0.context()).unwrap(), CudaStream::new(e1.context()).unwrap());
            let mut x = CudaSlice::<u32>::alloc(tx_stream, LEN).unwrap();
            let mut into = CudaSlice::<u32>::alloc_persistent(rx_stream, LEN).unwrap();
            let mut model = vec![ModelSlot::Writable; slots];
            let mut next = 0;
            let mut kept: Vec<Kept<'_>> = Vec::new();
            let mut readbacks: Vec<(ppnrt::pp::PendingReadback<u32>, u32)> = Vec::new();
            let refused = |result: ppnrt::Error, what: &str| match result {
                Error::Pipeline(ppnrt::PpError::SlotState { .. }) => {}
                other => panic!("{what}: refused with {other:?}, not the slot's state"),
            };
            for op in &ops {
                match *op {
                    BoundaryOp::Tx { value, side } => {
                        let stream = if side { &tx_side } else { tx_stream };
                        e0.test_kernels().unwrap().fill_u32(stream, &mut x, value).unwrap();
                        match (rt.tx(0, &x, LEN), model[next]) {
                            (Ok(slot), ModelSlot::Writable) => {
                                assert_eq!(slot, next, "tx filled another slot than the next");
                                model[next] = ModelSlot::Filled(value);
                                next = (next + 1) % slots;
                            }
                            (Err(e), ModelSlot::Filled(_)) => refused(e, "tx on a filled slot"),
                            (result, slot) => panic!("tx with the next slot {slot:?}: {result:?}"),
                        }
                    }
                    BoundaryOp::Rx { k, oldest, how } => {
                        let k = if oldest {
                            (0..slots).map(|i| (next + i) % slots).find(|&i| model[i] != ModelSlot::Writable).unwrap_or(k % slots)
                        } else {
                            k % slots
                        };
                        let received = match how {
                            Receive::Fresh => rt.rx::<u32>(0, k, LEN).map(|b| Some(Kept::Buffer(b, 0))),
                            Receive::Into => rt.rx_into(0, k, &mut into).map(|()| None),
                            Receive::InPlace => rt.rx_in_place::<u32>(0, k, LEN).map(|g| Some(Kept::Guard(g, 0))),
                        };
                        match (received, model[k]) {
                            (Ok(got), ModelSlot::Filled(value)) => {
                                model[k] = ModelSlot::Writable;
                                match got {
                                    Some(Kept::Buffer(b, _)) => kept.push(Kept::Buffer(b, value)),
                                    Some(Kept::Guard(g, _)) => kept.push(Kept::Guard(g, value)),
                                    None => {
                                        // Read at once: `into` is received into again later.
                                        let mut host = vec![0u32; LEN];
                                        rx_stream.memcpy_dtoh(&into, &mut host).unwrap();
                                        assert_eq!(host, vec![value; LEN], "rx_into slot {k}");
                                    }
                                }
                            }
                            (Err(e), ModelSlot::Writable) => refused(e, "a receive of a slot not filled"),
                            (result, slot) => panic!("{how:?} of slot {k} ({slot:?}): {:?}", result.map(|_| ())),
                        }
                    }
                    BoundaryOp::Check { i, side } => {
                        if kept.is_empty() {
                            continue;
                        }
                        let stream = if side { &rx_side } else { rx_stream };
                        let item = &kept[i % kept.len()];
                        assert_eq!(item.read_on(stream), vec![item.value(); LEN], "a kept reception read on the {} stream", if side { "side" } else { "stage" });
                    }
                    BoundaryOp::Release { i } => {
                        if !kept.is_empty() {
                            let at = i % kept.len();
                            drop(kept.remove(at));
                        }
                    }
                    BoundaryOp::ReadBack { i, take } => {
                        if kept.is_empty() {
                            continue;
                        }
                        let at = i % kept.len();
                        let pending = match (&kept[at], take) {
                            (Kept::Buffer(..), true) => match kept.remove(at) {
                                Kept::Buffer(b, value) => (rt.readback(b).unwrap(), value),
                                Kept::Guard(..) => unreachable!(),
                            },
                            (Kept::Buffer(b, value), false) => (rt.readback_of(b).unwrap(), *value),
                            (Kept::Guard(g, value), _) => (rt.readback_of(&g.view().unwrap()).unwrap(), *value),
                        };
                        readbacks.push(pending);
                    }
                    BoundaryOp::Collect { i, drop } => {
                        if readbacks.is_empty() {
                            continue;
                        }
                        let (pending, value) = readbacks.remove(i % readbacks.len());
                        if !drop {
                            assert_eq!(pending.wait().unwrap(), &[value; LEN][..], "a readback");
                        }
                    }
                    BoundaryOp::Sync { stream } => {
                        [tx_stream, rx_stream, &tx_side, &rx_side][stream].synchronize().unwrap();
                    }
                    BoundaryOp::Discard => {
                        let filled = model.iter().filter(|slot| **slot != ModelSlot::Writable).count();
                        assert_eq!(rt.discard_unreceived(0).unwrap(), filled, "slots discarded");
                        model.fill(ModelSlot::Writable);
                    }
                }
            }
            // Every readback, kept reception and slot still filled holds its step.
            for (pending, value) in readbacks {
                assert_eq!(pending.wait().unwrap(), &[value; LEN][..], "a readback at the end");
            }
            for item in &kept {
                assert_eq!(item.read_on(rx_stream), vec![item.value(); LEN], "a kept reception at the end");
            }
            drop(kept);
            for (k, slot) in model.iter().enumerate() {
                if let ModelSlot::Filled(value) = *slot {
                    let got = rt.rx::<u32>(0, k, LEN).unwrap();
                    assert_eq!(e1.dtoh(&got).unwrap(), vec![value; LEN], "slot {k} at the end");
                }
            }
            rt.synchronize().unwrap();
        });
    }
}
