//! Thin wrappers: one function per driver call, returning the typed [`CudaError`](crate::CudaError).
//!
//! Each function makes exactly the call it is named after, through the process's loaded
//! [`Driver`](crate::loader::Driver); it binds no context and keeps no state. Functions that take
//! raw handles or pointers are `unsafe`, and their `# Safety` section is the driver call's own
//! contract. Grouped by resource, as the driver API documentation groups them.

pub mod context;
pub mod device;
pub mod event;
pub mod graph;
pub mod ipc;
pub mod memory;
pub mod module;
pub mod stream;

/// Calls the driver entry point `$name` with `$args` and maps its result code.
///
/// Expands to an `unsafe` call: the enclosing function is responsible for the arguments meeting
/// the entry point's contract (it is either `unsafe` itself, with a `# Safety` section, or builds
/// arguments that meet it).
macro_rules! driver_call {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let driver = $crate::loader::driver()?;
        match driver.api().$name.as_ref() {
            Ok(entry) => {
                // SAFETY: the entry point has the C signature bindgen generated from cuda.h, and
                // the enclosing function's contract (or construction) makes the arguments valid.
                let code = unsafe { entry($($arg),*) };
                driver.check(stringify!($name), code)
            }
            Err(_) => Err(driver.missing(stringify!($name))),
        }
    }};
}
pub(crate) use driver_call;

/// Maps the result of a query call (`cuStreamQuery`, `cuEventQuery`): success is `true`,
/// `CUDA_ERROR_NOT_READY` is `false` (work still pending), anything else is the error.
fn ready(result: crate::cuda_error::Result<()>) -> crate::cuda_error::Result<bool> {
    match result {
        Ok(()) => Ok(true),
        Err(crate::cuda_error::CudaError::Driver(e)) if e.code == crate::sys::CUresult::CUDA_ERROR_NOT_READY => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}
