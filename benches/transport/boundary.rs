//! The boundary benchmarks: the crate's `tx`/`rx` beside a raw-driver boundary making the same
//! calls (`boundary_step`, `boundary_host`), per transport and size.

use super::*;

/// One boundary through the crate, and the same calls made raw, sharing streams and slot memory
/// layout (separate buffers and events).
pub(crate) struct Boundary {
    pub(crate) rt: PpNRt,
    pub(crate) x: CudaSlice<u32>,
    pub(crate) n: usize,
    pub(crate) raw: RawBoundary,
    pub(crate) done: CudaEvent,
}

// Made once per slot and used in place: the raw reference's copies take no extra indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum RawSlotBuffer {
    Device(CudaSlice<u8>),
    Host(PinnedHostBuffer<u8>),
}

pub(crate) struct RawSlot {
    pub(crate) buffer: RawSlotBuffer,
    pub(crate) ev_tx: CudaEvent,
    pub(crate) ev_rx: CudaEvent,
    pub(crate) rx_recorded: bool,
}

/// The protocol written directly against the driver, making the crate's calls: per `tx` one
/// context bind, a wait, a copy, a record; per `rx` one bind, a wait, a stream-ordered
/// allocation, a copy, a record; the output is freed stream-ordered, as the crate's `CudaSlice`
/// drop does. Copies within a device up to `SM_COPY_MAX_BYTES` launch the SM copy kernel.
pub(crate) struct RawBoundary {
    pub(crate) tx_stream: Arc<CudaStream>,
    pub(crate) rx_stream: Arc<CudaStream>,
    pub(crate) slots: Vec<RawSlot>,
    pub(crate) next: usize,
    /// Whether TX and RX share a device (`tx` then copies within it too).
    pub(crate) local: bool,
    /// The SM copy kernel in the RX device's context, and its grid-size cap.
    pub(crate) copy: Function,
    pub(crate) max_blocks: u32,
}

impl RawBoundary {
    pub(crate) fn tx(&mut self, x: CUdeviceptr, bytes: usize) -> usize {
        let index = self.next;
        let slot = &mut self.slots[index];
        let stream: CUstream = self.tx_stream.raw();
        raw!(cuCtxSetCurrent(self.tx_stream.context().raw()));
        if slot.rx_recorded {
            raw!(cuStreamWaitEvent(stream, slot.ev_rx.raw(), 0));
        }
        let local = self.local;
        match &mut slot.buffer {
            RawSlotBuffer::Device(buffer) if local => {
                launch_or_copy(&self.copy, self.max_blocks, buffer.device_ptr(), x, bytes, stream)
            }
            RawSlotBuffer::Device(buffer) => raw!(cuMemcpyAsync(buffer.device_ptr(), x, bytes, stream)),
            RawSlotBuffer::Host(buffer) => raw!(cuMemcpyDtoHAsync_v2(buffer.as_mut_ptr().cast(), x, bytes, stream)),
        }
        raw!(cuEventRecord(slot.ev_tx.raw(), stream));
        self.next = (index + 1) % self.slots.len();
        index
    }

    pub(crate) fn rx(&mut self, index: usize, bytes: usize) -> CUdeviceptr {
        let slot = &mut self.slots[index];
        let stream: CUstream = self.rx_stream.raw();
        raw!(cuCtxSetCurrent(self.rx_stream.context().raw()));
        raw!(cuStreamWaitEvent(stream, slot.ev_tx.raw(), 0));
        let mut out: CUdeviceptr = 0;
        raw!(cuMemAllocAsync(&mut out, bytes, stream));
        match &slot.buffer {
            RawSlotBuffer::Device(buffer) => {
                launch_or_copy(&self.copy, self.max_blocks, out, buffer.device_ptr(), bytes, stream)
            }
            RawSlotBuffer::Host(buffer) => raw!(cuMemcpyHtoDAsync_v2(out, buffer.as_ptr().cast(), bytes, stream)),
        }
        raw!(cuEventRecord(slot.ev_rx.raw(), stream));
        slot.rx_recorded = true;
        out
    }

    /// The raw in-place receive: the RX stream waits for the slot's `ev_tx` and the slot's
    /// `ev_rx` is recorded after the consumer's work (here: none), no allocation, no copy.
    pub(crate) fn rx_in_place(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let stream: CUstream = self.rx_stream.raw();
        raw!(cuCtxSetCurrent(self.rx_stream.context().raw()));
        raw!(cuStreamWaitEvent(stream, slot.ev_tx.raw(), 0));
        raw!(cuEventRecord(slot.ev_rx.raw(), stream));
        slot.rx_recorded = true;
    }

