//! Primary contexts.
//!
//! The crate works in each device's primary context, the one the runtime API (cuBLAS, PyTorch)
//! uses too, so streams and memory can be shared with those libraries. A [`Context`] holds one
//! reference on it (`cuDevicePrimaryCtxRetain`) and gives it back on drop.
//!
//! The calling thread's current context is the caller's: every call of this crate binds the
//! context it needs through [`Context::bind`], whose guard puts back what was current when the
//! call returns. So cuBLAS, PyTorch or any runtime-API code on the same thread keeps its current
//! device across calls into this crate. Binding costs one `cuCtxGetCurrent` when the context is
//! already current, plus two `cuCtxSetCurrent` when it is not; inside
//! [`Context::bound_unchecked`] (a call scope the caller opens, vouching that nothing but this
//! crate changes the current context meanwhile) the calls for its context cost neither.
//!
//! A thread's call scope (`CALL_SCOPE`) names the context that the innermost scope made current;
//! each time the crate makes a context current inside it, the scope is marked suspended if that
//! is another context and resumed if it is the scope's own, so a scope never vouches for a
//! context that is not current.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};

use super::device::Device;
use crate::cuda_error::{CudaError, Result};
use crate::result::event as raw_event;
use crate::result::{context as raw, memory};
use crate::sys::{CUcontext, CUevent, CUmemPool_attribute};

