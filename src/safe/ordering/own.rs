//! A buffer ordered by the protocol that owns it, with two events of its own instead of the rule's
//! marks: one recorded after each write (on the one writing stream), one after each read (on the
//! one reading stream), as a pipeline ring orders a slot with its `ev_tx` and `ev_rx`. A write
//! waits for the read since the last write, a read for the last write; nothing is locked or
//! noted beyond that, and the events are recorded again in place.
//!
//! While an [`OwnOrder`] orders a buffer, the buffer's [`Access`] records none of those uses:
//! only the owner reaches the buffer, through [`OwnOrder::write`] and [`OwnOrder::read`] (which
//! check that the buffer is the one they order). Before anyone else may reach it (lent to a
//! caller, captured into a graph, grown, freed), the owner hands the events over to the buffer's
//! `Access` as its marks ([`OwnOrder::hand_over`]), and the rule orders every use from then on.

use std::sync::Arc;

use super::{Access, Mark};
use crate::cuda_error::Result;
use crate::result::event as raw_event;
use crate::result::stream as raw_stream;
use crate::safe::capture::refuse_in_capture;
use crate::safe::event_pool::{PooledEvent, StreamEvent};
use crate::safe::stream::CudaStream;

/// The ordering of one buffer by its owner's two streams and two events (see the
/// [module docs](self)).
#[derive(Debug)]
pub(crate) struct OwnOrder {
    /// The buffer ordered, by the address of its `Access`: to check that a use names it.
    access: *const Access,
    /// The one stream that writes the buffer.
    writer: Arc<CudaStream>,
    /// The one stream that reads it.
    reader: Arc<CudaStream>,
    /// Recorded on `writer` after the last write (`None` before the first, or after a failed
    /// record that was waited out on the host).
    written: Option<PooledEvent>,
    /// Recorded on `reader` after the last read.
    read: Option<PooledEvent>,
    /// Whether a read came after the last write: the next write waits for `read`.
    read_since_write: bool,
    /// An event of the writer's context for the waits of writes from a handed source (see
    /// [`write_from_handed`](Self::write_from_handed)), recorded on the source's last writer.
    spare: Option<PooledEvent>,
}

// SAFETY: `access` is only compared, never dereferenced; the events and streams are `Send` and
// `Sync`.
unsafe impl Send for OwnOrder {}
// SAFETY: as for `Send`.
unsafe impl Sync for OwnOrder {}

