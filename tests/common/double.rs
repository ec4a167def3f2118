//! The CUDA driver double (`tests/driver_double/cuda_double.c`): built with the system C compiler
//! into the test target directory, loaded by ppnrt through `PPNRT_LIBCUDA_PATH`, and steered
//! through its control functions (fault injection, violation count, flush).
#![allow(dead_code, unreachable_pub)]

use std::ffi::{CString, c_char, c_int};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The double's source, relative to the package root.
const SOURCE: &str = "tests/driver_double/cuda_double.c";

/// The NCCL double's source (`tests/driver_double/nccl_double.c`), relative to the package root.
const NCCL_SOURCE: &str = "tests/driver_double/nccl_double.c";

/// Builds the double (`defines` select a variant, e.g. `PPNRT_DOUBLE_CUDA_12_4`) and returns the
/// library's path, or why it could not be built.
pub fn build(defines: &[&str]) -> Result<PathBuf, String> {
    let variant = if defines.is_empty() { "default".to_string() } else { defines.join("-").to_lowercase() };
    // Named `libcuda.so` inside (its SONAME): once loaded, a library that opens the driver by
    // that name (cudarc, feature `cudarc`) is given the double too, not the system's driver.
    compile(SOURCE, &format!("libcuda_double-{variant}"), defines, &["-lm", "-lpthread", "-Wl,-soname,libcuda.so"])
}

/// Builds the NCCL double, which works with the driver double (it finds it through
/// `PPNRT_LIBCUDA_PATH`), and returns the library's path, or why it could not be built.
pub fn build_nccl() -> Result<PathBuf, String> {
    compile(NCCL_SOURCE, "libnccl_double", &[], &["-lpthread", "-ldl"])
}

fn compile(source: &str, name: &str, defines: &[&str], libraries: &[&str]) -> Result<PathBuf, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("driver-double");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // One file per process: test binaries build in parallel and must not overwrite a library
    // another process has loaded.
    let out = dir.join(format!("{name}-{}.so", std::process::id()));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut command = Command::new(&compiler);
    command.args(["-O1", "-std=gnu11", "-shared", "-fPIC", "-o"]).arg(&out).arg(root.join(source));
    for define in defines {
        command.arg(format!("-D{define}"));
    }
    command.args(libraries);
    let output = command.output().map_err(|e| format!("cannot run the C compiler `{compiler}`: {e}"))?;
    if !output.status.success() {
        return Err(format!("`{compiler}` failed on {source}:\n{}", String::from_utf8_lossy(&output.stderr)));
    }
    Ok(out)
}

/// The control functions of a loaded double.
pub struct Double {
    lib: libloading::Library,
    pub path: PathBuf,
}

impl Double {
    fn symbol<T: Copy>(&self, name: &[u8]) -> T {
        // SAFETY: the double exports each control function with the C signature given by T at
        // the call sites below.
        unsafe { *self.lib.get::<T>(name).expect("the double exports its control functions") }
    }

