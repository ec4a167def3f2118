//! With no driver to load, every public entry point returns a typed error listing what was
//! tried, nothing panics, and a GPU test's skip line says so in a few words. Runs on every
//! machine: it points the loader at a path that does not exist (this test binary holds only this
//! test, so the process-wide loader sees it first).

#[path = "../common/mod.rs"]
mod common;

use common::needs::{self, Needs, Shortfall, requires};
use ppnrt::{CudaError, Device, Engine, LoadError, PpConfig, PpNRt};

#[test]
fn every_entry_point_reports_the_missing_driver() {
    let path = "/nonexistent/ppnrt-test/libcuda.so.1";
    // SAFETY: no other thread of this test binary reads the environment concurrently (one test).
    unsafe { std::env::set_var("PPNRT_LIBCUDA_PATH", path) };

    let check = |what: &str, err: CudaError| match &err {
        CudaError::Load(LoadError::LibraryNotFound { tried }) => {
            assert_eq!(tried.len(), 1, "{what}: {err}");
            assert_eq!(tried[0].candidate, path, "{what}: {err}");
            assert!(err.to_string().contains(path), "{what}: {err}");
        }
        other => panic!("{what}: expected the missing-driver error, got {other:?}"),
    };
    check("Device::count", Device::count().unwrap_err());
    check("Device::get", Device::get(0).unwrap_err());
    check("Device::all", Device::all().unwrap_err());
    check("Device::peer_matrix", Device::peer_matrix().unwrap_err());
    check("Engine::new", Engine::new(0).unwrap_err());
    check("driver", ppnrt::loader::driver().err().unwrap());
    // The same error every time: the load is decided once.
    check("Device::count again", Device::count().unwrap_err());
    // A GPU test that skips says why in one short line, not with the loader's list of every path
    // tried.
    let two = Needs::gpus(2).peer().nccl();
    let lacks = needs::shortfall(two).expect("no driver, no GPU");
    assert_eq!(lacks, Shortfall::Gpus("0: no driver".into()));
    assert_eq!(
        needs::skip_line("a_gpu_test", two, &lacks),
        "SKIPPED a_gpu_test: needs 2 GPUs with peer access and NCCL (found 0: no driver)"
    );
    // Where GPUs are required (the GPU gate sets PPNRT_REQUIRE_GPUS to those it sees), a test that
    // needs no more than that many fails instead of skipping; one that needs more skips.
    // SAFETY: as above.
    unsafe { std::env::set_var("PPNRT_REQUIRE_GPUS", "1") };
    assert!(requires("a_gpu_test", Needs::gpus(2)).is_none(), "needs more than required: skips");
    let required = std::panic::catch_unwind(|| requires("a_gpu_test", Needs::gpus(1)).is_none());
    assert!(required.is_err(), "needs no more than required: fails instead of skipping");
    // SAFETY: as above.
    unsafe { std::env::remove_var("PPNRT_REQUIRE_GPUS") };
    // Configuration needs no driver and still works.
    assert!(PpConfig::parse(Some("2"), None, None, None).is_ok());
    let _ = PpNRt::get; // needs an Engine, which cannot exist without a driver

    // A malformed PPNRT_* variable is the pipeline's settings' error, reported by them without a
    // driver; an engine reads no pipeline setting and reports the missing driver.
    // SAFETY: as above.
    unsafe { std::env::set_var("PPNRT_STAGES", "two") };
    match PpConfig::from_env() {
        Err(e) => assert_eq!(e.setting, "PPNRT_STAGES", "{e}"),
        Ok(config) => panic!("expected the configuration error, got {config}"),
    }
    check("Engine::new with a malformed setting", Engine::new(0).unwrap_err());
    // SAFETY: as above.
    unsafe {
        std::env::remove_var("PPNRT_STAGES");
        // An empty path is no path: the default candidates are tried.
        std::env::set_var("PPNRT_LIBCUDA_PATH", "");
    }
    assert_eq!(ppnrt::loader::default_candidates(), ["libcuda.so.1", "libcuda.so"]);
}
