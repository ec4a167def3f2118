//! Kernel launch: [`CudaStream::launch`] (this file's `impl CudaStream` block, the launch's
//! home), with its [`LaunchConfig`], orders the device memory its parameters hand the kernel
//! through the one door (`enqueue`) and makes the parameters' C values. The parameter model is
//! `param` ([`KernelParam`], [`BufferUse`], [`ByValue`]), tuples of parameters `args`
//! ([`KernelArgs`]), lists of any number `list` ([`KernelArgList`]). Whose code the arguments run
//! is the crate's knowledge alone, sealed here (`own`).

use std::ffi::c_void;
use std::sync::Arc;

use super::context::outside_call_scope;
use super::enqueue::{Tracked, ordered_with};
use super::module::Function;
use super::peer::ensure_peer_access;
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};
use crate::result::module as raw;

pub use args::{BufferUses, KernelArgs, MAX_KERNEL_PARAMS};
pub use list::KernelArgList;
pub use param::{BufferUse, ByValue, KernelParam, by_value};

mod args;
mod list;
mod param;

/// The launch's knowledge of whose code kernel arguments run, sealed.
mod own {
    use std::marker::PhantomData;

    /// The crate's word that the code of a [`KernelParam`](super::KernelParam) or
    /// [`KernelArgs`](super::KernelArgs) implementation is its own (a launch of such arguments
    /// takes its fast path: no rebinding of the context around the arguments' code). Only this
    /// crate can make one, and only of its own types: an implementation of a caller's cannot
    /// name the type, make a value of it, or take another type's (each is of its own `T`).
    pub struct Own<T: ?Sized>(PhantomData<fn() -> *const T>);

    impl<T: ?Sized> Own<T> {
        /// Vouches for `T`'s code: the crate's own implementations only.
        pub(crate) const fn vouch() -> Own<T> {
            Own(PhantomData)
        }

        /// `Some` exactly when `own` is.
        pub(crate) const fn like<U: ?Sized>(own: &Option<Own<U>>) -> Option<Own<T>> {
            if own.is_some() { Some(Own::vouch()) } else { None }
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
///
/// ```
/// use ppnrt::LaunchConfig;
///
/// // A grid-stride kernel over a million elements, at most 1024 blocks of 256 threads.
/// let config = LaunchConfig::for_elements(1 << 20, 1024);
/// assert_eq!((config.grid, config.block), ((1024, 1, 1), (256, 1, 1)));
/// // Or every dimension by hand.
/// let tiles = LaunchConfig { grid: (32, 32, 1), block: (16, 16, 1), shared_mem_bytes: 2048 };
/// # let _ = tiles;
/// ```
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
    #[inline]
    pub fn for_elements(n: usize, max_blocks: u32) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, max_blocks.max(1) as usize) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl CudaStream {
    /// Checks that this stream's device may reach the memory of other devices in `uses` (not pool
    /// memory; peer access enabled first): [`CudaError::NotPeerReachable`], else the error of
    /// enabling peer access.
    #[cold]
    #[inline(never)]
    fn reach_other_devices(&self, uses: &[BufferUse<'_>]) -> Result<()> {
        for used in uses.iter().filter(|used| used.owner().ordinal() != self.ordinal()) {
            if used.memory.is_pooled() {
                return Err(CudaError::NotPeerReachable {
                    what: "CudaStream::launch",
                    device: self.ordinal(),
                    memory_device: used.owner().ordinal(),
                    address: used.address,
                });
            }
            ensure_peer_access(self.context(), used.owner().context())?;
        }
        Ok(())
    }

    /// `cuLaunchKernel` of `function` with `config` and `params` on this stream: the launch itself,
    /// once its parameters are made and its buffers ordered ([`launch`](Self::launch)).
    ///
    /// # Safety
    /// `params` match the kernel's parameter list; the kernel touches only memory they give it,
    /// which is reachable from this stream's device and ordered on this stream; `function` is of
    /// this stream's device.
    #[inline(always)]
    pub(super) unsafe fn launch_ordered(
        &self,
        function: &Function,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller meets the contract above; function and stream are live (borrowed).
        unsafe {
            raw::launch_kernel_dims(
                function.raw(),
                &config.grid,
                &config.block,
                &config.shared_mem_bytes,
                self.raw(),
                params,
            )
        }
    }

    /// Launches `function` on this stream. Device memory passed as slices and views is ordered
    /// by the crate's rule before the kernel runs and after it (see the `safe` module docs): the
    /// kernel waits for the last write of what it reads and for every use of what it writes, and
    /// later users, including the free of a dropped buffer, wait for the kernel. Memory of another
    /// device must be `cuMemAlloc` memory (pool memory is not peer-mapped); peer access to it is
    /// enabled first.
    ///
    /// # Errors
    /// Checked before anything is enqueued: [`CudaError::WrongDevice`] when the function's module is
    /// on another device; [`CudaError::NotPeerReachable`] for pool memory of another device;
    /// [`CudaError::PeerAccessUnsupported`]. Else the driver's error.
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
            return Err(CudaError::WrongDevice {
                what: "CudaStream::launch: the kernel's module must be on the stream's device",
                expected: self.ordinal(),
                found: function.ordinal(),
            });
        }
        let mut uses = BufferUses::default();
        args.collect_buffer_uses(&mut uses);
        let uses = &uses.0;
        if uses.iter().any(|used| used.owner().ordinal() != self.ordinal()) {
            self.reach_other_devices(uses)?;
        }
        let tracked = uses.iter().map(|used| (Tracked::Device(used.memory), used.use_));
        if A::OWN.is_some() || args.own().is_some() {
            // The crate's own parameters (a tuple of them, or a list that holds only them): their
            // values are made first (no caller code runs), and the buffers' states stay locked
            // from the waits to the notes around the launch alone.
            return args.with_params(
                #[inline(always)]
                |params| {
                    // SAFETY: as below; the parameters' code is the crate's own.
                    ordered_with(
                        self,
                        tracked,
                        true,
                        #[inline(always)]
                        || unsafe { self.launch_ordered(function, &config, params) },
                    )
                },
            );
        }
        let foreign = args.own().is_none();
        // A caller's kernel-argument code may use the same buffers through this crate: their
        // states are not held locked while it runs.
        ordered_with(self, tracked, !foreign, || {
            let launch = |params: &mut [*mut c_void]| {
                // A caller's `with_params` runs its own code first, which may change the current
                // context: the launch binds the stream's again.
                let _bound = if foreign { Some(self.context().bind()?) } else { None };
                // SAFETY: the caller guarantees that params match the kernel and that it touches
                // only the memory they give it; function and stream are of one device (checked
                // above), the memory reachable from it (checked above) and ordered on this stream
                // (by `ordered_with`, around this call).
                unsafe { self.launch_ordered(function, &config, params) }
            };
            if foreign {
                // A caller's implementation runs code that is not the crate's own.
                self.run_launch_arguments(|| outside_call_scope(|| args.with_params(launch)))
            } else {
                args.with_params(launch)
            }
        })
    }
}

#[cfg(test)]
mod tests {
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