    /// Its fault table and call counts.
    fn calls_table(&self) -> CallTable<'_> {
        CallTable { lib: &self.lib, prefix: "ppnrt_double" }
    }

    /// Makes the `nth` next call of `entry` fail with `code`.
    pub fn fail(&self, entry: &str, nth: i32, code: i32) {
        self.calls_table().fail(entry, nth, code)
    }

    /// Clears every injected fault not yet triggered.
    pub fn clear_faults(&self) {
        self.calls_table().clear_faults()
    }

    /// The calling thread's `cuCtxGetCurrent` calls so far ([`calls`](Self::calls) counts every
    /// thread's, those of threads an earlier test left behind included).
    pub fn thread_context_queries(&self) -> u64 {
        let f: unsafe extern "C" fn() -> u64 = self.symbol(b"ppnrt_double_thread_get_current\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// The calling thread's `cuCtxSetCurrent` calls so far.
    pub fn thread_context_switches(&self) -> u64 {
        let f: unsafe extern "C" fn() -> u64 = self.symbol(b"ppnrt_double_thread_set_current\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Makes the next `cuDevicePrimaryCtxRetain` hand out a context handle with its lowest bit set.
    pub fn odd_context_next(&self) {
        let f: unsafe extern "C" fn() = self.symbol(b"ppnrt_double_odd_context_next\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Turns peer access between the devices off (`true`: no device reports it, as on a host
    /// whose GPUs cannot reach each other) or back on, for what is built from now on. Call it once
    /// the driver is initialised (an `Engine` made): its start reads `PPNRT_DOUBLE_NO_PEER`.
    pub fn no_peer(&self, on: bool) {
        let f: unsafe extern "C" fn(c_int) = self.symbol(b"ppnrt_double_no_peer\0");
        // SAFETY: any integer is accepted.
        unsafe { f(c_int::from(on)) }
    }

    /// Accesses to freed or unallocated memory so far.
    pub fn violations(&self) -> u64 {
        let f: unsafe extern "C" fn() -> u64 = self.symbol(b"ppnrt_double_violations\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// The text of the last violation.
    pub fn last_violation(&self) -> String {
        let f: unsafe extern "C" fn(*mut c_char, usize) = self.symbol(b"ppnrt_double_last_violation\0");
        let mut buf = vec![0 as c_char; 512];
        // SAFETY: the buffer is writable for its length.
        unsafe { f(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: the double NUL-terminates within the length.
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    }

    /// Runs every queued operation.
    pub fn flush(&self) {
        let f: unsafe extern "C" fn() = self.symbol(b"ppnrt_double_flush\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Calls of the driver entry point `entry` so far.
    pub fn calls(&self, entry: &str) -> u64 {
        self.calls_table().calls(entry)
    }

    /// The driver calls `body` makes, per entry point, for the entry points it called at all.
    pub fn calls_made_by(&self, body: impl FnOnce()) -> Vec<(String, u64)> {
        self.calls_table().calls_made_by(body)
    }

    /// Runs `body` `runs` times and returns the calls of each of `entries` per run, in order.
    pub fn calls_per_run(&self, entries: &[&'static str], runs: usize, mut body: impl FnMut()) -> CallCounts {
        let before: Vec<u64> = entries.iter().map(|entry| self.calls(entry)).collect();
        for _ in 0..runs {
            body();
        }
        CallCounts(
            entries
                .iter()
                .zip(before)
                .map(|(entry, b)| (*entry, (self.calls(entry) - b) as f64 / runs as f64))
                .collect(),
        )
    }

    /// Device allocations not freed yet (a stream-ordered free counts once it ran), and pinned
    /// host allocations not freed yet.
    pub fn live_allocations(&self) -> (u64, u64) {
        let f: unsafe extern "C" fn(c_int) -> u64 = self.symbol(b"ppnrt_double_live_allocations\0");
        // SAFETY: 1 and 2 are the kinds the double counts.
        unsafe { (f(1), f(2)) }
    }

    /// Queued operations not yet run.
    pub fn pending(&self) -> u64 {
        let f: unsafe extern "C" fn() -> u64 = self.symbol(b"ppnrt_double_pending\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Generic allocation handles (`cuMemCreate`, `cuMemImportFromShareableHandle`) not released.
    pub fn ipc_handles(&self) -> i64 {
        let f: unsafe extern "C" fn() -> i64 = self.symbol(b"ppnrt_double_ipc_handles\0");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    /// Holds `stream`'s later work until `open` is set (a gate of the "device": work the host
    /// lets through when it chooses, as a long kernel would).
    pub fn gate(&self, stream: &ppnrt::CudaStream, open: &'static std::sync::atomic::AtomicBool) {
        extern "C" fn ready(arg: *mut std::ffi::c_void) -> c_int {
            // SAFETY: `arg` is the `&'static AtomicBool` given below.
            let open = unsafe { &*arg.cast::<std::sync::atomic::AtomicBool>() };
            c_int::from(open.load(std::sync::atomic::Ordering::Acquire))
        }
        extern "C" fn run(_: *mut std::ffi::c_void) {}
        type Ready = extern "C" fn(*mut std::ffi::c_void) -> c_int;
        type Run = extern "C" fn(*mut std::ffi::c_void);
        let f: unsafe extern "C" fn(*mut std::ffi::c_void, Ready, Run, *mut std::ffi::c_void) -> c_int =
            self.symbol(b"ppnrt_double_enqueue_external\0");
        let arg = std::ptr::from_ref(open).cast_mut().cast::<std::ffi::c_void>();
        // SAFETY: a live stream of the double; the callbacks only read the flag, which lives for
        // the whole process.
        let rc = unsafe { f(stream.raw().cast(), ready, run, arg) };
        assert_eq!(rc, 0, "the double refused the gate");
    }
}

/// The fault table and call counts a double exports: `<prefix>_fail`, `<prefix>_clear_faults`,
/// `<prefix>_calls`, `<prefix>_entry_called`, with the same C signatures in both doubles.
struct CallTable<'a> {
    lib: &'a libloading::Library,
    prefix: &'static str,
}

impl CallTable<'_> {
    fn symbol<T: Copy>(&self, name: &str) -> T {
        let name = format!("{}_{name}\0", self.prefix);
        // SAFETY: both doubles export each of these functions with the C signature given by T at
        // the call sites below.
        unsafe { *self.lib.get::<T>(name.as_bytes()).expect("the double exports its control functions") }
    }

    fn fail(&self, entry: &str, nth: i32, code: i32) {
        let f: unsafe extern "C" fn(*const c_char, c_int, c_int) -> c_int = self.symbol("fail");
        let entry = CString::new(entry).unwrap();
        // SAFETY: a NUL-terminated name that outlives the call.
        assert_eq!(unsafe { f(entry.as_ptr(), nth, code) }, 0, "fault table full");
    }

    fn clear_faults(&self) {
        let f: unsafe extern "C" fn() = self.symbol("clear_faults");
        // SAFETY: no arguments.
        unsafe { f() }
    }

    fn calls(&self, entry: &str) -> u64 {
        let f: unsafe extern "C" fn(*const c_char) -> u64 = self.symbol("calls");
        let entry = CString::new(entry).unwrap();
        // SAFETY: a NUL-terminated name that outlives the call.
        unsafe { f(entry.as_ptr()) }
    }

    fn entries_called(&self) -> Vec<String> {
        let f: unsafe extern "C" fn(usize, *mut c_char, usize) -> c_int = self.symbol("entry_called");
        let mut names = Vec::new();
        let mut buf = vec![0 as c_char; 128];
        // SAFETY: the buffer is writable for its length; the double NUL-terminates within it.
        while unsafe { f(names.len(), buf.as_mut_ptr(), buf.len()) } == 0 {
            // SAFETY: NUL-terminated by the call above.
            names.push(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned());
        }
        names
    }

    /// The calls `body` makes, per entry point, for the entry points it called at all.
    fn calls_made_by(&self, body: impl FnOnce()) -> Vec<(String, u64)> {
        let before: Vec<(String, u64)> =
            self.entries_called().into_iter().map(|e| (e.clone(), self.calls(&e))).collect();
        body();
        let made = |entry: &str| before.iter().find(|(e, _)| e == entry).map_or(0, |(_, c)| *c);
        self.entries_called()
            .into_iter()
            .map(|entry| (self.calls(&entry) - made(&entry), entry))
            .filter(|(calls, _)| *calls > 0)
            .map(|(calls, entry)| (entry, calls))
            .collect()
    }
}

/// The control functions of the loaded NCCL double (`tests/driver_double/nccl_double.c`).
pub struct NcclDouble {
    lib: libloading::Library,
}

impl NcclDouble {
    fn calls_table(&self) -> CallTable<'_> {
        CallTable { lib: &self.lib, prefix: "ppnrt_nccl_double" }
    }

    /// Makes the `nth` next call of `entry` fail with the NCCL result `code`.
    pub fn fail(&self, entry: &str, nth: i32, code: i32) {
        self.calls_table().fail(entry, nth, code)
    }

    /// Clears every injected fault not yet triggered.
    pub fn clear_faults(&self) {
        self.calls_table().clear_faults()
    }

    /// Calls of the NCCL entry point `entry` so far.
    pub fn calls(&self, entry: &str) -> u64 {
        self.calls_table().calls(entry)
    }

    /// The NCCL calls `body` makes, per entry point, for the entry points it called at all.
    pub fn calls_made_by(&self, body: impl FnOnce()) -> Vec<(String, u64)> {
        self.calls_table().calls_made_by(body)
    }
}

/// The NCCL double that [`setup`] named in the environment, loaded (the library ppnrt loads too).
pub fn nccl_double() -> &'static NcclDouble {
    static NCCL: OnceLock<NcclDouble> = OnceLock::new();
    NCCL.get_or_init(|| {
        let path = std::env::var_os(ppnrt::nccl::LIBNCCL_PATH_VAR).expect("setup() named the NCCL double");
        // SAFETY: opening the NCCL double runs no initialiser with preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.expect("the NCCL double loads");
        NcclDouble { lib }
    })
}

static DOUBLE: OnceLock<Result<Double, String>> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

/// Points ppnrt at the double (built once per process) before anything loads a driver, and at
/// the NCCL double (see [`nccl_double`]) before anything loads NCCL, and
/// serialises the calling test with the others of its binary (the double's fault table and
/// violation count are process-wide). `None`, after saying why, when it cannot be built and
/// `PPNRT_REQUIRE_DOUBLE` is unset; with it set (CI sets it) that is a failure.
pub fn setup(test: &str) -> Option<(MutexGuard<'static, ()>, &'static Double)> {
    let serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let double = DOUBLE.get_or_init(|| {
        let path = match std::env::var_os("PPNRT_LIBCUDA_PATH") {
            // A child process of a test: the parent chose the library.
            Some(path) if std::env::var_os("PPNRT_DOUBLE_CHILD").is_some() => PathBuf::from(path),
            _ => build(&[])?,
        };
        let nccl = match std::env::var_os(ppnrt::nccl::LIBNCCL_PATH_VAR) {
            Some(nccl) if std::env::var_os("PPNRT_DOUBLE_CHILD").is_some() => PathBuf::from(nccl),
            _ => build_nccl()?,
        };
        // SAFETY: set before any driver or NCCL load, while every test of this binary waits on
        // SERIAL or on this OnceLock; nothing else reads the environment concurrently.
        unsafe {
            std::env::set_var("PPNRT_LIBCUDA_PATH", &path);
            std::env::set_var(ppnrt::nccl::LIBNCCL_PATH_VAR, nccl);
        }
        // SAFETY: opening the double runs no initialiser with preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| e.to_string())?;
        Ok(Double { lib, path })
    });
    match double {
        Ok(double) => {
            double.clear_faults();
            Some((serial, double))
        }
        Err(why) => {
            assert!(std::env::var_os("PPNRT_REQUIRE_DOUBLE").is_none(), "{test}: the driver double is required: {why}");
            crate::common::say(&format!("SKIPPED {test}: the driver double could not be built: {why}"));
            None
        }
    }
}

/// Runs `body` with the double loaded (see [`setup`]; skipped, saying why, where it cannot be
/// built), then checks that it saw no access to freed memory.
pub fn with_double(test: &str, body: impl FnOnce(&Double)) {
    let Some((_serial, double)) = setup(test) else { return };
    let before = double.violations();
    body(double);
    double.clear_faults();
    double.flush();
    assert_eq!(double.violations(), before, "{test}: {}", double.last_violation());
}

/// Driver calls per run of some work ([`Double::calls_per_run`]).
#[derive(Debug)]
pub struct CallCounts(pub Vec<(&'static str, f64)>);

impl CallCounts {
    /// The calls of `entry` per run (it must be one of the entries counted).
    pub fn of(&self, entry: &str) -> f64 {
        self.0.iter().find(|(e, _)| *e == entry).unwrap_or_else(|| panic!("{entry} was not counted")).1
    }
}

/// Whether this process runs through the driver and NCCL doubles: where no CUDA driver can be
/// loaded (and `PPNRT_LIBCUDA_PATH` names none), both doubles are built and named in the
/// environment (`PPNRT_LIBCUDA_PATH`, `PPNRT_LIBNCCL_PATH`), which child processes inherit.
/// Call it before anything in the process loads a driver or NCCL, from every test of the binary
/// (the first call decides, the others wait for it). Where they cannot be built it says why and
/// returns false, unless `PPNRT_REQUIRE_DOUBLE` is set (CI sets it): then that is a failure.
pub fn doubles_unless_a_gpu() -> bool {
    static DOUBLES: OnceLock<bool> = OnceLock::new();
    *DOUBLES.get_or_init(|| {
        if let Some(path) = std::env::var_os("PPNRT_LIBCUDA_PATH") {
            return path.to_string_lossy().contains("cuda_double");
        }
        // SAFETY: opening the system's driver library only to see whether there is one; its
        // initialisers have no preconditions.
        if unsafe { libloading::Library::new("libcuda.so.1") }.is_ok() {
            return false;
        }
        match build(&[]).and_then(|cuda| Ok((cuda, build_nccl()?))) {
            Ok((cuda, nccl)) => {
                // SAFETY: set before any driver or NCCL load, while every other test of this
                // binary waits on this OnceLock; nothing else reads the environment meanwhile.
                unsafe {
                    std::env::set_var("PPNRT_LIBCUDA_PATH", cuda);
                    std::env::set_var(ppnrt::nccl::LIBNCCL_PATH_VAR, nccl);
                }
                true
            }
            Err(why) => {
                assert!(std::env::var_os("PPNRT_REQUIRE_DOUBLE").is_none(), "the doubles are required: {why}");
                crate::common::say(&format!("no GPU, and the doubles could not be built: {why}"));
                false
            }
        }
    })
}