    pub(crate) fn free(&self, out: CUdeviceptr) {
        raw!(cuMemFreeAsync(out, self.rx_stream.raw()));
    }
}

/// A copy within one device, as the crate makes it: the SM copy kernel (a raw `cuLaunchKernel`)
/// up to `SM_COPY_MAX_BYTES` with both addresses 16-byte aligned, else `cuMemcpyAsync`.
pub(crate) fn launch_or_copy(
    copy: &Function,
    max_blocks: u32,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) {
    if bytes <= SM_COPY_MAX_BYTES && dst % 16 == 0 && src % 16 == 0 {
        let config = LaunchConfig::for_elements(bytes / 16 + 1, max_blocks);
        let (mut d, mut s, mut n16, mut tail) = (dst, src, (bytes / 16) as u64, (bytes % 16) as u64);
        let mut params: [*mut std::ffi::c_void; 4] =
            [(&raw mut d).cast(), (&raw mut s).cast(), (&raw mut n16).cast(), (&raw mut tail).cast()];
        raw!(cuLaunchKernel(
            copy.raw(),
            config.grid.0,
            1,
            1,
            config.block.0,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
    } else {
        raw!(cuMemcpyAsync(dst, src, bytes, stream));
    }
}

impl Boundary {
    pub(crate) fn new(gpus: &Gpus, devices: [i32; 2], policy: TransportPolicy, max_bytes: usize) -> Boundary {
        let primary = &gpus.engines[0];
        let config = PpConfig::with_devices(&devices).with_transport(policy).with_reserve_bytes(max_bytes);
        let rt = PpNRt::new(config, primary).unwrap();
        let (tx_engine, rx_engine) = (rt.engine(0, primary).unwrap().clone(), rt.engine(1, primary).unwrap().clone());
        let x = {
            let _scope = rt.enter(0).unwrap();
            let mut x = tx_engine.alloc::<u32>(max_bytes / 4).unwrap();
            tx_engine.fill_pattern(&mut x, 3).unwrap();
            x
        };
        let (tx_stream, rx_stream) = (rt.stage_stream(0).unwrap().clone(), rt.stage_stream(1).unwrap().clone());
        let staged = policy == TransportPolicy::Staged;
        let slots = (0..rt.n_slots())
            .map(|_| RawSlot {
                buffer: if staged {
                    RawSlotBuffer::Host(PinnedHostBuffer::new(rx_engine.context(), max_bytes, false).unwrap())
                } else {
                    RawSlotBuffer::Device(CudaSlice::alloc_persistent(&rx_stream, max_bytes).unwrap())
                },
                ev_tx: CudaEvent::new(tx_engine.context(), false).unwrap(),
                ev_rx: CudaEvent::new(rx_engine.context(), false).unwrap(),
                rx_recorded: false,
            })
            .collect();
        let done = CudaEvent::new(rx_engine.context(), false).unwrap();
        rt.synchronize().unwrap();
        let copy = Module::load_ptx(rx_engine.context(), "helpers", ppnrt::kernels::HELPERS_PTX)
            .unwrap()
            .function("ppnrt_copy_bytes")
            .unwrap();
        let raw = RawBoundary {
            tx_stream,
            rx_stream,
            slots,
            next: 0,
            local: devices[0] == devices[1],
            copy,
            max_blocks: rx_engine.max_blocks(),
        };
        Boundary { rt, x, n: 0, raw, done }
    }

    pub(crate) fn set_bytes(&mut self, bytes: usize) {
        self.n = bytes / 4;
    }

    pub(crate) fn step_crate(&self) {
        let slot = self.rt.tx(0, &self.x, self.n).unwrap();
        drop(self.rt.rx::<u32>(0, slot, self.n).unwrap());
    }

    pub(crate) fn step_raw(&mut self) {
        let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
        let out = self.raw.rx(slot, self.n * 4);
        self.raw.free(out);
    }

    pub(crate) fn sync(&self) {
        self.rt.synchronize().unwrap();
    }

    /// Host seconds of (tx, rx) per call, each issued into an idle queue.
    pub(crate) fn host_times(&mut self, raw: bool, iters: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut txs, mut rxs) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
        for i in 0..iters {
            if i % 32 == 0 || self.n * 4 >= MIB {
                self.sync();
            }
            let t0 = Instant::now();
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                let t1 = Instant::now();
                let out = self.raw.rx(slot, self.n * 4);
                let t2 = Instant::now();
                self.raw.free(out);
                txs.push((t1 - t0).as_secs_f64());
                rxs.push((t2 - t1).as_secs_f64());
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let t1 = Instant::now();
                let out = self.rt.rx::<u32>(0, slot, self.n).unwrap();
                let t2 = Instant::now();
                drop(out);
                txs.push((t1 - t0).as_secs_f64());
                rxs.push((t2 - t1).as_secs_f64());
            }
        }
        self.sync();
        (txs, rxs)
    }

    /// Host seconds of `tx` + in-place receive (guard taken, the consumer's read of the view
    /// ordered on the RX stream, guard dropped) per step, each issued into an idle queue.
    pub(crate) fn host_times_in_place(&mut self, raw: bool, iters: usize) -> Vec<f64> {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            if i % 32 == 0 {
                self.sync();
            }
            let t0 = Instant::now();
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                self.raw.rx_in_place(slot);
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let mut received = self.rt.rx_in_place::<u32>(0, slot, self.n).unwrap();
                received.order_on(self.rt.stage_stream(1).unwrap()).unwrap();
                drop(received);
            }
            times.push(t0.elapsed().as_secs_f64());
        }
        self.sync();
        times
    }

    /// Seconds per step with `steps` steps in flight (host clock, final synchronisation included).
    pub(crate) fn pipelined(&mut self, raw: bool, steps: usize) -> f64 {
        self.sync();
        let t0 = Instant::now();
        for _ in 0..steps {
            if raw { self.step_raw() } else { self.step_crate() }
        }
        self.sync();
        t0.elapsed().as_secs_f64() / steps as f64
    }

    /// Seconds from `tx` issue to the RX stage's data being ready, one hop at a time: received by
    /// a copy out of the slot (`rx`), or in place (the RX stream waits for the slot, no copy).
    pub(crate) fn hop_times(&mut self, raw: bool, iters: usize, in_place: bool) -> Vec<f64> {
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            self.sync();
            let t0 = Instant::now();
            // The received buffers are freed after the clock stops, as a stage would later.
            let (mut raw_out, mut crate_out) = (None, None);
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                if in_place {
                    self.raw.rx_in_place(slot);
                } else {
                    raw_out = Some(self.raw.rx(slot, self.n * 4));
                }
                raw!(cuEventRecord(self.done.raw(), self.raw.rx_stream.raw()));
                raw!(cuEventSynchronize(self.done.raw()));
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let rx_stream = self.rt.stage_stream(1).unwrap();
                if in_place {
                    let mut received = self.rt.rx_in_place::<u32>(0, slot, self.n).unwrap();
                    received.order_on(rx_stream).unwrap();
                } else {
                    crate_out = Some(self.rt.rx::<u32>(0, slot, self.n).unwrap());
                }
                self.done.record(rx_stream).unwrap();
                self.done.synchronize().unwrap();
            }
            times.push(t0.elapsed().as_secs_f64());
            if let Some(out) = raw_out {
                self.raw.free(out);
            }
            drop(crate_out);
        }
        times
    }
}