/// A retained primary context of one device.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let device = ppnrt::Device::get(0)?;
/// let ctx = ppnrt::Context::primary(&device)?; // shared with every other user of the device
/// let (free, total) = ctx.memory_info()?;
/// println!("device {}: {free} of {total} bytes free", ctx.ordinal());
/// let stream = ppnrt::CudaStream::new(&ctx)?;
/// # drop(stream);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: CUcontext,
    pools: bool,
    /// The event pool's storage: idle events (timing disabled) for the ordering rule, reused
    /// instead of created per use (the pool is `event_pool`'s; the idle events are destroyed
    /// with the context).
    events: Mutex<Vec<CUevent>>,
    /// Contexts whose memory this one's kernels may reach (peer access enabled both ways). Weak:
    /// an entry counts only while its context lives (and keeps its primary context retained).
    peers: Mutex<Vec<Weak<Context>>>,
    /// The device's support of 64-bit stream memory operations and of remote-write flushes,
    /// queried once (`stream_memops` reads it for every operation).
    mem_ops: std::sync::OnceLock<(bool, bool)>,
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
    /// The driver's error; [`CudaError::Misaligned`] for a context handle whose lowest bit is set
    /// (the crate uses that bit; a driver's handles are pointers to its objects, which have none).
    #[doc(alias = "cuDevicePrimaryCtxRetain")]
    pub fn primary(device: &Device) -> Result<Arc<Context>> {
        let raw_ctx = raw::primary_retain(device.raw())?;
        if raw_ctx.addr() & SUSPENDED != 0 {
            // The thread's call scope marks a suspended scope in the handle's lowest bit: a
            // handle with that bit set would read as a suspended scope of another.
            // SAFETY: gives back the reference just taken; nothing uses the handle.
            if let Err(e) = unsafe { raw::primary_release(device.raw()) } {
                super::record_drop_error(e);
            }
            return Err(CudaError::Misaligned {
                what: "Context::primary: the driver's context handle (its lowest bit marks a suspended call scope)",
                address: raw_ctx.addr() as u64,
                align: 2,
            });
        }
        // From here on the reference is given back by Context's drop, on every path.
        let mut ctx = Context {
            device: *device,
            raw: raw_ctx,
            pools: false,
            events: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
            mem_ops: std::sync::OnceLock::new(),
        };
        ctx.pools = device.memory_pools_supported()?;
        if ctx.pools {
            let _bound = ctx.bind()?;
            let pool = memory::default_mem_pool(device.raw())?;
            // SAFETY: the pool is the device's live default pool and the release threshold is a
            // cuuint64_t attribute.
            unsafe {
                memory::mem_pool_set_u64(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)?;
            }
        }
        Ok(Arc::new(ctx))
    }

    /// Whether the device has stream-ordered memory pools. Without them, [`CudaSlice::alloc`](crate::CudaSlice::alloc) falls back to `cuMemAlloc` memory, freed once its owning stream
    /// drained.
    pub fn memory_pools_supported(&self) -> bool {
        self.pools
    }

    /// Makes this context current on the calling thread until the returned guard drops; the
    /// guard then makes current again whatever was current before (nothing is changed when this
    /// context already was).
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuCtxSetCurrent")]
    #[doc(alias = "cuCtxGetCurrent")]
    #[inline]
    pub fn bind(&self) -> Result<BoundContext<'_>> {
        if self.in_call_scope() {
            // Inside one of this crate's calls that bound this context (see `bind_for_call`).
            return Ok(BoundContext { restore: None, scope: None, _ctx: PhantomData });
        }
        self.make_current()
    }

    /// Whether the calling thread is inside one of this crate's calls that bound this context
    /// ([`bind_for_call`](Self::bind_for_call)): the context is current and stays so.
    #[inline]
    fn in_call_scope(&self) -> bool {
        CALL_SCOPE.try_with(Cell::get).is_ok_and(|scope| scope == self.raw)
    }

    /// [`bind`](Self::bind) outside a call scope of this context: asks the driver. A switch to
    /// this context suspends the thread's call scope of another context (no longer current) and
    /// resumes a suspended scope of this one ([`note_current`]). The query inline, the switch out
    /// of line: a thread that has the context current already (a stage's, bound around its
    /// loop) pays for the query alone.
    #[inline(always)]
    fn make_current(&self) -> Result<BoundContext<'_>> {
        let previous = raw::get_current()?;
        if previous == self.raw {
            return Ok(BoundContext { restore: None, scope: None, _ctx: PhantomData });
        }
        self.switch_from(previous)
    }

    /// [`make_current`](Self::make_current) when `previous` is current, not this context.
    #[inline(never)]
    fn switch_from(&self, previous: CUcontext) -> Result<BoundContext<'_>> {
        // SAFETY: self.raw is retained for as long as self lives.
        unsafe { raw::set_current(self.raw)? };
        note_current(self.raw);
        Ok(BoundContext { restore: Some(previous), scope: None, _ctx: PhantomData })
    }

    /// Runs `f` with this context current on the calling thread, and every call of this crate
    /// that `f` makes on this thread for this context trusts it to be current: none asks the
    /// driver which context is (`cuCtxGetCurrent`) or binds it again. For a loop that issues
    /// work for one device from its own thread (a stage's decode loop), where each call would
    /// otherwise query the driver once. When `f` returns (or unwinds), whatever was current
    /// before is current again.
    ///
    /// A binding of another context inside `f` through this crate ([`bind`](Self::bind), calls
    /// on another device's streams) is seen: until it is undone, calls for this context query the
    /// driver again.
    ///
    /// # Errors
    /// The driver's error from binding this context; `f` does not run then.
    ///
    /// # Safety
    /// Until `f` returns, no code on this thread changes the current context other than through
    /// this crate (no `cuCtxSetCurrent`, `cuCtxPushCurrent`/`cuCtxPopCurrent` or
    /// `cudaSetDevice` to another device from another library), or it makes this context current
    /// again before its next call of this crate. (Kernel-argument code of the caller's that a
    /// launch runs, [`KernelArgs`](crate::KernelArgs) or [`KernelParam`](crate::KernelParam), may
    /// change it: the launch binds its stream's context again and puts this one back.) The
    /// crate's calls inside `f` create events, modules and memory in the context they believe
    /// current: if it is another device's, work fails or memory lands on the wrong device.
    #[doc(alias = "cuCtxSetCurrent")]
    pub unsafe fn bound_unchecked<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let _scope = self.bind_for_call()?;
        Ok(f())
    }

    /// Like [`bind`](Self::bind), for the whole of one of this crate's calls: while the guard
    /// lives, nested binds of this context on this thread make no driver call. Only for scopes
    /// that run no code but the crate's own (no user closure, no other library), or a caller's
    /// under [`bound_unchecked`](Self::bound_unchecked)'s contract, so that nothing can change
    /// the current context behind the scope's back.
    #[inline(always)]
    pub(crate) fn bind_for_call(&self) -> Result<BoundContext<'_>> {
        if self.in_call_scope() {
            // Inside a call scope of this context already: nothing to bind, no scope to open.
            return Ok(BoundContext { restore: None, scope: None, _ctx: PhantomData });
        }
        let mut guard = self.make_current()?;
        guard.scope = CALL_SCOPE.try_with(|scope| scope.replace(self.raw)).ok();
        Ok(guard)
    }

    /// Runs `f`, a call into another library that may make this context current itself (cudarc
    /// binds its context, the device's primary context, before its driver calls, and restores
    /// nothing), under the crate's one context rule: this context is made current first, noted as
    /// [`bind`](Self::bind) notes it (so `f` finds it current and switches nothing), and when `f`
    /// returns or unwinds, whatever was current before is current again (asked of the driver,
    /// whatever `f` did) and the thread's call scope is marked for it. `f` always runs; a failed
    /// query or switch is recorded ([`take_drop_errors`](crate::take_drop_errors)) and leaves the
    /// thread's call scope suspended (what is current is not known).
    pub(crate) fn call_foreign<R>(&self, f: impl FnOnce() -> R) -> R {
        let restore = match raw::get_current() {
            Ok(previous) => {
                if previous != self.raw {
                    // SAFETY: self.raw is retained for as long as self lives.
                    match unsafe { raw::set_current(self.raw) } {
                        Ok(()) => note_current(self.raw),
                        Err(e) => {
                            suspend_call_scope();
                            super::record_drop_error(e);
                        }
                    }
                }
                Some(ForeignCallRestore { previous })
            }
            Err(e) => {
                suspend_call_scope();
                super::record_drop_error(e);
                None
            }
        };
        let result = f();
        drop(restore);
        result
    }

    /// The contexts recorded by the crate's peer-access cache (`ensure_peer_access`), locked.
    pub(crate) fn peers(&self) -> MutexGuard<'_, Vec<Weak<Context>>> {
        self.peers.lock()
    }

    /// The storage of this context's event pool (`event_pool`), locked.
    #[inline]
    pub(crate) fn pooled_events(&self) -> MutexGuard<'_, Vec<CUevent>> {
        self.events.lock()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The cell of the device's stream-memory-operation support (see `stream_memops`).
    pub(crate) fn mem_ops_cell(&self) -> &std::sync::OnceLock<(bool, bool)> {
        &self.mem_ops
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
        let _bound = self.bind()?;
        raw::synchronize()
    }

    /// `(free, total)` bytes of the device's memory.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuMemGetInfo")]
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        let _bound = self.bind()?;
        memory::get_info()
    }
}

