//! `Engine`: one device's execution context.
//!
//! An engine owns the device's primary context (retained), a default stream, and the embedded
//! helper kernels (loaded on first use). Its allocations, copies and launches run on the calling
//! thread's ambient stream when a [`StreamOverride`](crate::StreamOverride) is active, else on the
//! default stream; an ambient stream of another device is an error, never a silent fallback.
//! `Engine` is cheap to clone and may be used from many threads at once.

use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::kernels;
use crate::safe::{
    Context, CudaSlice, CudaStream, Device, DeviceRepr, DeviceSlice, DeviceSliceMut, Function, KernelArgs,
    LaunchConfig, Module, ambient_stream, enable_peer_access,
};

/// The value in `cell`, made by `load` on first use. A failed load is returned and not kept: the
/// next call tries again. `lock` serialises loads.
fn load_once<'a, T>(cell: &'a OnceLock<T>, lock: &Mutex<()>, load: impl FnOnce() -> Result<T>) -> Result<&'a T> {
    if let Some(value) = cell.get() {
        return Ok(value);
    }
    let _loading = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(value) = cell.get() {
        return Ok(value);
    }
    let value = load()?;
    Ok(cell.get_or_init(|| value))
}

/// One device's execution context. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

#[derive(Debug)]
struct EngineInner {
    device: Device,
    ctx: Arc<Context>,
    stream: Arc<CudaStream>,
    max_blocks: u32,
    /// Loaded on first use; a failed load (say, out of memory) is not kept, the next use retries.
    helpers: OnceLock<Helpers>,
    toy_model: OnceLock<Function>,
    /// Serialises the loads above, so that concurrent first uses load each module once.
    loading: Mutex<()>,
}

#[derive(Debug)]
struct Helpers {
    fill_pattern: Function,
    fill_u32: Function,
    checksum: Function,
    spin: Function,
    copy_bytes: Function,
    trap: Function,
}

impl Engine {
    /// The engine of device `ordinal`.
    ///
    /// # Errors
    /// [`Error::DeviceOutOfRange`]; the loader's or driver's error. When it fails and a `PPNRT_*`
    /// variable is malformed too, the configuration error ([`Error::Config`]), which names the
    /// other failure.
    pub fn new(ordinal: i32) -> Result<Engine> {
        Engine::open(ordinal).map_err(|e| match crate::pp::PpConfig::from_env() {
            // The first thing to fix is the configuration: report it, naming the other failure.
            Err(mut config) => {
                config.reason = format!("{} (and Engine::new({ordinal}) failed: {e})", config.reason);
                Error::Config(config)
            }
            Ok(_) => e,
        })
    }

    fn open(ordinal: i32) -> Result<Engine> {
        let device = Device::get(ordinal)?;
        let ctx = Context::primary(&device)?;
        let stream = CudaStream::new(&ctx)?;
        let max_blocks = u32::try_from(device.multiprocessor_count()?.max(1) * 8).unwrap_or(1024);
        Ok(Engine {
            inner: Arc::new(EngineInner {
                device,
                ctx,
                stream,
                max_blocks,
                helpers: OnceLock::new(),
                toy_model: OnceLock::new(),
                loading: Mutex::new(()),
            }),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.device.ordinal()
    }

    /// The device's primary context.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// The engine's own stream, used when no ambient stream is set.
    pub fn default_stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The stream this thread's operations run on: the ambient stream if one is set, else the
    /// default stream.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] when the ambient stream belongs to another device.
    #[inline]
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        match ambient_stream()? {
            None => Ok(Arc::clone(&self.inner.stream)),
            Some(stream) if stream.ordinal() == self.ordinal() => Ok(stream),
            Some(stream) => Err(Error::WrongDevice {
                what: "Engine: the ambient stream belongs to another device than the engine",
                expected: self.ordinal(),
                found: stream.ordinal(),
            }),
        }
    }

    /// A block-count cap for grid-stride kernels (8 blocks per multiprocessor).
    pub fn max_blocks(&self) -> u32 {
        self.inner.max_blocks
    }

    /// `len` elements from the memory pool, owned by the current stream; contents unspecified.
    ///
    /// # Errors
    /// As [`CudaSlice::alloc`] and [`stream`](Self::stream).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        CudaSlice::alloc(&self.stream()?, len)
    }

