//! The IPC boundary's announcements (ranks as threads of this process, through the doubles): a
//! step of the previous step's element type is announced in the receiving rank's control block,
//! a step of a new type, or one past the block's lines the receiving rank has not taken yet, on
//! the control connection; either way the receiving rank takes every step in order, bitwise; and
//! a receiver thread asleep on the block's sleep word is woken when a step is announced in the
//! block or on the connection, not at its next poll (and, whatever a peer writes into the word,
//! finds each step by its poll).

use crate::{double, ranks};

use std::time::{Duration, Instant};

use double::with_double;
use ppnrt::local_channel::ControlBlock;
use ppnrt::{DeviceRepr, Engine, PpNRt, Transport};

const N: usize = 1024;
const WAIT: Duration = Duration::from_secs(5);

/// Step `t`'s values, as `T`, from 32-bit pattern words.
fn values<T: From<u16>>(t: u32) -> Vec<T> {
    (0..N as u64).map(|i| T::from(ppnrt::kernels::pattern(t, i) as u16)).collect()
}

/// Rank 0 sends `x` (`N` elements) on its boundary.
fn send<T: DeviceRepr>(ranks: &(PpNRt, PpNRt), x: &ppnrt::CudaSlice<T>) {
    ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, x, N)).unwrap();
}

/// Rank 1 takes step `t` (slot `t % 2`) and reads it back.
fn take<T: DeviceRepr + Copy>(ranks: &(PpNRt, PpNRt), t: usize) -> Vec<T> {
    ranks
        .1
        .enter(1)
        .and_then(|_stage| {
            let y = ranks.1.rx_wait::<T>(0, t % 2, N, WAIT)?;
            ranks.1.readback(y)?.wait().map(<[T]>::to_vec)
        })
        .unwrap_or_else(|e| panic!("step {t}: {e}"))
}

/// Rank 0 sends step `t` of `T` (`N` elements); rank 1 takes it (slot `t % 2`): when it arrived,
/// and whether it holds the step's values.
fn send_and_take<T: DeviceRepr + Copy + From<u16> + PartialEq>(
    ranks: &(PpNRt, PpNRt),
    e0: &Engine,
    t: u32,
) -> (Instant, bool) {
    let x = {
        let _stage = ranks.0.enter(0).unwrap();
        e0.htod(&values::<T>(t)).unwrap()
    };
    send(ranks, &x);
    let y = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<T>(0, t as usize % 2, N, WAIT)).unwrap();
    let arrived = Instant::now();
    let got = ranks.1.enter(1).and_then(|_stage| ranks.1.readback(y)?.wait().map(<[T]>::to_vec)).unwrap();
    (arrived, got == values::<T>(t))
}

/// Two ranks over IPC, two slots.
fn ipc_ranks() -> (PpNRt, PpNRt) {
    let ranks = ranks::two_ranks_configured(WAIT, |_, config| config.with_slots(2));
    assert_eq!(ranks.0.plan().boundaries[0].transport, Transport::Ipc, "{}", ranks.0.plan());
    ranks
}

