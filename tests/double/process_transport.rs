//! The transport between two ranks of one host, chosen at the rendezvous (two ranks as threads
//! of this process, through the doubles, whose devices are peers): `auto` takes IPC and the plan
//! says why; steps move exactly, through the driver alone; a step larger than the slots is a
//! typed error with nothing sent; a slot read in place is not written again until its guard is
//! dropped; a forced `nccl` says so.

use super::sweep_ranks::{REMOTE_RECEIVE_WAIT, remote_step};
use super::sweep_step::Swept;
use super::*;
use ppnrt::{PpError, ProcessTransport, Transport};

fn pattern_of(t: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (t << 20 | 0x1c5)).collect()
}

#[test]
fn auto_takes_ipc_on_one_host_and_moves_every_step_exactly_through_the_driver_alone() {
    with_double("auto_takes_ipc_on_one_host_and_moves_every_step_exactly_through_the_driver_alone", |double| {
        let ranks = two_ranks(std::time::Duration::from_secs(10));
        for rank in [&ranks.0, &ranks.1] {
            let boundary = rank.plan().boundaries[0];
            assert_eq!(boundary.transport, Transport::Ipc);
            let line = rank.plan().to_string();
            assert!(line.ends_with("ipc (same host, peer access)"), "{line}");
        }
        let primary = Engine::new(0).unwrap();
        let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
        let lengths = [1usize, 1024, 4096, 3, 1024, 777, 2048, 2048, 1];
        let inputs: Vec<CudaSlice<u32>> = {
            let _stage = ranks.0.enter(0).unwrap();
            lengths.iter().enumerate().map(|(t, &n)| e0.htod(&pattern_of(t as u32, n)).unwrap()).collect()
        };
        let nccl = double::nccl_double();
        let (sends, recvs) = (nccl.calls("ncclSend"), nccl.calls("ncclRecv"));
        for (t, (input, &n)) in inputs.iter().zip(&lengths).enumerate() {
            match remote_step(&ranks, &e1, input, n, t % 2 == 1) {
                Swept::Delivered(values) => assert!(values == pattern_of(t as u32, n), "step {t}: wrong values"),
                other => panic!("step {t}: {other:?}"),
            }
        }
        assert_eq!((nccl.calls("ncclSend"), nccl.calls("ncclRecv")), (sends, recvs), "a step went through NCCL");
        drop(inputs);
        drop(ranks);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
        double.flush();
    });
}

#[test]
fn a_step_larger_than_the_slots_is_refused_with_nothing_sent_and_the_boundary_goes_on() {
    with_double("a_step_larger_than_the_slots_is_refused_with_nothing_sent_and_the_boundary_goes_on", |_| {
        let ranks = two_ranks(std::time::Duration::from_secs(10));
        let primary = Engine::new(0).unwrap();
        let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
        // Far past any allocation granularity the slots were rounded to.
        let huge = 64 << 20;
        let (big, small) = {
            let _stage = ranks.0.enter(0).unwrap();
            (e0.alloc_zeroed::<u32>(huge).unwrap(), e0.htod(&pattern_of(5, 1000)).unwrap())
        };
        let err = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &big, huge)).unwrap_err();
        assert!(
            matches!(err, Error::Pipeline(PpError::StepTooLarge { boundary: 0, bytes, .. }) if bytes == huge * 4),
            "{err}"
        );
        assert!(err.to_string().contains("reserve_bytes"), "{err}");
        // Nothing was sent: the next step is step 0, in slot 0, whole.
        match remote_step(&ranks, &e1, &small, 1000, false) {
            Swept::Delivered(values) => assert!(values == pattern_of(5, 1000), "wrong values"),
            other => panic!("{other:?}"),
        }
        drop((big, small));
        drop(ranks);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
    });
}

/// The sending rank writes the receiving rank's slots through its own mapping, so a slot lent to
/// a `ReceivedSlot` cannot be given another buffer as an in-process ring does: the step that comes
/// back to it waits until the guard is dropped, the guard's bytes stay whole meanwhile (however
/// long it is held, past the ring's grace for lent slots), and the step arrives whole after.
#[test]
fn a_slot_read_in_place_is_not_written_again_until_its_guard_is_dropped() {
    with_double("a_slot_read_in_place_is_not_written_again_until_its_guard_is_dropped", |_| {
        let ranks = two_ranks(std::time::Duration::from_secs(10));
        let primary = Engine::new(0).unwrap();
        let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
        let n = 1024;
        let n_slots = ranks.0.n_slots();
        let inputs: Vec<CudaSlice<u32>> = {
            let _stage = ranks.0.enter(0).unwrap();
            (0..=n_slots).map(|t| e0.htod(&pattern_of(t as u32, n)).unwrap()).collect()
        };
        let stage1 = ranks.1.enter(1).unwrap();
        let slot = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[0], n)).unwrap();
        let guard = ranks.1.rx_in_place_wait::<u32>(0, slot, n, REMOTE_RECEIVE_WAIT).unwrap();
        // Every other slot is received; the last step comes back to the guard's slot.
        for (t, input) in inputs.iter().enumerate().skip(1) {
            let slot = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, n)).unwrap();
            if t < n_slots {
                let y = ranks.1.rx_wait::<u32>(0, slot, n, REMOTE_RECEIVE_WAIT).unwrap();
                assert!(e1.dtoh(&y).unwrap() == pattern_of(t as u32, n), "step {t}");
            }
        }
        // Past the ring's grace for lent slots (one second): the guard still reads step 0.
        std::thread::sleep(std::time::Duration::from_millis(1300));
        let mut held = e1.alloc::<u32>(n).unwrap();
        e1.dtod(&guard.view().unwrap(), &mut held).unwrap();
        assert!(e1.dtoh(&held).unwrap() == pattern_of(0, n), "the lent slot was written while its guard lived");
        drop(guard);
        let y = ranks.1.rx_wait::<u32>(0, slot, n, REMOTE_RECEIVE_WAIT).unwrap();
        assert!(e1.dtoh(&y).unwrap() == pattern_of(n_slots as u32, n), "the step after the guard");
        drop(stage1);
        drop(inputs);
        drop(ranks);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
    });
}

#[test]
fn a_forced_nccl_boundary_says_so_and_a_forced_ipc_one_is_chosen_by_reach() {
    with_double("a_forced_nccl_boundary_says_so_and_a_forced_ipc_one_is_chosen_by_reach", |_| {
        let timeout = std::time::Duration::from_secs(10);
        let forced =
            ranks::two_ranks_configured(timeout, |_, config| config.with_process_transport(ProcessTransport::Nccl));
        assert!(forced.0.plan().to_string().ends_with("nccl (forced)"), "{}", forced.0.plan());
        drop(forced);
        let ipc =
            ranks::two_ranks_configured(timeout, |_, config| config.with_process_transport(ProcessTransport::Ipc));
        assert!(ipc.1.plan().to_string().ends_with("ipc (same host, peer access)"), "{}", ipc.1.plan());
        drop(ipc);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
    });
}
