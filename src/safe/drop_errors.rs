//! Errors raised inside `Drop`, kept for the application to inspect.

use std::sync::Mutex;

use crate::cuda_error::CudaError;
use crate::sys::CUresult;

/// An error raised inside `Drop`: one of the crate's errors, of whichever layer dropped.
///
/// ```
/// // Errors that a `Drop` could not return, collected when convenient (after a step, at exit).
/// for error in ppnrt::take_drop_errors() {
///     eprintln!("while dropping: {}", ppnrt::error::chain(&*error));
/// }
/// ```
pub type DropError = Box<dyn std::error::Error + Send + Sync + 'static>;

const KEPT: usize = 64;
static DROP_ERRORS: Mutex<Vec<DropError>> = Mutex::new(Vec::new());

/// Keeps an error raised while dropping a handle. A driver that is already shut down
/// (`CUDA_ERROR_DEINITIALIZED`, seen at process exit) is not an error worth keeping.
pub(crate) fn record_drop_error(error: impl std::error::Error + Send + Sync + 'static) {
    let error: DropError = Box::new(error);
    if let Some(CudaError::Driver(e)) = error.downcast_ref::<CudaError>() {
        if e.code == CUresult::CUDA_ERROR_DEINITIALIZED {
            return;
        }
    }
    if let Ok(mut kept) = DROP_ERRORS.lock() {
        if kept.len() < KEPT {
            kept.push(error);
        }
    }
}

/// Takes the errors raised by `Drop` implementations since the last call (at most the first 64).
pub fn take_drop_errors() -> Vec<DropError> {
    DROP_ERRORS.lock().map(|mut kept| std::mem::take(&mut *kept)).unwrap_or_default()
}
