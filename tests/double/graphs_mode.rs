//! Graph mode through the double: the shared graph scenarios of `common/graphs.rs`, the calls a
//! graph step makes, a rank's build and the rendezvous, waits per write.

use super::*;

#[path = "../common/graph_order.rs"]
mod graph_order;

/// Two stages: a graph step (whole, or stage by stage) after an eager step left half-way, its
/// `tx` not received, is refused instead of overtaking it; on one device and on two.
#[test]
fn a_graph_step_never_overtakes_an_unreceived_eager_step_through_the_double() {
    with_double("a_graph_step_never_overtakes_an_unreceived_eager_step_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graph_order::a_graph_step_never_overtakes_an_unreceived_eager_step(&primary, &[0, 0]);
        graph_order::a_graph_step_never_overtakes_an_unreceived_eager_step(&primary, &[0, 1]);
    });
}

/// A capture of rings that stand at different slots is refused, naming each, until the eager
/// step that crossed only some boundaries is finished.
#[test]
fn a_capture_refuses_rings_out_of_step_through_the_double() {
    with_double("a_capture_refuses_rings_out_of_step_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graph_order::a_capture_refuses_rings_out_of_step(&primary, &[0, 0, 0]);
        graph_order::a_capture_refuses_rings_out_of_step(&primary, &[0, 1, 0]);
    });
}

#[test]
fn graph_mode_matches_eager_and_one_stage_through_the_double() {
    with_double("graph_mode_matches_eager_and_one_stage_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::graph_mode_matches_eager_and_one_stage("graph_mode (double)", &primary, 2, true);
    });
}

#[test]
fn capture_misuse_is_a_typed_error_through_the_double() {
    with_double("capture_misuse_is_a_typed_error_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::capture_misuse_is_a_typed_error(&primary, &[0, 1, 0]);
        graphs::capture_misuse_is_a_typed_error(&primary, &[0]);
    });
}

#[test]
fn mismatched_graph_steps_are_refused_through_the_double() {
    with_double("mismatched_graph_steps_are_refused_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::mismatched_graph_steps_are_refused(&primary, &[0, 1, 0]);
    });
}

#[test]
fn graphs_launched_from_two_threads_keep_their_order_through_the_double() {
    with_double("graphs_launched_from_two_threads_keep_their_order_through_the_double", |_| {
        let against = graphs::graphs_launched_from_two_threads_keep_their_order(&Engine::new(0).unwrap(), 300);
        assert_eq!(against, 0, "graph launches from two threads ran against the buffer's recorded order");
    });
}

#[test]
fn graphs_keep_their_memory_alive_and_ordered_through_the_double() {
    with_double("graphs_keep_their_memory_alive_and_ordered_through_the_double", |_| {
        graphs::graphs_keep_their_memory_alive_and_ordered(&Engine::new(0).unwrap());
    });
}

#[test]
fn one_thread_per_stage_replays_graphs_through_the_double() {
    with_double("one_thread_per_stage_replays_graphs_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 1, 0, 1], 2, 12);
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 1], 3, 10);
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0], 1, 5);
    });
}

#[test]
fn launch_stage_refusals_lose_nothing_through_the_double() {
    with_double("launch_stage_refusals_lose_nothing_through_the_double", |_| {
        graphs::launch_stage_refusals_lose_nothing(&Engine::new(0).unwrap(), &[0, 1, 0]);
    });
}

#[test]
fn racing_launches_of_one_stage_never_share_a_slot_through_the_double() {
    with_double("racing_launches_of_one_stage_never_share_a_slot_through_the_double", |_| {
        graphs::racing_launches_of_one_stage_never_share_a_slot(&Engine::new(0).unwrap(), &[0, 1], 300);
    });
}

/// Many steps of one thread per stage, with stages running up to a ring's length ahead of each
/// other: every stage's slot count stays right while the others' move. (The runtime once read the
/// first ring's position outside its lock: a stage that fell behind was sent a step ahead, and
/// this test failed in most runs.)
#[test]
fn one_thread_per_stage_keeps_its_slot_count_under_contention_through_the_double() {
    with_double("one_thread_per_stage_keeps_its_slot_count_under_contention_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        for _ in 0..4 {
            graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 1], 3, 200);
            graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 1, 0, 1], 2, 200);
        }
    });
}

pub(crate) mod schedules {
    use super::*;
    use graphs::StepKind;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = StepKind> {
        prop_oneof![
            Just(StepKind::Eager),
            Just(StepKind::Graph),
            Just(StepKind::StageByStage),
            Just(StepKind::Interrupted)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Any interleaving of eager steps, whole-step graph launches and stage-by-stage graph
        /// launches, on any stage map over two devices with 1–3 slots, gives bitwise the
        /// one-stage model's outputs; a whole-step launch tried while an eager step is half-way
        /// is refused (it would overtake that step) and changes nothing.
        #[test]
        fn any_interleaving_of_eager_and_graph_steps_matches_one_stage(
            map in proptest::collection::vec(0i32..2, 1..6),
            slots in 1usize..4,
            kinds in proptest::collection::vec(kind(), 1..10),
            seed in any::<u64>(),
        ) {
            with_double("any_interleaving_of_eager_and_graph_steps_matches_one_stage", |_| {
                let primary = Engine::new(0).unwrap();
                graphs::random_schedule_matches(&primary, PpConfig::with_devices(&map).with_slots(slots), &kinds, seed);
            });
        }
    }
}

#[test]
fn graph_misuse_leaves_everything_sound_through_the_double() {
    with_double("graph_misuse_leaves_everything_sound_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::graph_misuse_leaves_everything_sound(&primary, &[0, 1, 0]);
    });
}

