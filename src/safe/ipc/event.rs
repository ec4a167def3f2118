//! Interprocess events: [`IpcEvent`], created with `CU_EVENT_INTERPROCESS |
//! CU_EVENT_DISABLE_TIMING` or opened from another process's [`IpcEventHandle`]. Either is a
//! [`CudaEvent`] (through [`Deref`]): recorded, waited on, queried and synchronised with its
//! calls and [`CudaStream::wait`](crate::CudaStream::wait). A wait binds to the most recent
//! record at the time it is enqueued, in whichever process that record was made (module doc).

use std::ops::Deref;
use std::sync::Arc;

use super::IpcSupport;
use crate::cuda_error::{IpcError, Result};
use crate::result::ipc as raw;
use crate::safe::context::Context;
use crate::safe::event::CudaEvent;
use crate::sys::CUipcEventHandle;

/// The 64-byte handle of an interprocess event. Anyone on the host who learns these bytes may
/// open the event and record or wait on it (module doc).
///
/// ```no_run
/// use ppnrt::{Engine, IpcEvent};
///
/// # fn run() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let filled = IpcEvent::new(engine.context())?;
/// let handle = filled.handle()?; // 64 bytes, for the other process (over an authenticated channel)
/// assert_eq!(format!("{handle:?}"), "IpcEventHandle(..)");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcEventHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IpcEventHandle(..)")
    }
}

/// An interprocess event of one context: created here ([`new`](Self::new)) or opened from
/// another process's handle ([`open`](Self::open)). No timing. Dropping it destroys this
/// process's event; the other process's stays valid.
///
/// ```no_run
/// use ppnrt::{Engine, IpcEvent, IpcEventHandle};
///
/// # fn run(from_the_exporter: IpcEventHandle) -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let stream = engine.stream()?;
/// // SAFETY: the exporting process keeps its event until this one is dropped (it says so over the
/// // channel the handle came on, and waits for this process's "done").
/// let filled = unsafe { IpcEvent::open(engine.context(), &from_the_exporter)? };
/// stream.wait(&filled)?; // binds to the exporter's most recent record of it
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct IpcEvent {
    event: CudaEvent,
    opened: bool,
}

static_assertions::assert_impl_all!(IpcEvent: Send, Sync);

fn check_support(what: &'static str, ctx: &Context) -> Result<()> {
    if IpcSupport::of(ctx.device())?.events {
        return Ok(());
    }
    Err(IpcError::Unsupported { what, device: ctx.ordinal(), missing: "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED" }
        .into())
}

impl IpcEvent {
    /// Creates an interprocess event in `ctx`.
    ///
    /// # Errors
    /// [`IpcError::Unsupported`] on a device without interprocess events; the driver's error.
    #[doc(alias = "cuEventCreate")]
    pub fn new(ctx: &Arc<Context>) -> Result<IpcEvent> {
        check_support("IpcEvent::new", ctx)?;
        let _bound = ctx.bind()?;
        let raw = raw::create_interprocess_event()?;
        // SAFETY: a live event of `ctx` created just above, owned by the wrapper only.
        Ok(IpcEvent { event: unsafe { CudaEvent::adopt(ctx, raw, false) }, opened: false })
    }

    /// Opens another process's event from its handle, in `ctx`.
    ///
    /// # Safety
    /// The exporting process must keep its event (not destroy it, and not exit) until this
    /// event is dropped: any operation on an opened event after the exported one was destroyed
    /// is undefined behaviour (CUDA Driver API, `cuIpcOpenEventHandle`: "Performing operations
    /// on the imported event after the exported event has been freed with cuEventDestroy will
    /// result in undefined behavior"). Nothing in this process can check that.
    ///
    /// # Errors
    /// [`IpcError::Unsupported`]; the driver's error (a handle of this process, or no handle).
    #[doc(alias = "cuIpcOpenEventHandle")]
    pub unsafe fn open(ctx: &Arc<Context>, handle: &IpcEventHandle) -> Result<IpcEvent> {
        check_support("IpcEvent::open", ctx)?;
        let _bound = ctx.bind()?;
        let raw = raw::open_event_handle(CUipcEventHandle { reserved: handle.0.map(|b| b as std::os::raw::c_char) })?;
        // SAFETY: a live event opened in `ctx` just above, owned by the wrapper only
        // (cuEventDestroy releases an opened event too).
        Ok(IpcEvent { event: unsafe { CudaEvent::adopt(ctx, raw, false) }, opened: true })
    }

    /// The event's handle, to pass to another process.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuIpcGetEventHandle")]
    pub fn handle(&self) -> Result<IpcEventHandle> {
        let _bound = self.event.context().bind()?;
        // SAFETY: the event is live and interprocess (created or opened as one).
        let raw = unsafe { raw::get_event_handle(self.event.raw())? };
        Ok(IpcEventHandle(raw.reserved.map(|c| c as u8)))
    }

    /// Whether the event was opened from another process's handle.
    pub fn is_opened(&self) -> bool {
        self.opened
    }
}

impl Deref for IpcEvent {
    type Target = CudaEvent;
    fn deref(&self) -> &CudaEvent {
        &self.event
    }
}
