//! Peer access between devices.
//!
//! Enabling is a property of two contexts and lasts as long as they do; it is idempotent and
//! leaves the calling thread's current context as it was.

use super::context::Context;
use crate::error::{Error, Result};
use crate::result::{context as raw_ctx, device as raw_dev};
use crate::sys::{CUcontext, CUresult};

/// Enables peer access in both directions between the contexts of two devices: each may then
/// read and write the other's `cuMemAlloc` memory directly, and copies between them take the
/// direct link. Already-enabled access is success; the calling thread's current context is the
/// same afterwards as before. Enabling a device with itself does nothing.
///
/// # Errors
/// [`Error::PeerAccessUnsupported`] when the devices cannot reach each other; the driver's error.
#[doc(alias = "cuCtxEnablePeerAccess")]
pub fn enable_peer_access(a: &Context, b: &Context) -> Result<()> {
    if a.ordinal() == b.ordinal() {
        return Ok(());
    }
    for (from, to) in [(a, b), (b, a)] {
        if !raw_dev::can_access_peer(from.device().raw(), to.device().raw())? {
            return Err(Error::PeerAccessUnsupported { from: from.ordinal(), to: to.ordinal() });
        }
    }
    enable_one_way(a, b).and_then(|()| enable_one_way(b, a))
}

fn enable_one_way(from: &Context, to: &Context) -> Result<()> {
    let _bound = from.bind()?;
    let peer: CUcontext = to.raw();
    // SAFETY: `peer` is a live, retained primary context.
    match unsafe { raw_ctx::enable_peer_access(peer) } {
        Err(Error::Driver(e)) if e.code == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => other,
    }
}