#[test]
fn a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only() {
    with_double("a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, label) in [(vec![0, 1, 0, 1], "alternating"), (vec![0, 0, 0, 0], "one device")] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(2), &primary).unwrap();
            let n = 4096;
            let mut buffers = graphs::StepBuffers::new(&rt, &primary, n);
            let mut step = graphs::capture(&rt, &primary, &mut buffers, n, false).unwrap();
            for _ in 0..4 {
                step.launch().unwrap(); // warm-up: every slot used once, pooled events made
            }
            let entries = [
                "cuGraphLaunch",
                "cuStreamWaitEvent",
                "cuEventRecord",
                "cuLaunchKernel",
                "cuMemcpyAsync",
                "cuMemAllocAsync",
                "cuMemFreeAsync",
                "cuEventCreate",
                "cuEventQuery",
                "cuStreamQuery",
                "cuStreamSynchronize",
            ];
            let per_step = double.calls_per_run(&entries, 50, || {
                step.launch().unwrap();
            });
            let calls = |entry: &str| per_step.of(entry);
            let boundaries = (devices.len() - 1) as f64;
            common::say(&format!("driver calls per graph step ({label}): {:?}", per_step.0));
            assert_eq!(calls("cuGraphLaunch"), devices.len() as f64, "{label}: one launch per stage");
            // Per boundary: the reader waits for the write, the writer for the read; each side
            // records its use.
            assert_eq!(calls("cuStreamWaitEvent"), 2.0 * boundaries, "{label}");
            assert_eq!(calls("cuEventRecord"), 2.0 * boundaries, "{label}");
            for entry in [
                "cuLaunchKernel",
                "cuMemcpyAsync",
                "cuMemAllocAsync",
                "cuMemFreeAsync",
                "cuEventCreate",
                "cuEventQuery",
                "cuStreamQuery",
                "cuStreamSynchronize",
            ] {
                assert_eq!(calls(entry), 0.0, "{label}: {entry}");
            }
            rt.synchronize().unwrap();
        }
    });
}

/// A rank builds only its own stages: another rank's device ordinal is never checked here, its
/// own must be present (a `ConfigError` before any network call), and a rendezvous nobody
/// answers is a typed timeout within the peer timeout, not a hang.
#[test]
fn a_rank_builds_only_its_stages_and_a_silent_rendezvous_times_out_typed() {
    with_double("a_rank_builds_only_its_stages_and_a_silent_rendezvous_times_out_typed", |_| {
        let primary = Engine::new(0).unwrap();
        let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let silent = format!("127.0.0.1:{}", unused.port()); // nobody listens there once dropped
        let timeout = std::time::Duration::from_millis(300);
        let config = |devices: &[i32]| {
            PpConfig::with_devices(devices)
                .with_ranks(&[1, 0, 1])
                .with_rank(1)
                .with_rendezvous(&silent)
                .with_peer_timeout(timeout)
        };
        // Rank 1 runs stages 0 and 2; stage 1's device 99 is rank 0's business.
        let start = std::time::Instant::now();
        let err = PpNRt::new(config(&[0, 99, 0]), &primary).unwrap_err();
        assert!(
            matches!(err, Error::Rendezvous(ppnrt::rendezvous::RendezvousError::Timeout { .. })),
            "expected a rendezvous timeout, got {err}"
        );
        assert!(start.elapsed() < timeout * 10, "gave up after {:?}", start.elapsed());
        // Its own stage on a device that is not there is refused first, named as the caller set it.
        let err = PpNRt::new(config(&[99, 0, 0]), &primary).unwrap_err();
        assert!(
            matches!(&err, Error::Config(e) if e.setting == "PpConfig::with_devices" && e.reason.contains("99")),
            "{err}"
        );
    });
}

/// A stream that reads a buffer written on another stream waits for that write once, however
/// many times it reads the buffer; a new write is waited for again, and every read sees the
/// write it follows.
#[test]
fn a_stream_waits_once_per_write_it_reads_not_once_per_read() {
    with_double("a_stream_waits_once_per_write_it_reads_not_once_per_read", |double| {
        let e = Engine::new(0).unwrap();
        let writer = CudaStream::new(e.context()).unwrap();
        let reader = CudaStream::new(e.context()).unwrap();
        let mut x = CudaSlice::<u32>::alloc(&writer, 1024).unwrap();
        let mut outs: Vec<CudaSlice<u32>> = (0..4).map(|_| CudaSlice::<u32>::alloc(&reader, 1024).unwrap()).collect();
        writer.synchronize().unwrap();
        reader.synchronize().unwrap();
        writer.memset_u32(&mut x, 7).unwrap();
        let waits = double.calls_per_run(&["cuStreamWaitEvent"], 1, || {
            for out in &mut outs[..3] {
                reader.memcpy_dtod(&x, out).unwrap();
            }
        });
        assert_eq!(waits.of("cuStreamWaitEvent"), 1.0, "three reads of one write");
        writer.memset_u32(&mut x, 9).unwrap();
        let waits = double.calls_per_run(&["cuStreamWaitEvent"], 1, || {
            reader.memcpy_dtod(&x, &mut outs[3]).unwrap();
        });
        assert_eq!(waits.of("cuStreamWaitEvent"), 1.0, "a new write is waited for again");
        for (i, out) in outs.iter().enumerate() {
            let expected = if i < 3 { 7 } else { 9 };
            assert!(e.dtoh(out).unwrap().iter().all(|&v| v == expected), "read {i} saw another write");
        }
        drop(outs);
        drop(x);
        writer.synchronize().unwrap();
        reader.synchronize().unwrap();
        assert_eq!(double.violations(), 0, "{}", double.last_violation());
    });
}
