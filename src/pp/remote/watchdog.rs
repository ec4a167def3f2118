//! The watchdog thread of a runtime's outbound links: signs of life both ways, NCCL's errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use super::WATCH_PEEK;
use super::receiver::{Heartbeat, io_error};
use super::sender::Sender;
use crate::pp::error::Result;
use crate::pp::timing::POLL;

/// The watchdog of a runtime's outbound links (inbound links are watched by their receiver
/// threads).
pub(in crate::pp) struct Watchdog {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the thread that watches this rank's outgoing links (`senders`) and sends the
    /// signs of life of its incoming ones (`heartbeats`); none when there are neither.
    pub(in crate::pp) fn start(senders: Vec<Arc<Sender>>, heartbeats: Vec<Heartbeat>) -> Result<Option<Watchdog>> {
        let Some(first) = senders.first().map(|s| &s.link).or(heartbeats.first().map(|h| &h.link)) else {
            return Ok(None);
        };
        // A failure to start names the first link it would have watched.
        let first = Arc::clone(first);
        for sender in &senders {
            sender
                .watch
                .set_read_timeout(Some(WATCH_PEEK))
                .map_err(|e| io_error(&sender.link, "the connection's timeout", &e))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("ppnrt-watchdog".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    // Silence counts from now: the setup of the other links came first.
                    for sender in &senders {
                        sender.heard.mark();
                    }
                    let mut sent = vec![Instant::now(); heartbeats.len()];
                    while !stop.load(Ordering::SeqCst) {
                        for sender in &senders {
                            sender.watch();
                        }
                        for (heartbeat, sent) in heartbeats.iter().zip(&mut sent) {
                            heartbeat.beat(sent);
                        }
                        // Woken early by the drop (`unpark`): a runtime's drop waits for no poll.
                        std::thread::park_timeout(POLL);
                    }
                }
            })
            .map_err(|e| io_error(&first, "starting the watchdog thread", &e))?;
        Ok(Some(Watchdog { stop, thread: Some(thread) }))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}