    /// `len` elements from the memory pool, zeroed on the current stream.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn alloc_zeroed<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        let stream = self.stream()?;
        let mut slice = CudaSlice::alloc(&stream, len)?;
        stream.memset_bytes(&mut slice, 0)?;
        Ok(slice)
    }

    /// `len` elements with `cuMemAlloc` (reachable by peers), owned by the current stream.
    ///
    /// # Errors
    /// As [`CudaSlice::alloc_persistent`].
    pub fn alloc_persistent<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        CudaSlice::alloc_persistent(&self.stream()?, len)
    }

    /// A new device array holding `src`, copied on the current stream.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc) and [`CudaStream::memcpy_htod`].
    pub fn htod<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>> {
        let stream = self.stream()?;
        let mut dst = CudaSlice::alloc(&stream, src.len())?;
        stream.memcpy_htod(src, &mut dst)?;
        Ok(dst)
    }

    /// Copies `src` into `dst` on the current stream, or, for memory of another device, on the
    /// stream that owns `dst` (host-device copies run on the memory's own device).
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_htod`].
    pub fn htod_into<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, src: &[T], dst: &mut D) -> Result<()> {
        let stream = self.stream_for(dst.stream())?;
        stream.memcpy_htod(src, dst)
    }

    /// The contents of `src`, copied on the current stream, or, for memory of another device, on
    /// the stream that owns `src`; waits for it.
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_dtoh`].
    pub fn dtoh<T: DeviceRepr + Default, S: DeviceSlice<T>>(&self, src: &S) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.stream_for(src.stream())?.memcpy_dtoh(src, &mut out)?;
        Ok(out)
    }

    /// The current stream for memory of this device, else `owner` (of the memory's device).
    fn stream_for(&self, owner: &Arc<CudaStream>) -> Result<Arc<CudaStream>> {
        if owner.ordinal() == self.ordinal() { self.stream() } else { Ok(Arc::clone(owner)) }
    }

    /// Copies `src` into `dst` (either may be on another device) on the current stream.
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_dtod`].
    pub fn dtod<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(&self, src: &S, dst: &mut D) -> Result<()> {
        self.stream()?.memcpy_dtod(src, dst)
    }

    /// Blocks until the current stream's work is done.
    ///
    /// # Errors
    /// The driver's error, including errors of earlier asynchronous work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream()?.synchronize()
    }

    /// Loads PTX into this engine's context.
    ///
    /// # Errors
    /// As [`Module::load_ptx`].
    pub fn load_ptx(&self, name: &str, ptx: &str) -> Result<Arc<Module>> {
        Module::load_ptx(&self.inner.ctx, name, ptx)
    }

    /// Launches `function` on the current stream.
    ///
    /// # Errors
    /// As [`CudaStream::launch`].
    ///
    /// # Safety
    /// As [`CudaStream::launch`].
    pub unsafe fn launch<A: KernelArgs>(&self, function: &Function, config: LaunchConfig, args: A) -> Result<()> {
        // SAFETY: the caller meets CudaStream::launch's contract.
        unsafe { self.stream()?.launch(function, config, args) }
    }

    fn helpers(&self) -> Result<&Helpers> {
        load_once(&self.inner.helpers, &self.inner.loading, || {
            let module = self.load_ptx("helpers", kernels::HELPERS_PTX)?;
            Ok(Helpers {
                fill_pattern: module.function("ppnrt_fill_pattern_u32")?,
                fill_u32: module.function("ppnrt_fill_u32")?,
                checksum: module.function("ppnrt_checksum_u32")?,
                spin: module.function("ppnrt_spin_ns")?,
                copy_bytes: module.function("ppnrt_copy_bytes")?,
                trap: module.function("ppnrt_trap")?,
            })
        })
    }

    fn toy_layer_function(&self) -> Result<&Function> {
        load_once(&self.inner.toy_model, &self.inner.loading, || {
            self.load_ptx("toy_model", kernels::TOY_MODEL_PTX)?.function("ppnrt_toy_layer_f32")
        })
    }

    /// Runs a helper kernel over slices that must live on this engine's device.
    fn run_on_own_device(
        &self,
        what: &'static str,
        owners: &[&Arc<CudaStream>],
        launch: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<()> {
        let stream = self.stream()?;
        for owner in owners {
            if owner.ordinal() != self.ordinal() {
                return Err(Error::WrongDevice { what, expected: self.ordinal(), found: owner.ordinal() });
            }
            stream.join(owner)?;
        }
        launch(&stream)?;
        stream.settle(owners.iter().try_for_each(|owner| owner.join(&stream)))
    }

    /// Writes [`kernels::pattern`]`(seed, i)` into element `i` of `dst`.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for memory of another device; the driver's error.
    pub fn fill_pattern<D: DeviceSliceMut<u32>>(&self, dst: &mut D, seed: u32) -> Result<()> {
        let helpers = self.helpers()?;
        let config = LaunchConfig::for_elements(dst.len(), self.max_blocks());
        let (ptr, len) = (dst.device_ptr(), dst.len() as u64);
        self.run_on_own_device("Engine::fill_pattern", &[dst.stream()], |stream| {
            // SAFETY: ppnrt_fill_pattern_u32(uint32_t*, uint64_t, uint32_t) writes len words at ptr,
            // which dst owns; dst is joined to the stream.
            unsafe { stream.launch(&helpers.fill_pattern, config, (ptr, len, seed)) }
        })
    }

    /// Sets every element of `dst` to `value`.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for memory of another device; the driver's error.
    pub fn fill_u32<D: DeviceSliceMut<u32>>(&self, dst: &mut D, value: u32) -> Result<()> {
        let helpers = self.helpers()?;
        let config = LaunchConfig::for_elements(dst.len(), self.max_blocks());
        let (ptr, len) = (dst.device_ptr(), dst.len() as u64);
        self.run_on_own_device("Engine::fill_u32", &[dst.stream()], |stream| {
            // SAFETY: ppnrt_fill_u32(uint32_t*, uint64_t, uint32_t) writes len words at ptr.
            unsafe { stream.launch(&helpers.fill_u32, config, (ptr, len, value)) }
        })
    }

    /// The [`kernels::checksum`] of `src`, computed on the device; waits for the result.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for memory of another device; the driver's error.
    pub fn checksum<S: DeviceSlice<u32>>(&self, src: &S) -> Result<u64> {
        let helpers = self.helpers()?;
        let sum = self.alloc_zeroed::<u64>(1)?;
        let config = LaunchConfig::for_elements(src.len(), self.max_blocks());
        let (ptr, len, out_ptr) = (src.device_ptr(), src.len() as u64, sum.device_ptr());
        self.run_on_own_device("Engine::checksum", &[src.stream(), sum.stream()], |stream| {
            // SAFETY: ppnrt_checksum_u32(const uint32_t*, uint64_t, unsigned long long*) reads len
            // words at ptr and adds into one u64 at out_ptr, both owned by live slices.
            unsafe { stream.launch(&helpers.checksum, config, (ptr, len, out_ptr)) }
        })?;
        Ok(self.dtoh(&sum)?[0])
    }

    /// Adds the [`kernels::checksum`] of `src` into `out[0]` (which should start at zero), without
    /// waiting: for checking many transfers with one readback at the end.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless `out` has exactly one element; [`Error::WrongDevice`] for
    /// memory of another device; the driver's error.
    pub fn checksum_into<S: DeviceSlice<u32>, D: DeviceSliceMut<u64>>(&self, src: &S, out: &mut D) -> Result<()> {
        if out.len() != 1 {
            return Err(Error::LengthMismatch { what: "Engine::checksum_into: out", expected: 1, found: out.len() });
        }
        let helpers = self.helpers()?;
        let config = LaunchConfig::for_elements(src.len(), self.max_blocks());
        let (ptr, len, out_ptr) = (src.device_ptr(), src.len() as u64, out.device_ptr());
        self.run_on_own_device("Engine::checksum_into", &[src.stream(), out.stream()], |stream| {
            // SAFETY: ppnrt_checksum_u32(const uint32_t*, uint64_t, unsigned long long*) reads len
            // words at ptr and adds into the one u64 at out_ptr, both owned by live slices.
            unsafe { stream.launch(&helpers.checksum, config, (ptr, len, out_ptr)) }
        })
    }

    /// Enqueues a kernel that keeps the current stream busy for `ns` nanoseconds.
    ///
    /// # Errors
    /// The driver's error.
    pub fn spin(&self, ns: u64) -> Result<()> {
        let helpers = self.helpers()?;
        let config = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory.
        unsafe { self.stream()?.launch(&helpers.spin, config, (ns,)) }
    }

    /// Enqueues the SM copy kernel on `stream`: `bytes` bytes from `src` to `dst`. Loads the
    /// helper module on first use.
    ///
    /// # Errors
    /// [`Error::Misaligned`] when either address is not 16-byte aligned; [`Error::WrongDevice`]
    /// when `stream` is of another device; the driver's error.
    ///
    /// # Safety
    /// As [`CudaStream::copy_bytes_async`]; both ranges are reachable from this device's SMs.
    pub(crate) unsafe fn launch_copy_bytes(
        &self,
        stream: &CudaStream,
        dst: crate::sys::CUdeviceptr,
        src: crate::sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if let Some(address) = [src, dst].into_iter().find(|p| p % 16 != 0) {
            return Err(Error::Misaligned { what: "Engine::launch_copy_bytes", address, align: 16 });
        }
        let helpers = self.helpers()?;
        let (n16, tail) = ((bytes / 16) as u64, (bytes % 16) as u64);
        let config = LaunchConfig::for_elements(bytes / 16 + 1, self.max_blocks());
        // SAFETY: ppnrt_copy_bytes(uint4*, const uint4*, uint64_t, uint64_t) copies n16*16+tail
        // = bytes bytes between two 16-byte-aligned ranges (checked above) that the caller
        // guarantees live, reachable and ordered on `stream`.
        unsafe { stream.launch(&helpers.copy_bytes, config, (dst, src, n16, tail)) }
    }

    /// Loads the helper kernels now rather than on first use (their load errors surface here).
    ///
    /// # Errors
    /// The module load's error.
    pub(crate) fn preload_helpers(&self) -> Result<()> {
        self.helpers().map(|_| ())
    }

    /// Copies `src` into `dst` with the SMs of this engine's device (a kernel, not the copy
    /// engines). Either side may be on another device: peer access to it is enabled first (as
    /// [`enable_peer_access`] does), and it must not be pool memory
    /// (pools are not peer-mapped; use [`CudaSlice::alloc_persistent`]).
    ///
    /// # Errors
    /// Checked before anything is enqueued: [`Error::LengthMismatch`] unless the lengths agree;
    /// [`Error::Misaligned`] when either address is not 16-byte aligned;
    /// [`Error::NotPeerReachable`] for pool memory of another device;
    /// [`Error::PeerAccessUnsupported`] when the devices cannot reach each other. Else the
    /// driver's error.
    pub fn copy_with_sms<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(
        &self,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch { what: "Engine::copy_with_sms", expected: dst.len(), found: src.len() });
        }
        if let Some(address) = [src.device_ptr(), dst.device_ptr()].into_iter().find(|p| p % 16 != 0) {
            return Err(Error::Misaligned { what: "Engine::copy_with_sms", address, align: 16 });
        }
        if src.is_empty() {
            return Ok(());
        }
        let sides =
            [(src.stream(), src.is_pooled(), src.device_ptr()), (dst.stream(), dst.is_pooled(), dst.device_ptr())];
        for (owner, pooled, address) in sides {
            if owner.ordinal() != self.ordinal() && pooled {
                return Err(Error::NotPeerReachable {
                    what: "Engine::copy_with_sms",
                    device: self.ordinal(),
                    memory_device: owner.ordinal(),
                    address,
                });
            }
        }
        for (owner, _, _) in sides {
            if owner.ordinal() != self.ordinal() {
                enable_peer_access(self.context(), owner.context())?;
            }
        }
        let stream = self.stream()?;
        let owners = [src.stream(), dst.stream()];
        for owner in owners {
            stream.join(owner)?;
        }
        // SAFETY: both ranges are live, 16-byte aligned, src.byte_len() long (lengths checked
        // above), reachable from this device (its own memory, or cuMemAlloc memory of a peer
        // with peer access enabled above) and ordered on `stream` by the joins above and below.
        unsafe { self.launch_copy_bytes(&stream, dst.device_ptr(), src.device_ptr(), src.byte_len())? };
        stream.settle(owners.iter().try_for_each(|owner| owner.join(&stream)))
    }

    /// Applies layer `layer` of the toy residual model at decode step `step` to `x`, in place.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for memory of another device; the driver's error.
    pub fn toy_layer<D: DeviceSliceMut<f32>>(&self, x: &mut D, step: u32, layer: u32) -> Result<()> {
        let function = self.toy_layer_function()?;
        let config = LaunchConfig::for_elements(x.len(), self.max_blocks());
        let (ptr, len) = (x.device_ptr(), x.len() as u64);
        self.run_on_own_device("Engine::toy_layer", &[x.stream()], |stream| {
            // SAFETY: ppnrt_toy_layer_f32(float*, uint64_t, uint32_t, uint32_t) updates len floats
            // at ptr in place.
            unsafe { stream.launch(function, config, (ptr, len, step, layer)) }
        })
    }

    /// Launches a kernel that traps: the context becomes unusable and later calls on it return
    /// [`Error::ContextUnusable`]. For fault-handling tests; run it in a process you can lose.
    ///
    /// # Errors
    /// The driver's error.
    pub fn inject_trap(&self) -> Result<()> {
        let helpers = self.helpers()?;
        let config = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: ppnrt_trap() takes no parameters and touches no memory.
        unsafe { self.stream()?.launch(&helpers.trap, config, ()) }
    }
}
