//! PTX modules and kernel launch.
//!
//! A [`Module`] owns a loaded module of one context (unloaded when the last [`Function`] of it
//! goes); both are `Send + Sync`. A launch orders the slices and views it is given by the crate's
//! rule (see `ordering`).

use std::ffi::{CStr, CString, c_void};
use std::sync::Arc;

use super::context::Context;
use super::memory::{CudaSlice, CudaView, CudaViewMut, DeviceMemory, DeviceRepr, DeviceSlice, Tracked, ordered_with};
use super::ordering::Use;
use super::peer::ensure_peer_access;
use super::stream::CudaStream;
use crate::error::{Error, Result};
use crate::result::module as raw;
use crate::sys::{CUdeviceptr, CUfunction, CUmodule};

/// A module loaded into one context.
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Context>,
    raw: CUmodule,
    name: String,
    /// The `.entry` names of the PTX, to refuse unknown kernels before asking the driver.
    entries: Vec<String>,
}

// SAFETY: a loaded CUmodule and its functions may be used from any thread.
unsafe impl Send for Module {}
// SAFETY: as above; methods take &self and call thread-safe driver entry points.
unsafe impl Sync for Module {}

impl Module {
    /// Loads PTX text (JIT-compiled by the driver for the device). `name` is used in errors.
    ///
    /// # Errors
    /// [`Error::InteriorNul`] if `ptx` contains a NUL byte before its end; the driver's error
    /// (`CUDA_ERROR_INVALID_PTX`, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` when the driver is older
    /// than the toolkit that wrote the PTX).
    #[doc(alias = "cuModuleLoadData")]
    pub fn load_ptx(ctx: &Arc<Context>, name: &str, ptx: &str) -> Result<Arc<Module>> {
        let owned;
        let image: &CStr = match CStr::from_bytes_with_nul(ptx.as_bytes()) {
            // Already NUL-terminated (the embedded modules are): no copy.
            Ok(image) => image,
            Err(_) => {
                owned = CString::new(ptx).map_err(|e| Error::InteriorNul {
                    what: "Module::load_ptx: PTX text",
                    position: e.nul_position(),
                })?;
                &owned
            }
        };
        let _bound = ctx.bind()?;
        let raw = raw::load_data(image)?;
        Ok(Arc::new(Module { ctx: Arc::clone(ctx), raw, name: name.to_string(), entries: ptx_entries(ptx) }))
    }

    /// The kernel `name`.
    ///
    /// # Errors
    /// [`Error::KernelNotFound`] when the module has no such kernel (checked against the PTX's
    /// entries before the driver is asked).
    #[doc(alias = "cuModuleGetFunction")]
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let not_found = || Error::KernelNotFound { module: self.name.clone(), kernel: name.to_string() };
        if !self.entries.iter().any(|entry| entry == name) {
            return Err(not_found());
        }
        let c_name = CString::new(name)
            .map_err(|e| Error::InteriorNul { what: "Module::function: kernel name", position: e.nul_position() })?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live while self lives.
        match unsafe { raw::get_function(self.raw, &c_name) } {
            Ok(raw) => Ok(Function { module: Arc::clone(self), raw, name: name.to_string() }),
            Err(Error::Driver(e)) if e.code == crate::sys::CUresult::CUDA_ERROR_NOT_FOUND => Err(not_found()),
            Err(e) => Err(e),
        }
    }

    /// The kernels the module defines (its PTX `.entry` names).
    pub fn entries(&self) -> &[String] {
        &self.entries
    }

    /// The module's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The name given at load.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The names of the `.entry` directives of PTX text (`.visible .entry name(`).
fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| line.split(".entry ").nth(1))
        .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

