//! The configuration's fingerprint: what of a [`PpConfig`] every rank of one pipeline must
//! share, which the rendezvous ([`crate::rendezvous`]) compares before any rank goes on.

use crate::pp::config::PpConfig;

impl PpConfig {
    /// The configuration without this process's rank: every process of one pipeline has the same
    /// fingerprint (the rendezvous compares them). A fault of one rank's setup (`testing`) is
    /// that rank's alone and left out.
    pub fn fingerprint(&self) -> String {
        self.clone().with_rank(0).with_faults(self.faults().shared()).to_string()
    }
}
