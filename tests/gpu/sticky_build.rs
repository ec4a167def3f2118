//! A failed build of the process-wide runtime is sticky and loud. This binary holds one test: it
//! sets the `PPNRT_*` variables before the first `PpNRt::get`.

#[path = "../common/mod.rs"]
mod common;

use common::needs::{Needs, requires};
use ppnrt::{Error, PpNRt};

#[test]
fn a_bad_configuration_fails_every_get_the_same_way() {
    // SAFETY: this binary's only test sets the variables before anything reads them.
    unsafe {
        std::env::set_var("PPNRT_STAGES", "abc");
        std::env::remove_var("PPNRT_DEVICES");
    }
    let Some(gpu) = requires("a_bad_configuration_fails_every_get_the_same_way", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let first = PpNRt::get(&engine).unwrap_err();
    let text = ppnrt::error::chain(&first);
    assert!(text.contains("PPNRT_STAGES") && text.contains("abc") && text.contains("not a whole number"), "{text}");
    assert!(matches!(&first, Error::PipelineBuild { source, .. } if matches!(**source, Error::Config(_))));
    // Fixing the environment later does not change the outcome: the config froze at first build.
    // SAFETY: as above; no other thread reads the environment.
    unsafe { std::env::set_var("PPNRT_STAGES", "2") };
    for _ in 0..3 {
        assert_eq!(PpNRt::get(&engine).unwrap_err(), first);
    }
}