impl Drop for Module {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: every Function holds an Arc<Module>, so no function of this module is used
            // after this; launches already queued keep the code resident in the driver.
            unsafe { raw::unload(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

/// A kernel of a loaded module.
#[derive(Debug, Clone)]
pub struct Function {
    module: Arc<Module>,
    raw: CUfunction,
    name: String,
}

// SAFETY: a CUfunction may be launched from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device ordinal of the module.
    pub fn ordinal(&self) -> i32 {
        self.module.ctx.ordinal()
    }

    /// The raw handle, valid while this `Function` (which keeps its module loaded) lives.
    pub fn raw(&self) -> CUfunction {
        self.raw
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional configuration for a grid-stride kernel over `n` elements: 256 threads a
    /// block, at most `max_blocks` blocks (at least one).
    pub fn for_elements(n: usize, max_blocks: u32) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, max_blocks.max(1) as usize) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

/// A value that can be passed as one kernel parameter.
pub trait KernelParam {
    /// Whether [`raw_param`](Self::raw_param) may run code that is not this crate's (true for
    /// every implementation but the crate's own): a launch with such a parameter treats its
    /// arguments as [`KernelArgs::FOREIGN`].
    #[doc(hidden)]
    const FOREIGN: bool = true;
    /// The C representation passed to the kernel.
    type Raw: Copy;
    /// The value to pass.
    fn raw_param(&self) -> Self::Raw;
    /// The device memory the parameter hands the kernel, and whether the kernel may write it:
    /// the launch orders it (see [`CudaStream::launch`]). `None` for plain values.
    fn buffer_use(&self) -> Option<BufferUse<'_>> {
        None
    }
}

/// Device memory a kernel parameter hands the kernel: which buffer, and whether it is read or
/// written. Only this crate's slices and views make one (`&CudaSlice` and `CudaView` read,
/// `&mut CudaSlice`, `CudaViewMut` and `&mut CudaViewMut` write).
#[derive(Debug, Clone, Copy)]
pub struct BufferUse<'a> {
    memory: &'a Arc<DeviceMemory>,
    use_: Use,
    owner: &'a Arc<CudaStream>,
    pooled: bool,
    address: CUdeviceptr,
}

impl<'a> BufferUse<'a> {
    fn of<T: DeviceRepr>(view: CudaView<'a, T>, use_: Use) -> BufferUse<'a> {
        BufferUse {
            memory: view.memory(),
            use_,
            owner: view.owner(),
            pooled: view.is_pooled(),
            address: view.device_ptr(),
        }
    }
}

macro_rules! scalar_params {
    ($($t:ty),*) => {$(
        impl KernelParam for $t {
            const FOREIGN: bool = false;
            type Raw = $t;
            fn raw_param(&self) -> $t {
                *self
            }
        }
    )*};
}
scalar_params!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, usize);

macro_rules! slice_params {
    ($($ty:ty => $use_:expr),* $(,)?) => {$(
        impl<T: DeviceRepr> KernelParam for $ty {
            const FOREIGN: bool = false;
            type Raw = CUdeviceptr;
            fn raw_param(&self) -> CUdeviceptr {
                self.device_ptr()
            }
            fn buffer_use(&self) -> Option<BufferUse<'_>> {
                Some(BufferUse::of(self.as_view(), $use_))
            }
        }
    )*};
}
slice_params!(
    &CudaSlice<T> => Use::Read,
    &mut CudaSlice<T> => Use::Write,
    CudaView<'_, T> => Use::Read,
    CudaViewMut<'_, T> => Use::Write,
    &mut CudaViewMut<'_, T> => Use::Write,
);

/// The most parameters a launch takes.
pub const MAX_KERNEL_PARAMS: usize = 8;

/// A tuple of kernel parameters, passed in order.
pub trait KernelArgs {
    /// Whether [`with_params`](Self::with_params) may run code that is not this crate's (true
    /// for every implementation but the crate's tuples of the crate's own parameters): the
    /// launch then binds the stream's context again right before `cuLaunchKernel`, and checks
    /// afterwards that the thread's current context was left as it was.
    #[doc(hidden)]
    const FOREIGN: bool = true;

    /// Calls `f` with one pointer per parameter, each valid for the duration of the call.
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
    /// The device memory each parameter hands the kernel (see [`KernelParam::buffer_use`]).
    fn buffer_uses(&self) -> [Option<BufferUse<'_>>; MAX_KERNEL_PARAMS];
}

macro_rules! kernel_args {
    ($($name:ident : $idx:tt),*) => {
        impl<$($name: KernelParam),*> KernelArgs for ($($name,)*) {
            // A tuple runs its parameters' `raw_param`: foreign when any of them is.
            const FOREIGN: bool = $($name::FOREIGN ||)* false;

            #[allow(non_snake_case)]
            fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                $(let mut $name = self.$idx.raw_param();)*
                let mut params = [$((&raw mut $name).cast::<c_void>()),*];
                f(&mut params)
            }
            fn buffer_uses(&self) -> [Option<BufferUse<'_>>; MAX_KERNEL_PARAMS] {
                let mut uses = [None; MAX_KERNEL_PARAMS];
                $(uses[$idx] = self.$idx.buffer_use();)*
                uses
            }
        }
    };
}
impl KernelArgs for () {
    const FOREIGN: bool = false;

    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        f(&mut [])
    }
    fn buffer_uses(&self) -> [Option<BufferUse<'_>>; MAX_KERNEL_PARAMS] {
        [None; MAX_KERNEL_PARAMS]
    }
}
kernel_args!(A: 0);
kernel_args!(A: 0, B: 1);
kernel_args!(A: 0, B: 1, C: 2);
kernel_args!(A: 0, B: 1, C: 2, D: 3);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);

