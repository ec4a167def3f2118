//! The ambient stream: a per-thread stream override.
//!
//! While a [`StreamOverride`] lives, [`Engine`](crate::Engine) operations on its thread run on its
//! stream. Guards nest: the newest live guard's stream is the ambient one, and dropping a guard
//! removes exactly its own entry, so guards may be dropped in any order (dropping an older guard
//! first leaves the newer one in force). A guard cannot be sent to another thread (it is `!Send`),
//! so each thread's ambient stream is its own.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;

use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};

thread_local! {
    /// The thread's live overrides, oldest first, each with the id of its guard.
    static AMBIENT: RefCell<Vec<(u64, Arc<CudaStream>)>> = const { RefCell::new(Vec::new()) };
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// Sets the calling thread's ambient stream until dropped.
///
/// ```no_run
/// use std::sync::Arc;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let side = ppnrt::CudaStream::new(engine.context())?;
/// {
///     let _on_side = ppnrt::StreamOverride::new(side.clone())?;
///     assert!(Arc::ptr_eq(&engine.stream()?, &side)); // the engine's calls run on `side` here
/// }
/// assert!(Arc::ptr_eq(&engine.stream()?, engine.default_stream()));
/// # Ok(()) }
/// ```
#[must_use = "the override ends when the guard drops"]
#[derive(Debug)]
pub struct StreamOverride {
    id: u64,
    _not_send: PhantomData<*const ()>,
}

impl StreamOverride {
    /// Makes `stream` the calling thread's ambient stream until the guard drops.
    ///
    /// # Errors
    /// [`CudaError::ThreadExiting`] when called from a thread-local destructor after this crate's
    /// thread state is gone.
    pub fn new(stream: Arc<CudaStream>) -> Result<StreamOverride> {
        let gone = |_| CudaError::ThreadExiting { what: "StreamOverride::new" };
        let id = NEXT_ID.try_with(|next| {
            let id = next.get();
            next.set(id + 1);
            id
        });
        let id = id.map_err(gone)?;
        AMBIENT.try_with(|stack| stack.borrow_mut().push((id, stream))).map_err(gone)?;
        Ok(StreamOverride { id, _not_send: PhantomData })
    }
}

impl Drop for StreamOverride {
    fn drop(&mut self) {
        // `try_with` tolerates a guard dropped during thread teardown.
        let _ = AMBIENT.try_with(|stack| {
            let mut stack = stack.borrow_mut();
            if let Some(at) = stack.iter().rposition(|(id, _)| *id == self.id) {
                stack.remove(at);
            }
        });
    }
}

/// The calling thread's ambient stream, if an override is active.
///
/// # Errors
/// [`CudaError::ThreadExiting`] when called from a thread-local destructor after this crate's thread
/// state is gone.
pub fn ambient_stream() -> Result<Option<Arc<CudaStream>>> {
    with_ambient_stream(|stream| Ok(stream?.cloned()))
}

/// Runs `f` with the calling thread's ambient stream (if an override is active) borrowed, not
/// shared: no reference count moves. The override stack stays borrowed while `f` runs, so `f`
/// must not begin or end an override on this thread (it would panic); the crate's own
/// operations never do. `f` is given [`CudaError::ThreadExiting`] instead when called from a
/// thread-local destructor after this crate's thread state is gone.
#[inline]
pub(crate) fn with_ambient_stream<R>(f: impl FnOnce(Result<Option<&Arc<CudaStream>>>) -> R) -> R {
    // `f` runs once: inside the thread-local's access, or after it when the state is gone.
    let mut f = Some(f);
    let run = |stack: &RefCell<Vec<(u64, Arc<CudaStream>)>>| {
        let f = f.take().expect("runs once");
        f(Ok(stack.borrow().last().map(|(_, stream)| stream)))
    };
    match AMBIENT.try_with(run) {
        Ok(result) => result,
        Err(_) => (f.take().expect("not run: the thread's state is gone"))(Err(CudaError::ThreadExiting {
            what: "ambient_stream",
        })),
    }
}