/// The guard of [`Context::bind`]: while it lives the context is current on this thread; when it
/// drops, the context that was current before is current again. Not `Send`: the binding is the
/// thread's.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// {
///     let _bound = engine.context().bind()?; // current on this thread
///     // ... a call of another CUDA library that works on the current context ...
/// } // whatever was current before is current again
/// # Ok(()) }
/// ```
#[must_use = "the context is unbound again when the guard drops"]
#[derive(Debug)]
pub struct BoundContext<'a> {
    restore: Option<CUcontext>,
    /// For a call scope: the scope it replaced.
    scope: Option<CUcontext>,
    _ctx: PhantomData<(&'a Context, *const ())>,
}

/// Runs code that is not the crate's own (a caller's trait implementation) inside a call scope:
/// nested binds meanwhile go to the driver, and when `f` returns, the scope's context is made
/// current again if `f` changed the current context.
pub(crate) fn outside_call_scope<R>(f: impl FnOnce() -> R) -> R {
    let scope = CALL_SCOPE.try_with(|scope| scope.replace(std::ptr::null_mut())).unwrap_or(std::ptr::null_mut());
    let result = f();
    if !scope.is_null() {
        let _ = CALL_SCOPE.try_with(|cell| cell.set(scope));
        // A suspended scope's context is not the current one: nothing to put back.
        if !is_suspended(scope) && !raw::get_current().is_ok_and(|current| current == scope) {
            // SAFETY: the scope's context is retained by the guard that opened the scope, which
            // outlives this call.
            let restored = unsafe { raw::set_current(scope) };
            if let Err(e) = restored {
                suspend_call_scope();
                super::record_drop_error(e);
            }
        }
    }
    result
}