pub(crate) fn boundary_groups(c: &mut Criterion, gpus: &Gpus) {
    let mut step = c.benchmark_group("boundary_step");
    for (name, devices, policy) in transports(gpus) {
        let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
        for bytes in BOUNDARY_SIZES {
            boundary.set_bytes(bytes);
            step.throughput(Throughput::Bytes(bytes as u64));
            step.sample_size(if bytes >= 16 * MIB { 10 } else { 30 });
            step.bench_function(BenchmarkId::new(format!("crate/{name}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    Duration::from_secs_f64(boundary.pipelined(false, iters as usize) * iters as f64)
                })
            });
            step.bench_function(BenchmarkId::new(format!("raw/{name}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    Duration::from_secs_f64(boundary.pipelined(true, iters as usize) * iters as f64)
                })
            });
        }
    }
    step.finish();
    let mut host = c.benchmark_group("boundary_host_tx_rx");
    for (name, devices, policy) in transports(gpus) {
        let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
        for bytes in [16 * KIB, 32 * KIB, 256 * KIB] {
            boundary.set_bytes(bytes);
            for (who, raw) in [("crate", false), ("raw", true)] {
                host.bench_function(BenchmarkId::new(format!("{who}/{name}"), label(bytes)), |bench| {
                    bench.iter_custom(|iters| {
                        let (txs, rxs) = boundary.host_times(raw, iters as usize);
                        Duration::from_secs_f64(txs.iter().sum::<f64>() + rxs.iter().sum::<f64>())
                    })
                });
            }
        }
    }
    host.finish();
}
