//! Peer access between devices.
//!
//! Enabling is a property of two contexts and lasts as long as they do; it is idempotent and
//! leaves the calling thread's current context as it was.

use std::sync::Arc;

use super::context::Context;
use crate::cuda_error::{CudaError, Result};
use crate::result::{context as raw_ctx, device as raw_dev};
use crate::sys::{CUcontext, CUresult};

/// Enables peer access in both directions between the contexts of two devices: each may then
/// read and write the other's `cuMemAlloc` memory directly, and copies between them take the
/// direct link. Already-enabled access is success; the calling thread's current context is the
/// same afterwards as before. Enabling a device with itself does nothing.
///
/// # Errors
/// [`CudaError::PeerAccessUnsupported`] when the devices cannot reach each other; the driver's error.
#[doc(alias = "cuCtxEnablePeerAccess")]
pub fn enable_peer_access(a: &Context, b: &Context) -> Result<()> {
    if a.ordinal() == b.ordinal() {
        return Ok(());
    }
    for (from, to) in [(a, b), (b, a)] {
        if !raw_dev::can_access_peer(from.device().raw(), to.device().raw())? {
            return Err(CudaError::PeerAccessUnsupported { from: from.ordinal(), to: to.ordinal() });
        }
    }
    enable_one_way(a, b).and_then(|()| enable_one_way(b, a))
}

/// [`enable_peer_access`] once per pair of live contexts: later calls for the same pair find it
/// recorded in `a` and make no driver call (kernel launches that reach a peer's memory call this
/// per launch).
///
/// # Errors
/// As [`enable_peer_access`].
pub(crate) fn ensure_peer_access(a: &Arc<Context>, b: &Arc<Context>) -> Result<()> {
    let known =
        |peers: &[std::sync::Weak<Context>]| peers.iter().any(|p| p.upgrade().is_some_and(|p| Arc::ptr_eq(&p, b)));
    if known(&a.peers()) {
        return Ok(());
    }
    enable_peer_access(a, b)?;
    let mut peers = a.peers();
    peers.retain(|p| p.strong_count() > 0);
    if !known(&peers) {
        peers.push(Arc::downgrade(b));
    }
    Ok(())
}

fn enable_one_way(from: &Context, to: &Context) -> Result<()> {
    let _bound = from.bind()?;
    let peer: CUcontext = to.raw();
    // SAFETY: `peer` is a live, retained primary context.
    match unsafe { raw_ctx::enable_peer_access(peer) } {
        Err(CudaError::Driver(e)) if e.code == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => other,
    }
}