impl CudaStream {
    /// Launches `function` on this stream. Device memory passed as slices and views is ordered
    /// by the crate's rule before the kernel runs and after it (see the `safe` module docs): the
    /// kernel waits for the last write of what it reads and for every use of what it writes, and
    /// later users, including the free of a dropped buffer, wait for the kernel. Memory of another
    /// device must be `cuMemAlloc` memory (pool memory is not peer-mapped); peer access to it is
    /// enabled first.
    ///
    /// # Errors
    /// Checked before anything is enqueued: [`Error::WrongDevice`] when the function's module is
    /// on another device; [`Error::NotPeerReachable`] for pool memory of another device;
    /// [`Error::PeerAccessUnsupported`]. Else the driver's error.
    ///
    /// # Safety
    /// - `args` matches the kernel's parameter list exactly: count, order and each type's size
    ///   and meaning (a slice passes its device address).
    /// - The kernel accesses only memory that `args` give it, within their lengths, and writes
    ///   only memory passed as a mutable slice or view. (Device addresses passed as plain integers
    ///   are not ordered: their ordering is the caller's.)
    /// - The arguments' own code ([`KernelArgs::with_params`], [`KernelParam::raw_param`]), which
    ///   runs during the launch, does not end a capture of this stream. (Beginning one there is
    ///   refused with [`CaptureError::CannotBegin`](crate::CaptureError::CannotBegin).)
    #[doc(alias = "cuLaunchKernel")]
    pub unsafe fn launch<A: KernelArgs>(
        self: &Arc<Self>,
        function: &Function,
        config: LaunchConfig,
        args: A,
    ) -> Result<()> {
        if function.ordinal() != self.ordinal() {
            return Err(Error::WrongDevice {
                what: "CudaStream::launch: the kernel's module must be on the stream's device",
                expected: self.ordinal(),
                found: function.ordinal(),
            });
        }
        let uses = args.buffer_uses();
        for used in uses.iter().flatten().filter(|used| used.owner.ordinal() != self.ordinal()) {
            if used.pooled {
                return Err(Error::NotPeerReachable {
                    what: "CudaStream::launch",
                    device: self.ordinal(),
                    memory_device: used.owner.ordinal(),
                    address: used.address,
                });
            }
            ensure_peer_access(self.context(), used.owner.context())?;
        }
        let tracked = uses.iter().flatten().map(|used| (Tracked::Device(used.memory), used.use_));
        // A caller's kernel-argument code may use the same buffers through this crate: their
        // states are not held locked while it runs.
        ordered_with(self, tracked, !A::FOREIGN, || {
            let launch = |params: &mut [*mut c_void]| {
                // A caller's `with_params` runs its own code first, which may change the current
                // context: the launch binds the stream's again.
                let _bound = if A::FOREIGN { Some(self.context().bind()?) } else { None };
                // SAFETY: the caller guarantees that params match the kernel and that it touches
                // only the memory they give it; function and stream are live and of one context
                // (checked above); that memory is reachable from this device (checked above) and
                // ordered on this stream.
                unsafe {
                    raw::launch_kernel(
                        function.raw,
                        config.grid,
                        config.block,
                        config.shared_mem_bytes,
                        self.raw(),
                        params,
                    )
                }
            };
            if A::FOREIGN {
                // A caller's implementation runs code that is not the crate's own.
                self.run_launch_arguments(|| super::context::outside_call_scope(|| args.with_params(launch)))
            } else {
                args.with_params(launch)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ptx_entries_are_found_with_and_without_parameters() {
        let ptx =
            ".visible .entry ppnrt_trap()\n{\n}\n.visible .entry ppnrt_fill_u32(\n.param .u64 a\n)\n.func helper(\n";
        assert_eq!(super::ptx_entries(ptx), vec!["ppnrt_trap", "ppnrt_fill_u32"]);
        assert!(super::ptx_entries("// no kernels here\n.func f(\n").is_empty());
        assert_eq!(super::ptx_entries(crate::kernels::HELPERS_PTX), ["ppnrt_copy_bytes"]);
    }

    #[test]
    fn launch_configs_cover_every_element_and_respect_the_cap() {
        use super::LaunchConfig;
        let one = LaunchConfig::for_elements(0, 1056);
        assert_eq!((one.grid, one.block), ((1, 1, 1), (256, 1, 1)), "an empty launch still has one block");
        assert_eq!(LaunchConfig::for_elements(256, 1056).grid.0, 1);
        assert_eq!(LaunchConfig::for_elements(257, 1056).grid.0, 2);
        assert_eq!(LaunchConfig::for_elements(1 << 30, 1056).grid.0, 1056, "grid-stride kernels cover the rest");
        assert_eq!(LaunchConfig::for_elements(1 << 30, 0).grid.0, 1, "a zero cap still launches");
    }
}
