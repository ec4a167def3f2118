//! The process-wide runtime builds once from the environment and freezes its configuration.

#[path = "../common/mod.rs"]
mod common;

use common::needs::{Needs, requires};
use ppnrt::PpNRt;

#[test]
fn get_builds_once_from_the_environment() {
    // SAFETY: this binary's only test sets the variables before anything reads them.
    unsafe {
        std::env::set_var("PPNRT_STAGES", "3");
        std::env::set_var("PPNRT_SLOTS", "4");
        std::env::set_var("PPNRT_TRANSPORT", "staged");
        std::env::remove_var("PPNRT_DEVICES");
    }
    let Some(gpu) = requires("get_builds_once_from_the_environment", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let rt = PpNRt::get(&engine).unwrap();
    assert_eq!(rt.n_stages(), 3);
    assert_eq!(rt.n_slots(), 4);
    assert!(rt.plan().boundaries.iter().all(|b| b.transport == ppnrt::Transport::HostStaged));
    // SAFETY: as above.
    unsafe { std::env::set_var("PPNRT_STAGES", "5") };
    let again = PpNRt::get(&engine).unwrap();
    assert!(std::ptr::eq(rt, again));
    assert_eq!(again.n_stages(), 3);
}
