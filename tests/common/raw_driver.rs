//! Raw driver calls for the code that measures or checks the crate against the driver itself
//! (the benches' raw loops, the raw-driver test loops): [`api`] and the `raw!` macro, which
//! calls one entry point and panics, naming it, unless it succeeded.
#![allow(dead_code, unreachable_pub)]

use ppnrt::sys;

/// The loaded driver's entry points.
pub fn api() -> &'static sys::DriverApi {
    ppnrt::loader::driver().expect("the driver loaded").api()
}

/// Calls a raw driver entry point and panics, naming it, unless it succeeded.
macro_rules! raw {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let entry = $crate::raw_driver::api().$name.as_ref().expect(stringify!($name));
        // SAFETY: every call site passes live handles and valid ranges it set up itself.
        let code = unsafe { entry($($arg),*) };
        assert_eq!(code, ppnrt::sys::CUresult::CUDA_SUCCESS, "{} failed", stringify!($name));
    }};
}
pub(crate) use raw;

/// Driver handles (contexts, streams, functions, events), shared with other threads: the driver
/// accepts each from any thread. `get` hands out a copy.
pub struct AnyThread<T: Copy>(pub T);

// SAFETY: only driver handles are wrapped, and the driver accepts them from any thread.
unsafe impl<T: Copy> Sync for AnyThread<T> {}

impl<T: Copy> AnyThread<T> {
    pub fn get(&self) -> T {
        self.0
    }
}