/// Steps one at a time, of `u32` (steps 0 to 9), `i32` (10 to 15), `u32` again (16 to 23): each
/// arrives bitwise, and every step but the first of each type was announced in the block (21 of
/// 24). With the sender's block left unused (mutation `ipc-block-unused`), none is.
#[test]
fn steps_of_one_type_are_announced_in_the_control_block_and_a_new_type_on_the_connection() {
    with_double("steps_of_one_type_are_announced_in_the_control_block_and_a_new_type_on_the_connection", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        for t in 0..24u32 {
            let _stage = ranks.0.enter(0).unwrap();
            if (10..16).contains(&t) {
                let x = e0.htod(&values::<i32>(t)).unwrap();
                send(&ranks, &x);
                assert!(take::<i32>(&ranks, t as usize) == values::<i32>(t), "step {t}: wrong values");
            } else {
                let x = e0.htod(&values::<u32>(t)).unwrap();
                send(&ranks, &x);
                assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
            }
        }
        assert_eq!(ranks.1.block_announcements(0).unwrap(), 21);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// Rank 0 sends 60 steps before rank 1's stage takes any (its stream waits for each slot on the
/// device): the block's lines fill up (rank 1's receiver takes steps 1 and 2, then waits for a
/// free slot), so the later steps are announced on the connection. Rank 1 then takes all 60,
/// bitwise, the block's steps first in their order. With a line written before rank 1 took the
/// step it held (mutation `ipc-announce-over-untaken-line`), step 3's announcement is lost.
#[test]
fn a_sender_far_ahead_announces_on_the_connection_once_the_block_is_full() {
    with_double("a_sender_far_ahead_announces_on_the_connection_once_the_block_is_full", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let steps = 60;
        let inputs: Vec<_> = (0..steps)
            .map(|t| {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&values::<u32>(t)).unwrap()
            })
            .collect();
        for x in &inputs {
            send(&ranks, x);
        }
        for t in 0..steps {
            assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
        }
        let in_block = ranks.1.block_announcements(0).unwrap();
        let lines = ControlBlock::ANNOUNCEMENTS as u64;
        assert!(
            (lines - 1..=lines + 2).contains(&in_block),
            "{in_block} step(s) announced in the block, {} to {} expected",
            lines - 1,
            lines + 2
        );
        drop(inputs);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// Steps 3 ms apart, so that rank 1's receiver thread has stopped spinning and sleeps on the
/// block's sleep word (bounded by its 10 ms poll) when each is announced in the block: the sender
/// wakes it (a futex wake), and the median step arrives well before the next poll would have
/// found it. Then steps of alternating types, which go on the connection: the sender wakes the
/// sleeping thread after each record too. With the wake after an announcement left out
/// (mutation `ipc-asleep-not-woken`) or after a record (`ipc-record-not-woken`), each such step
/// waits for the poll (7 ms or so).
#[test]
fn a_receiver_asleep_is_woken_by_a_step_announced_in_the_block_or_on_the_connection() {
    with_double("a_receiver_asleep_is_woken_by_a_step_announced_in_the_block_or_on_the_connection", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let mut took = Vec::new();
        let steps = 25;
        for t in 0..steps {
            let x = {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&values::<u32>(t)).unwrap()
            };
            std::thread::sleep(Duration::from_millis(3));
            let start = Instant::now();
            send(&ranks, &x);
            let y = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<u32>(0, t as usize % 2, N, WAIT)).unwrap();
            took.push(start.elapsed());
            let got = ranks.1.enter(1).and_then(|_stage| ranks.1.readback(y)?.wait().map(<[u32]>::to_vec)).unwrap();
            assert!(got == values::<u32>(t), "step {t}: wrong values");
        }
        assert!(ranks.1.block_announcements(0).unwrap() >= steps as u64 - 1);
        took.sort();
        let median = took[took.len() / 2];
        assert!(median < Duration::from_millis(4), "the median step took {median:?} to arrive: {took:?}");
        // Steps of alternating types: each on the connection.
        let in_block = ranks.1.block_announcements(0).unwrap();
        let mut took = Vec::new();
        for t in steps..2 * steps {
            std::thread::sleep(Duration::from_millis(3));
            let start = Instant::now();
            let (arrived, equal) =
                if t % 2 == 0 { send_and_take::<u32>(&ranks, &e0, t) } else { send_and_take::<i32>(&ranks, &e0, t) };
            took.push(arrived - start);
            assert!(equal, "step {t}: wrong values");
        }
        assert_eq!(
            ranks.1.block_announcements(0).unwrap(),
            in_block,
            "a step of a new type was announced in the block"
        );
        took.sort();
        let median = took[took.len() / 2];
        assert!(median < Duration::from_millis(4), "the median step on the connection took {median:?}: {took:?}");
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A `tx_wait` whose wait for a free slot was answered by an earlier answer announces its step in
/// the block while its wait's record is still on the connection: rank 1 takes the step from the
/// block first, and the wait, read after it, is stale, not a failure. The scene, sixteen times:
/// rank 1's stage takes steps 0 to 2 (its take of step 2 answers an earlier wait), rank 0 at once
/// sends step 3 (rank 1's receiver then spins, looking at the block before the connection) and
/// `tx_wait`s step 4: it asks on the connection, reads the earlier answer, finds the slot free.
/// Every step arrives whole. With the stale wait taken for a failure (mutation
/// `ipc-stale-wait-fails`), rank 1 fails the boundary ("a wait for a free slot for step 4 where
/// step 5 was due").
#[test]
fn a_wait_answered_early_and_read_after_its_step_is_stale() {
    with_double("a_wait_answered_early_and_read_after_its_step_is_stale", |_| {
        let primary = Engine::new(0).unwrap();
        for round in 0..16 {
            let ranks = ipc_ranks();
            let e0 = ranks.0.engine(0, &primary).unwrap().clone();
            let inputs: Vec<_> = (0..5u32)
                .map(|t| {
                    let _stage = ranks.0.enter(0).unwrap();
                    e0.htod(&values::<u32>(100 * round + t)).unwrap()
                })
                .collect();
            let send_waiting = |t: usize| {
                ranks.0.enter(0).and_then(|_stage| ranks.0.tx_wait(0, &inputs[t], N, WAIT)).unwrap();
            };
            send(&ranks, &inputs[0]);
            send(&ranks, &inputs[1]);
            for t in 0..2 {
                assert!(take::<u32>(&ranks, t) == values::<u32>(100 * round + t as u32), "round {round}: step {t}");
            }
            send_waiting(2);
            assert!(take::<u32>(&ranks, 2) == values::<u32>(100 * round + 2), "round {round}: step 2");
            send(&ranks, &inputs[3]);
            send_waiting(4);
            for t in 3..5 {
                assert!(take::<u32>(&ranks, t) == values::<u32>(100 * round + t as u32), "round {round}: step {t}");
            }
            drop(inputs);
            let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
            assert!(errors.is_empty(), "round {round}: {errors:?}");
        }
    });
}
/// A `tx_wait` that times out leaves its `WAITING` record for step 3 on the connection, unread
/// while rank 1's receiver thread waits for a free slot for step 2; the `tx` of step 3 that
/// follows is announced in the block, which the receiver thread looks at first and takes step 3
/// from. The wait read afterwards names a step already taken: stale (the wait ended), not a lie.
/// Rank 1 then takes every step, bitwise, and the boundary closes cleanly. With stale waits passed
/// on and the connection read only when the block holds no step (mutations `ipc-stale-wait-fails`
/// and `ipc-connection-unread-while-behind` together), the link fails after step 3; the read every
/// poll interval alone mostly takes the wait before step 3 here, so the first mutation alone is
/// caught by `Inbox`'s unit test `a_wait_read_after_the_block_gave_its_step_is_stale`.
#[test]
fn a_wait_that_timed_out_before_its_step_went_into_the_block_is_stale_not_a_failure() {
    with_double("a_wait_that_timed_out_before_its_step_went_into_the_block_is_stale_not_a_failure", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let inputs: Vec<_> = (0..6u32)
            .map(|t| {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&values::<u32>(t)).unwrap()
            })
            .collect();
        for x in &inputs[..3] {
            send(&ranks, x);
        }
        // Rank 1's receiver thread took steps 0 to 2 and waits for slot 0 (its stage took none).
        std::thread::sleep(Duration::from_millis(200));
        let refused = ranks.0.enter(0).and_then(|_stage| ranks.0.tx_wait(0, &inputs[3], N, Duration::from_millis(50)));
        assert!(
            matches!(refused, Err(ppnrt::Error::Pipeline(ppnrt::PpError::Timeout { .. }))),
            "the wait for step 3: {refused:?}"
        );
        send(&ranks, &inputs[3]);
        for t in 0..4u32 {
            assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
        }
        for t in 4..6u32 {
            send(&ranks, &inputs[t as usize]);
            assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
        }
        assert!(ranks.1.block_announcements(0).unwrap() >= 3, "step 3 was not announced in the block");
        drop(inputs);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A sender that changes the element type at every step for more steps than the block has lines
/// (each on the connection: `u32` and `i32` in turn, steps 0 to 32), then keeps one type (`u32`,
/// steps 33 to 44): the steps taken on the connection count as taken for the block's lines too,
/// so every step of the one type is announced in the block again, and each arrives bitwise. With
/// only the block's steps counted (mutation `ipc-connection-steps-untaken`), every later step
/// stays on the connection.
#[test]
fn steps_taken_on_the_connection_free_the_blocks_lines_for_the_next_steps() {
    with_double("steps_taken_on_the_connection_free_the_blocks_lines_for_the_next_steps", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let alternating = ControlBlock::ANNOUNCEMENTS as u32 + 1;
        for t in 0..alternating + 12 {
            let _stage = ranks.0.enter(0).unwrap();
            if t < alternating && t % 2 == 1 {
                let x = e0.htod(&values::<i32>(t)).unwrap();
                send(&ranks, &x);
                assert!(take::<i32>(&ranks, t as usize) == values::<i32>(t), "step {t}: wrong values");
            } else {
                let x = e0.htod(&values::<u32>(t)).unwrap();
                send(&ranks, &x);
                assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
            }
        }
        assert_eq!(ranks.1.block_announcements(0).unwrap(), 12, "the steps of one type after the changes");
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// `rx` checks the element type of a step announced in the block as it does one of the
/// connection's: steps 0 (`u32`) and 1 (`i32`) on the connection, step 2 (`i32`) in the block;
/// step 2 taken as `u32` (the same byte size) is [`PpError::RxTypeMismatch`] naming both types,
/// and taken as `i32` it reads bitwise. With the block's steps given the first step's type for
/// good (mutation `ipc-block-type-first-only`), step 2 would be read as `u32`, `Ok`.
#[test]
fn a_step_announced_in_the_block_is_refused_to_an_rx_of_another_type() {
    with_double("a_step_announced_in_the_block_is_refused_to_an_rx_of_another_type", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let (zero, one, two) = {
            let _stage = ranks.0.enter(0).unwrap();
            (
                e0.htod(&values::<u32>(0)).unwrap(),
                e0.htod(&values::<i32>(1)).unwrap(),
                e0.htod(&values::<i32>(2)).unwrap(),
            )
        };
        send(&ranks, &zero);
        assert!(take::<u32>(&ranks, 0) == values::<u32>(0), "step 0: wrong values");
        send(&ranks, &one);
        assert!(take::<i32>(&ranks, 1) == values::<i32>(1), "step 1: wrong values");
        send(&ranks, &two);
        let refused = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<u32>(0, 0, N, WAIT).map(|_| ()));
        assert!(
            matches!(
                refused,
                Err(ppnrt::Error::Pipeline(ppnrt::PpError::RxTypeMismatch { requested: "u32", sent: "i32", .. }))
            ),
            "step 2 taken as u32: {refused:?}"
        );
        assert!(take::<i32>(&ranks, 2) == values::<i32>(2), "step 2: wrong values");
        assert_eq!(ranks.1.block_announcements(0).unwrap(), 1, "step 2 was announced in the block");
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A lying peer (any process of the user, through `/proc/<pid>/fd`) announces step 1 in the
/// receiving rank's control block before the sending rank does, with a count of no element, one
/// whose bytes overflow, or one past the slots' capacity: the receiving rank takes none of them
/// as a step. Its boundary fails at once, typed, naming the count (or the bytes and the
/// capacity), and `rx` of step 1 is that failure, never `Ok`. With the count of a step in the
/// block unchecked (mutation `ipc-block-count-unchecked`), or a step past a fixed slot grown
/// instead of refused (`ipc-block-step-past-slot-grown`), the failure is another or none.
#[test]
fn a_count_lied_into_the_block_of_no_element_or_past_the_slot_fails_the_boundary_typed() {
    with_double("a_count_lied_into_the_block_of_no_element_or_past_the_slot_fails_the_boundary_typed", |_| {
        let primary = Engine::new(0).unwrap();
        let past_the_slot = (1u64 << 24) + 1;
        for (count, says) in [
            (0, "step 1: 0 element(s) of 4 byte(s) (u32) in the control block".to_string()),
            (u64::MAX, format!("step 1: {} element(s) of 4 byte(s) (u32) in the control block", u64::MAX)),
            (past_the_slot, format!("a step of {} byte(s) does not fit its slots", past_the_slot * 4)),
        ] {
            let before: std::collections::HashSet<u64> =
                crate::ipc_host_flags::control_blocks().into_iter().map(|(ino, _)| ino).collect();
            let ranks = ipc_ranks();
            let liar = crate::ipc_host_flags::opened_as_peer(&before, 2);
            let e0 = ranks.0.engine(0, &primary).unwrap().clone();
            let x = {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&values::<u32>(0)).unwrap()
            };
            send(&ranks, &x);
            assert!(take::<u32>(&ranks, 0) == values::<u32>(0), "step 0: wrong values");
            liar.announce(1, count);
            let start = Instant::now();
            let taken = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<u32>(0, 1, N, WAIT).map(|_| ()));
            let took = start.elapsed();
            match &taken {
                Err(e @ ppnrt::Error::Pipeline(ppnrt::PpError::PeerFailed { .. })) => {
                    assert!(e.to_string().contains(&says), "count {count}: {e} does not say {says:?}");
                }
                other => panic!("count {count}: step 1 taken as {other:?}"),
            }
            assert!(took < Duration::from_secs(2), "count {count}: the failure took {took:?}");
            crate::drop_ranks_within((ranks, x, liar), Duration::from_secs(15), "the ranks");
        }
    });
}

/// The most bytes any TCP socket of this process holds unread (its receive queue, as
/// `/proc/self/net/tcp` and `tcp6` show it).
fn most_unread_bytes() -> u64 {
    let ours: std::collections::HashSet<u64> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|entry| std::fs::read_link(entry.path()).ok())
        .filter_map(|target| target.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect();
    let mut most = 0;
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            // sl, local, remote, state, tx_queue:rx_queue, tr:when, retransmits, uid, timeout, inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(queues), Some(inode)) = (fields.get(4), fields.get(9)) else { continue };
            if inode.parse::<u64>().is_ok_and(|inode| ours.contains(&inode)) {
                let unread = queues.split(':').nth(1).and_then(|rx| u64::from_str_radix(rx, 16).ok());
                most = most.max(unread.unwrap_or(0));
            }
        }
    }
    most
}

/// Rank 0 stays four steps ahead of rank 1's stage (two slots) for three seconds: rank 1's
/// receiver thread always finds its next step announced in the block, and no step of the
/// connection is there to read, while rank 0 shows it is alive there (a sign of life every 50 ms,
/// for a peer timeout of 500 ms). Those are read as they come: no socket of the process holds
/// more than a few records unread. (Left unread, they fill the connection's buffers, about 4 MB
/// on loopback, and rank 0's next write then times out and fails a healthy boundary: after about
/// a day of steps at the default peer timeout, minutes at the smallest.) With the connection read
/// only when the block holds no step (mutation `ipc-connection-unread-while-behind`), they pile
/// up.
#[test]
fn a_receiver_that_keeps_finding_its_steps_in_the_block_still_reads_the_signs_of_life() {
    with_double("a_receiver_that_keeps_finding_its_steps_in_the_block_still_reads_the_signs_of_life", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(Duration::from_millis(500), |_, config| config.with_slots(2));
        assert_eq!(ranks.0.plan().boundaries[0].transport, Transport::Ipc, "{}", ranks.0.plan());
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        let input = |t: usize| {
            let _stage = ranks.0.enter(0).unwrap();
            e0.htod(&values::<u32>(t as u32)).unwrap()
        };
        let ahead = 4;
        let mut in_flight = std::collections::VecDeque::new();
        for t in 0..ahead {
            let x = input(t);
            send(&ranks, &x);
            in_flight.push_back(x);
        }
        let start = Instant::now();
        let mut t = 0;
        while start.elapsed() < Duration::from_secs(3) {
            assert!(take::<u32>(&ranks, t) == values::<u32>(t as u32), "step {t}: wrong values");
            in_flight.pop_front();
            let x = input(t + ahead);
            send(&ranks, &x);
            in_flight.push_back(x);
            t += 1;
        }
        let unread = most_unread_bytes();
        for t in t..t + ahead {
            assert!(take::<u32>(&ranks, t) == values::<u32>(t as u32), "step {t}: wrong values");
        }
        assert!(ranks.1.block_announcements(0).unwrap() + 1 >= t as u64, "the steps were not announced in the block");
        assert!(unread < 1000, "a socket of the process holds {unread} bytes unread after {t} steps");
        drop(in_flight);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// Any process of the user may write the receiving rank's sleep word: one that keeps writing
/// 0, 2 and `u32::MAX` into it (no wake ever reaches the receiver then, the sender's swap from 1
/// failing) cannot make the receiver miss a step past its bounded sleep: every step arrives,
/// bitwise, each within 2 s (its poll is 10 ms), and the ranks drop in time. With the sleep
/// unbounded (mutation `sleep-word-sleep-unbounded`), a step is never found.
#[test]
fn a_peer_writing_the_sleep_word_cannot_make_the_receiver_miss_a_step_past_its_poll() {
    use std::collections::HashSet;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    with_double("a_peer_writing_the_sleep_word_cannot_make_the_receiver_miss_a_step_past_its_poll", |_| {
        let before: HashSet<u64> = crate::ipc_host_flags::control_blocks().into_iter().map(|(ino, _)| ino).collect();
        let primary = Engine::new(0).unwrap();
        let ranks = ipc_ranks();
        let (_, path) = crate::ipc_host_flags::control_blocks()
            .into_iter()
            .find(|(ino, _)| !before.contains(ino))
            .expect("the boundary's control block is open in this process");
        let peer = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let stop = AtomicBool::new(false);
        let e0 = ranks.0.engine(0, &primary).unwrap().clone();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for value in [0u32, 2, u32::MAX].into_iter().cycle() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // The sleep word: the first four bytes at offset 40.
                    peer.write_all_at(&value.to_le_bytes(), 40).unwrap();
                    std::thread::sleep(Duration::from_micros(100));
                }
            });
            // The writer stops however this thread leaves the scope (a failed step included).
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            let mut took = Vec::new();
            for t in 0..30u32 {
                let x = {
                    let _stage = ranks.0.enter(0).unwrap();
                    e0.htod(&values::<u32>(t)).unwrap()
                };
                std::thread::sleep(Duration::from_millis(3));
                let start = Instant::now();
                send(&ranks, &x);
                assert!(take::<u32>(&ranks, t as usize) == values::<u32>(t), "step {t}: wrong values");
                took.push(start.elapsed());
            }
            let slowest = took.iter().max().unwrap();
            assert!(*slowest < Duration::from_secs(2), "a step took {slowest:?} to arrive: {took:?}");
        });
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}
