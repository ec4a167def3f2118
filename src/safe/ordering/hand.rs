//! A buffer's state handed to one stream ([`Access::hand_to`]): through exclusive access (the
//! buffer's only handle), the stream is ordered after every use recorded so far, and from then on
//! the state records them as one write of that stream's. Sound for any later use on any stream:
//! a later use waits for that stream's mark, which comes after every earlier use (the stream
//! waited for them) and after whatever the stream enqueues meanwhile (a deferred readback's copy
//! out of the buffer, which is then noted nowhere).

use std::sync::Arc;

use super::{Access, Mark, Use, order_locked, plain_on};
use crate::cuda_error::Result;
use crate::result::event as raw_event;
use crate::result::stream as raw_stream;
use crate::safe::event_pool::PooledEvent;
use crate::safe::stream::CudaStream;

impl Access {
    /// Orders `stream` after every use of the buffer recorded so far and records them as one
    /// write of `stream`'s (see the [module docs](self)). Only with `stream`'s context bound and
    /// its enqueue gate held (the door's), the stream not capturing.
    ///
    /// The usual state (a buffer written by another stream of the same context, with no event
    /// yet and no read since: the step's results) is waited for through `spare`, an event of
    /// `stream`'s context that the caller keeps (taken from the pool the first time) and that is
    /// recorded at the end of the writing stream, under its enqueue gate, while it is not
    /// capturing; any other state through the rule's marks.
    #[inline]
    pub(crate) fn hand_to(&mut self, stream: &Arc<CudaStream>, spare: &mut Option<PooledEvent>) -> Result<()> {
        let eager = self.eager;
        if *self.plain.get_mut() == stream.id() {
            // The state records one write of `stream`'s already, and nothing else.
            return Ok(());
        }
        let state = self.state.get_mut();
        let waited = match &state.write {
            Some(Mark { stream: Some(writer), event: None, .. })
                if !eager
                    && state.reads.is_empty()
                    && !Arc::ptr_eq(writer, stream)
                    && Arc::ptr_eq(writer.context(), stream.context()) =>
            {
                // The writer's capture state holds still from the look to the record.
                let _gate = writer.enqueue_gate();
                if writer.is_capturing() {
                    false
                } else {
                    let event = match spare {
                        Some(event) => event,
                        None => spare.insert(PooledEvent::take(stream.context())?),
                    };
                    // SAFETY: the event and both streams are live and of one context, which is
                    // current (bound by the door); the writer is not capturing (looked at under
                    // its gate, held), so the record lands at the end of its work, outside any
                    // capture.
                    unsafe {
                        raw_event::record(event.raw(), writer.raw())?;
                        raw_stream::wait_event(stream.raw(), event.raw())?;
                    }
                    true
                }
            }
            _ => false,
        };
        if !waited {
            let ordered = order_locked(state, stream, Use::Write);
            if ordered.is_err() {
                // The tag follows the state, changed or not (marks waited for before the
                // failure remember it).
                *self.plain.get_mut() = plain_on(state, eager);
                return ordered;
            }
        }
        if !state.reads.is_empty() {
            state.reads.clear();
        }
        state.write = Some(Mark::new(stream));
        *self.plain.get_mut() = plain_on(state, eager);
        Ok(())
    }
}
