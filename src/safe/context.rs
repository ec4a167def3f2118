//! Primary contexts.
//!
//! The crate works in each device's primary context, the one the runtime API (cuBLAS, PyTorch)
//! uses too, so streams and memory can be shared with those libraries. A [`Context`] holds one
//! reference on it (`cuDevicePrimaryCtxRetain`) and gives it back on drop.

use std::sync::Arc;

use super::device::Device;
use crate::error::Result;
use crate::result::{context as raw, memory};
use crate::sys::{CUcontext, CUmemPool_attribute};

/// A retained primary context of one device.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: CUcontext,
}

// SAFETY: a CUcontext handle may be bound and used from any thread; the driver serialises what
// needs it. Context holds no thread-affine state.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes &self and calls thread-safe driver entry points.
unsafe impl Sync for Context {}

impl Context {
    /// Retains `device`'s primary context and raises its default memory pool's release threshold
    /// to the maximum, so that stream-ordered allocations are not given back to the OS (and
    /// re-mapped) at every synchronisation.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDevicePrimaryCtxRetain")]
    pub fn primary(device: &Device) -> Result<Arc<Context>> {
        let raw_ctx = raw::primary_retain(device.raw())?;
        let ctx = Arc::new(Context { device: *device, raw: raw_ctx });
        ctx.bind()?;
        if device.memory_pools_supported()? {
            let pool = memory::default_mem_pool(device.raw())?;
            // SAFETY: the pool is the device's live default pool and the release threshold is a
            // cuuint64_t attribute.
            unsafe {
                memory::mem_pool_set_u64(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)?;
            }
        }
        Ok(ctx)
    }

    /// Makes this context current on the calling thread.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuCtxSetCurrent")]
    #[inline]
    pub fn bind(&self) -> Result<()> {
        // SAFETY: self.raw is retained for as long as self lives.
        unsafe { raw::set_current(self.raw) }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.device.ordinal()
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// Waits for all work in the context.
    ///
    /// # Errors
    /// The driver's error, including errors of earlier asynchronous work.
    #[doc(alias = "cuCtxSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        raw::synchronize()
    }

    /// `(free, total)` bytes of the device's memory.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuMemGetInfo")]
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        memory::get_info()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: this gives back the one reference `primary` took; every handle that uses the
        // context holds an Arc<Context>, so none is left.
        if let Err(e) = unsafe { raw::primary_release(self.device.raw()) } {
            super::record_drop_error(e);
        }
    }
}
