//! The ambient stream: a per-thread stream override.
//!
//! While a [`StreamOverride`] lives, [`Engine`](crate::Engine) operations on its thread run on its
//! stream. Guards nest: dropping the innermost restores the one before. A guard cannot be sent to
//! another thread (it is `!Send`), so each thread's ambient stream is its own.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use super::stream::CudaStream;

thread_local! {
    static AMBIENT: RefCell<Vec<Arc<CudaStream>>> = const { RefCell::new(Vec::new()) };
}

/// Sets the calling thread's ambient stream until dropped.
#[must_use = "the override ends when the guard drops"]
#[derive(Debug)]
pub struct StreamOverride {
    depth: usize,
    _not_send: PhantomData<*const ()>,
}

impl StreamOverride {
    /// Makes `stream` the calling thread's ambient stream until the guard drops.
    pub fn new(stream: Arc<CudaStream>) -> StreamOverride {
        let depth = AMBIENT.with(|stack| {
            let mut stack = stack.borrow_mut();
            stack.push(stream);
            stack.len() - 1
        });
        StreamOverride { depth, _not_send: PhantomData }
    }
}

impl Drop for StreamOverride {
    fn drop(&mut self) {
        // Truncating (rather than popping) keeps the stack right even if guards are dropped out
        // of order: dropping an outer guard ends the inner ones with it. `try_with` tolerates a
        // guard dropped during thread teardown.
        let _ = AMBIENT.try_with(|stack| stack.borrow_mut().truncate(self.depth));
    }
}

/// The calling thread's ambient stream, if an override is active.
pub fn ambient_stream() -> Option<Arc<CudaStream>> {
    AMBIENT.with(|stack| stack.borrow().last().cloned())
}