/// Which side of a copy is the owned buffer (the other is ordered by the rule).
#[derive(Debug)]
pub(crate) enum Owned<'o> {
    /// The copy reads the owned buffer.
    Src(&'o mut OwnOrder),
    /// The copy writes the owned buffer.
    Dst(&'o mut OwnOrder),
}

impl OwnOrder {
    /// The ordering by `writer` and `reader`, from now on, of the buffer whose ordering state is
    /// `access`. Its uses so far are the `Access`'s: the first write waits for none of them, so
    /// the buffer is one whose last use has completed (a fresh `cuMemAlloc` allocation).
    pub(crate) fn new(access: &Access, writer: &Arc<CudaStream>, reader: &Arc<CudaStream>) -> OwnOrder {
        OwnOrder {
            access: std::ptr::from_ref(access),
            writer: Arc::clone(writer),
            reader: Arc::clone(reader),
            written: None,
            read: None,
            read_since_write: false,
            spare: None,
        }
    }

    /// Whether `access` is the ordering state of the buffer this orders.
    #[inline]
    pub(crate) fn orders(&self, access: &Access) -> bool {
        std::ptr::eq(self.access, access)
    }

    /// Runs `enqueue`, a write of the buffer on the writing stream `stream`, after the last read,
    /// and records the write's event after it. Only inside the enqueue of the door
    /// ([`ordered_owned`](crate::safe::enqueue::ordered_owned)): `stream`'s context is bound
    /// there and its enqueue gate held, the stream not capturing. A failed record waits for
    /// `stream` on the host (see [`CudaStream::settle`]): the write is then complete and no read
    /// needs to wait for it.
    #[inline(always)]
    pub(crate) fn write<R>(&mut self, stream: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<R>) -> Result<R> {
        assert!(Arc::ptr_eq(stream, &self.writer), "an owned buffer is written by its writing stream only");
        if self.read_since_write {
            if let Some(read) = &self.read {
                wait(stream, read)?;
            }
        }
        let result = enqueue()?;
        self.read_since_write = false;
        stream.settle(record(stream, &mut self.written))?;
        Ok(result)
    }

    /// [`write`](Self::write) from `src`, the ordering state of a source that nothing but
    /// `stream` uses from now on, held exclusively (a slice given up for its last read, see
    /// [`Retired`](crate::safe::memory::Retired)): the source's state is handed to `stream` first
    /// ([`Access::hand_to`], through this order's spare event), which orders the write after the
    /// source's uses and records the write's read of it with them, as one use of `stream`'s.
    #[inline]
    pub(crate) fn write_from_handed<R>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &mut Access,
        enqueue: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        src.hand_to(stream, &mut self.spare)?;
        self.write(stream, enqueue)
    }

    /// Runs `enqueue`, a read of the buffer on the reading stream `stream`, after the last write,
    /// and records the read's event after it; as [`write`](Self::write), only inside the door's
    /// enqueue.
    #[inline(always)]
    pub(crate) fn read<R>(&mut self, stream: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<R>) -> Result<R> {
        assert!(Arc::ptr_eq(stream, &self.reader), "an owned buffer is read by its reading stream only");
        if let Some(written) = &self.written {
            wait(stream, written)?;
        }
        let result = enqueue()?;
        self.read_since_write = true;
        stream.settle(record(stream, &mut self.read))?;
        Ok(result)
    }

    /// Blocks the host until the last write has completed, for a buffer that the host reads (a
    /// readback's pinned buffer, whose `reader` stream reads nothing); refused as `call` on a
    /// capturing thread. The host's reads end before the owner's next write (they borrow what
    /// the owner lends), so no write waits for them.
    pub(crate) fn wait_written_on_host(&self, call: &'static str) -> Result<()> {
        refuse_in_capture(|| None, call)?;
        match &self.written {
            Some(written) => written.synchronize(),
            // No write yet, or a failed record whose stream was waited for (see `write`).
            None => Ok(()),
        }
    }

    /// Whether the last write has completed, without blocking (as
    /// [`wait_written_on_host`](Self::wait_written_on_host)).
    pub(crate) fn is_written_complete(&self, call: &'static str) -> Result<bool> {
        refuse_in_capture(|| None, call)?;
        match &self.written {
            Some(written) => written.is_complete(),
            None => Ok(true),
        }
    }

    /// Hands the buffer's ordering over to its `access`, the buffer's own (the rule orders every
    /// use from now on): the last write becomes its last write, and a read since becomes a read
    /// mark (a read before the last write was waited for by that write).
    pub(crate) fn hand_over(self, access: &Access) {
        assert!(self.orders(access), "an owned buffer's ordering goes to its own state");
        let OwnOrder { writer, reader, written, read, read_since_write, .. } = self;
        let mut state = access.lock();
        if let Some(event) = written {
            state.write = Some(Mark {
                stream_id: writer.id(),
                stream: Some(writer),
                event: Some(StreamEvent::Own(event)),
                waited_by: None,
            });
        }
        if let (true, Some(event)) = (read_since_write, read) {
            let mark = Mark {
                stream_id: reader.id(),
                stream: Some(reader),
                event: Some(StreamEvent::Own(event)),
                waited_by: None,
            };
            state.reads.push(mark);
        }
    }

    /// Forgets the read since the last write: the next write does not wait for it. Only for
    /// deliberately broken protocols in hazard tests.
    #[cfg(feature = "testing")]
    pub(crate) fn forget_read(&mut self) {
        self.read_since_write = false;
    }

    /// Forgets the last write: the next read does not wait for it. Only for deliberately broken
    /// protocols in hazard tests.
    #[cfg(feature = "testing")]
    pub(crate) fn forget_write(&mut self) {
        self.written = None;
    }
}

/// Makes `stream` wait for `event` (of any context), with `stream`'s context bound by the door.
#[inline(always)]
fn wait(stream: &CudaStream, event: &PooledEvent) -> Result<()> {
    // SAFETY: both handles are live while their wrappers (borrowed here) live; the stream's
    // context is current (bound by the door around the enqueue this runs in).
    unsafe { raw_stream::wait_event(stream.raw(), event.raw()) }
}

/// Records `event` (made from `stream`'s context's pool the first time) at the end of `stream`,
/// with `stream`'s context bound by the door; on failure `event` is left empty.
#[inline(always)]
fn record(stream: &Arc<CudaStream>, event: &mut Option<PooledEvent>) -> Result<()> {
    let own = match event {
        Some(own) => own,
        None => event.insert(PooledEvent::take(stream.context())?),
    };
    // SAFETY: both handles are live and of one context (the event was taken from the stream's
    // context's pool), which is current (bound by the door around the enqueue this runs in).
    if let Err(e) = unsafe { raw_event::record(own.raw(), stream.raw()) } {
        *event = None;
        return Err(e);
    }
    Ok(())
}