thread_local! {
    /// The context that the innermost live call scope on this thread made current (null outside
    /// any), so that nested binds inside it make no driver call; marked suspended (see
    /// [`suspended`]) while a binding inside the scope has made another context current.
    static CALL_SCOPE: Cell<CUcontext> = const { Cell::new(std::ptr::null_mut()) };
}

/// The mark of a suspended call scope: the lowest bit of its context's handle. No [`Context`]
/// holds a handle with that bit set ([`Context::primary`] refuses one), so a marked scope equals
/// no context's handle and no context is taken for a suspended scope of another.
const SUSPENDED: usize = 1;

/// `scope` marked suspended (null stays null: no scope to suspend).
fn suspended(scope: CUcontext) -> CUcontext {
    if scope.is_null() { scope } else { scope.map_addr(|addr| addr | SUSPENDED) }
}

/// Whether `scope` is marked suspended.
fn is_suspended(scope: CUcontext) -> bool {
    scope.addr() & SUSPENDED != 0
}

/// The one rule of the mark: after the crate has made `now` current on this thread, the thread's
/// call scope holds (unmarked) exactly when `now` is its context, and is suspended otherwise. So
/// a scope is resumed only by making its own context current, and suspended again by any later
/// switch away, whatever the order of the bindings in between.
#[inline]
fn note_current(now: CUcontext) {
    let _ = CALL_SCOPE.try_with(|scope| {
        let held = scope.get().map_addr(|addr| addr & !SUSPENDED);
        if !held.is_null() {
            scope.set(if held == now { held } else { suspended(held) });
        }
    });
}

/// Marks the thread's call scope suspended (after a failed switch: what is current is unknown).
fn suspend_call_scope() {
    let _ = CALL_SCOPE.try_with(|scope| scope.set(suspended(scope.get())));
}

/// Puts back, after another library's call ([`Context::call_foreign`]), the context that was
/// current before it, also when the call unwinds.
struct ForeignCallRestore {
    previous: CUcontext,
}

impl Drop for ForeignCallRestore {
    fn drop(&mut self) {
        let restored = raw::get_current().and_then(|current| {
            if current == self.previous {
                return Ok(());
            }
            // SAFETY: `previous` was current on this thread before the call (or null, which
            // unbinds); the caller's context stays retained by whoever made it current.
            unsafe { raw::set_current(self.previous) }
        });
        match restored {
            Ok(()) => note_current(self.previous),
            Err(e) => {
                suspend_call_scope();
                super::record_drop_error(e);
            }
        }
    }
}

impl Drop for BoundContext<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some(outer) = self.scope {
            // Closes the guard's call scope.
            let _ = CALL_SCOPE.try_with(|scope| scope.set(outer));
        }
        if self.restore.is_some() {
            self.restore_previous();
        }
    }
}

impl BoundContext<'_> {
    /// Makes the previous context current again.
    #[inline(never)]
    fn restore_previous(&mut self) {
        if let Some(previous) = self.restore {
            // SAFETY: `previous` was current on this thread when the guard was made (or null,
            // which unbinds); nothing this crate does in between releases another context.
            match unsafe { raw::set_current(previous) } {
                Ok(()) => note_current(previous),
                Err(e) => {
                    // What is current now is not known: the scope holds no longer.
                    suspend_call_scope();
                    super::record_drop_error(e);
                }
            }
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let events = std::mem::take(&mut *self.pooled_events());
        if !events.is_empty() {
            let destroyed = self.bind().and_then(|_bound| {
                events.into_iter().try_for_each(|event| {
                    // SAFETY: a pooled event belongs to no PooledEvent any more (each returns its
                    // handle when dropped, and each holds this context alive until then).
                    unsafe { raw_event::destroy(event) }
                })
            });
            if let Err(e) = destroyed {
                super::record_drop_error(e);
            }
        }
        // SAFETY: this gives back the one reference `primary` took; every handle that uses the
        // context holds an Arc<Context>, so none is left.
        if let Err(e) = unsafe { raw::primary_release(self.device.raw()) } {
            super::record_drop_error(e);
        }
    }
}
