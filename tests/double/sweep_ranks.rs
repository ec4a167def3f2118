//! The fault sweeps across ranks: two ranks of one pipeline as threads of this process through
//! the driver and NCCL doubles, every driver and NCCL call of a step, a setup and a teardown failed
//! in turn, in whichever rank makes it.

use super::*;
use ppnrt::ProcessTransport;

/// How long a remote sweep's receive waits for its slot: far past the peer timeout, so that a
/// receive that times out was stalled, not slow.
pub(crate) const REMOTE_RECEIVE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Drops runtimes (one rank's, or both ranks'), failing when that takes longer than `limit` (a
/// hang); returns the errors the drops recorded.
pub(crate) fn drop_ranks_within<R: Send + 'static>(ranks: R, limit: std::time::Duration, case: &str) -> Vec<Error> {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(ranks);
        let _ = done.send(typed_drop_errors());
    });
    finished.recv_timeout(limit).unwrap_or_else(|_| panic!("{case}: dropping the ranks took over {limit:?}"))
}

/// One step across the two ranks: rank 0's `tx` of `input`, rank 1's receive (waiting for the
/// slot to be filled) and deferred readback.
pub(crate) fn remote_step(
    ranks: &(PpNRt, PpNRt),
    e1: &Engine,
    input: &CudaSlice<u32>,
    n: usize,
    in_place: bool,
) -> Swept {
    match ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, n)) {
        Ok(slot) => receive_and_read_back_within(&ranks.1, e1, slot, n, in_place, Some(REMOTE_RECEIVE_WAIT)),
        Err(e) => Swept::NotSent(e),
    }
}

/// Whether `e` is the typed failure of a boundary to another rank.
pub(crate) fn peer_failed(e: &Error) -> bool {
    matches!(e, Error::Pipeline(ppnrt::PpError::PeerFailed { .. }))
}

/// What one run of a sweep across ranks saw: whether it reached its failing call, the errors calls
/// returned, and those drops recorded.
pub(crate) struct RanksRun {
    pub(crate) reached: bool,
    pub(crate) errors: Vec<Error>,
    pub(crate) drop_errors: Vec<Error>,
}

/// The loop of the sweeps across ranks, [`sweep_calls`] for calls of either double made by either
/// rank: runs `run` once for each call of `faults` (`true` for the NCCL double's, the entry point,
/// the calls made), with that call failing. `run` sets the ranks up, [`arm`](Injected::arm)s the
/// failure, disarms it and reports what it saw. After each run: a run that reached its failure
/// saw an error naming the call (a failure the crate got over is recorded); once every queued
/// operation ran, nothing touched freed memory, and at most one allocation per drop error is
/// left (a drop that cannot order or free its memory leaves it allocated, since it may be in
/// use, and records why). A run that did not reach its failure runs again (three runs at most);
/// the calls no run reached go into `unreached`. Returns the number of calls swept.
pub(crate) fn sweep_across_ranks(
    double: &double::Double,
    faults: &[(bool, String, u64)],
    what: &str,
    unreached: &mut Vec<String>,
    mut run: impl FnMut(&mut Injected<'_>) -> RanksRun,
) -> usize {
    // Runs of one failing call at most: a run that did not reach its call runs again.
    const ATTEMPTS: i32 = 3;
    let mut runs = 0;
    for (in_nccl, entry, made) in faults {
        let mut reached_at = None;
        for (nth, attempt) in (1..=*made as i32).flat_map(|nth| (0..ATTEMPTS).map(move |attempt| (nth, attempt))) {
            if attempt > 0 && reached_at.is_some_and(|at| at == nth) {
                continue;
            }
            let case = format!("{what}: call {nth} of {made} to {entry} failing");
            let mut injected =
                Injected { double, in_nccl: *in_nccl, entry, nth, case: case.clone(), calls_before: None };
            let _ = ppnrt::take_drop_errors();
            let violations = double.violations();
            double.flush();
            let live_before = double.live_allocations();
            let RanksRun { reached, errors, drop_errors } = run(&mut injected);
            if reached {
                assert!(
                    errors.iter().chain(&drop_errors).any(|e| injected.names(e)),
                    "{case}: no error names the call: {errors:?}; recorded by drops: {drop_errors:?}"
                );
                reached_at = Some(nth);
            } else if attempt + 1 == ATTEMPTS {
                // A call the measured run made and these did not: the receive's capture waits
                // for NCCL's work on a clock (at most a millisecond), and takes NCCL's call when
                // it finds the work still running; a setup's waits for the other rank poll (a
                // loaded machine polls fewer times), so a run that missed its call is run again.
                unreached.push(case.clone());
            }
            double.clear_faults();
            double.flush();
            assert_eq!(double.violations(), violations, "{case}: {}", double.last_violation());
            let (live, live_pinned) = double.live_allocations();
            let left = (live - live_before.0) + (live_pinned - live_before.1);
            assert!(
                left <= drop_errors.len() as u64,
                "{case}: {left} allocation(s) left, {} drop error(s) recorded: {drop_errors:?}",
                drop_errors.len()
            );
            runs += usize::from(attempt == 0);
        }
    }
    runs
}

/// The operation swept by
/// [`every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RemoteSwept {
    /// A step of the warm steps' length: received through the receive graph captured for it.
    Steady,
    /// A step of a length not seen before: NCCL's receive call (the slot grows).
    NewLength,
    /// The second step of a new length in a row: its receive is captured, then launched.
    Captured,
    /// Both runtimes dropped, with a step's readback and the input's free still queued.
    Teardown,
}

/// The NCCL double's calls that `body` makes, per entry point, but for the watchdog's polls of
/// asynchronous errors (made on a clock, not by the operation).
pub(crate) fn nccl_calls_made_by(body: impl FnOnce()) -> Vec<(String, u64)> {
    let mut made = double::nccl_double().calls_made_by(body);
    made.retain(|(entry, _)| entry != "ncclCommGetAsyncError");
    made
}

/// The fault sweep across ranks: two ranks of one pipeline (threads of this process, through
/// the driver and NCCL doubles) run warm steps, then every driver call and NCCL call that one
/// more operation makes (a steady step received through its captured graph, a step of a new
/// length, a step whose receive is captured, each received by copy and in place; and the two
/// runtimes' teardown) is failed in turn, one per run, and so is the watchdog's next poll of
/// NCCL's asynchronous error. Whatever call fails, in whichever rank: nothing hangs (a receive
/// waits far past the peer timeout and must not time out; the drops are bounded); an error
/// names the failing call; a receive that failed in its own rank (the link alive) is received
/// again whole; a link that failed makes every later step fail `PeerFailed` in both ranks, never
/// stall or deliver wrong data; a run that saw no `PeerFailed` delivers its next steps; and once
/// both runtimes are dropped and every queued operation ran, nothing touched freed memory (the
/// NCCL double's sends and receives included) and no allocation is left.
#[test]
fn every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing() {
    with_double("every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing", |double| {
        double::nccl_double().clear_faults();
        const WARM: usize = 5;
        const AFTER: usize = 3;
        let peer_timeout = std::time::Duration::from_secs(3);
        let drop_limit = peer_timeout * 4;
        let n = 2048;
        let mut cases = 0;
        let mut unreached = Vec::new();
        for transport in [ProcessTransport::Nccl, ProcessTransport::Ipc] {
            for swept in [RemoteSwept::Steady, RemoteSwept::NewLength, RemoteSwept::Captured, RemoteSwept::Teardown] {
                for in_place in [false, true] {
                    if swept == RemoteSwept::Teardown && in_place {
                        continue;
                    }
                    let what =
                        format!("across ranks over {transport}, {swept:?}{}", if in_place { " in place" } else { "" });
                    // Step t's length; the swept step is step WARM.
                    let len = |t: usize| match swept {
                        RemoteSwept::NewLength if t == WARM => 3 * n,
                        RemoteSwept::Captured if t == WARM - 1 || t == WARM => 3 * n,
                        _ => n,
                    };
                    let data = |t: usize| -> Vec<u32> {
                        (0..len(t) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ ((t as u32) << 20 | 0x7e1)).collect()
                    };
                    // Two ranks with their inputs made and WARM steps run.
                    let warm = || {
                        let ranks = ranks::two_ranks_configured(peer_timeout, |_, config| {
                            config.with_process_transport(transport)
                        });
                        let primary = Engine::new(0).unwrap();
                        let (e0, e1) = (
                            ranks.0.engine(0, &primary).unwrap().clone(),
                            ranks.1.engine(1, &primary).unwrap().clone(),
                        );
                        let inputs: Vec<Option<CudaSlice<u32>>> = {
                            let _stage = ranks.0.enter(0).unwrap();
                            (0..WARM + 1 + AFTER).map(|t| Some(e0.htod(&data(t)).unwrap())).collect()
                        };
                        for (t, input) in inputs.iter().enumerate().take(WARM) {
                            match remote_step(&ranks, &e1, input.as_ref().unwrap(), len(t), in_place) {
                                Swept::Delivered(values) => assert!(values == data(t), "{what}: warm step {t}"),
                                other => panic!("{what}: warm step {t}: {other:?}"),
                            }
                        }
                        double.flush();
                        // Each run starts with no context current: a failed restore of the current
                        // context in an earlier run changes nothing here.
                        raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                        (ranks, e1, inputs)
                    };
                    // For the teardown swept: step WARM sent and its readback queued.
                    let last_step_queued = |ranks: &(PpNRt, PpNRt), inputs: &[Option<CudaSlice<u32>>]| {
                        let slot = ranks.0.tx(0, inputs[WARM].as_ref().unwrap(), len(WARM)).unwrap();
                        let received = ranks.1.rx_wait::<u32>(0, slot, len(WARM), REMOTE_RECEIVE_WAIT).unwrap();
                        ranks.1.readback(received).unwrap()
                    };
                    // The teardown swept: the inputs freed, the readback dropped unread, both runtimes
                    // dropped; the errors the drops recorded.
                    let teardown =
                        |ranks: (PpNRt, PpNRt), inputs: Vec<Option<CudaSlice<u32>>>, pending| -> Vec<Error> {
                            drop(inputs);
                            drop::<ppnrt::pp::PendingReadback<u32>>(pending);
                            drop_ranks_within(ranks, drop_limit, &what)
                        };
                    // The calls of one swept operation, per entry point, in each library.
                    let count_calls = || {
                        let (ranks, e1, inputs) = warm();
                        let mut ranks = Some(ranks);
                        let mut inputs = Some(inputs);
                        let mut nccl_made = Vec::new();
                        let mut pending = (swept == RemoteSwept::Teardown)
                            .then(|| last_step_queued(ranks.as_ref().unwrap(), inputs.as_ref().unwrap()));
                        let driver_made = double.calls_made_by(|| {
                            nccl_made = nccl_calls_made_by(|| {
                                if let Some(pending) = pending.take() {
                                    let errors = teardown(ranks.take().unwrap(), inputs.take().unwrap(), pending);
                                    assert!(errors.is_empty(), "{what}: {errors:?}");
                                } else {
                                    let input = inputs.as_ref().unwrap()[WARM].as_ref().unwrap();
                                    let step = remote_step(ranks.as_ref().unwrap(), &e1, input, len(WARM), in_place);
                                    assert!(
                                        matches!(&step, Swept::Delivered(v) if *v == data(WARM)),
                                        "{what}: {step:?}"
                                    );
                                }
                            });
                        });
                        drop(inputs);
                        if let Some(ranks) = ranks {
                            let errors = drop_ranks_within(ranks, drop_limit, &what);
                            assert!(errors.is_empty(), "{what}: {errors:?}");
                        }
                        (driver_made, nccl_made)
                    };
                    // Counted twice, each entry point's fewer kept: the ranks' own threads (receivers,
                    // the watchdog) make some calls on their clocks, and a count that caught more of
                    // them than a run makes would sweep calls no run reaches.
                    let (first, second) = (count_calls(), count_calls());
                    // An IPC step writes a flag word: its signal (a slot freed ahead), or its wait
                    // for the slot then the cancellable copy's signal kernel (a slot not freed
                    // yet). Which one a run takes depends on the receiver's thread: each count is
                    // looked at alone.
                    let flagged = |calls: &[(String, u64)]| {
                        calls.iter().any(|(entry, _)| {
                            entry.starts_with("cuStreamWriteValue64") || entry.starts_with("cuStreamWaitValue64")
                        })
                    };
                    let flags_written = flagged(&first.0) && flagged(&second.0);
                    let (driver_calls, nccl_calls) = (fewer_calls(first.0, &second.0), fewer_calls(first.1, &second.1));
                    if transport == ProcessTransport::Nccl {
                        assert!(
                            nccl_calls.iter().any(|(entry, _)| entry == "ncclSend" || entry == "ncclCommDestroy"),
                            "{what}: no NCCL call: {nccl_calls:?}"
                        );
                    } else {
                        // An IPC boundary moves its steps with the driver alone, and signals them
                        // through flag words.
                        assert!(
                            nccl_calls
                                .iter()
                                .all(|(entry, _)| !entry.starts_with("ncclSend") && !entry.starts_with("ncclRecv")),
                            "{what}: {nccl_calls:?}"
                        );
                        assert!(
                            swept == RemoteSwept::Teardown || flags_written,
                            "{what}: no flag written: {driver_calls:?}"
                        );
                    }
                    let mut faults: Vec<(bool, String, u64)> =
                        driver_calls.into_iter().map(|(e, c)| (false, e, c)).collect();
                    faults.extend(nccl_calls.into_iter().map(|(e, c)| (true, e, c)));
                    if swept == RemoteSwept::Steady && !in_place && transport == ProcessTransport::Nccl {
                        faults.push((true, "ncclCommGetAsyncError".to_string(), 1));
                    }
                    cases += sweep_across_ranks(double, &faults, &what, &mut unreached, |injected| {
                        let case = injected.case.clone();
                        let (ranks, e1, mut inputs) = warm();
                        // The errors calls returned, and those drops recorded.
                        let mut errors: Vec<Error> = Vec::new();
                        let mut drop_errors: Vec<Error> = Vec::new();
                        // The watchdog's poll comes on its clock; the operation's calls are made
                        // when it returns.
                        let within = if injected.entry == "ncclCommGetAsyncError" {
                            drop_limit
                        } else {
                            std::time::Duration::from_millis(100)
                        };
                        let reached = if swept == RemoteSwept::Teardown {
                            let pending = last_step_queued(&ranks, &inputs);
                            injected.arm();
                            drop_errors.extend(teardown(ranks, inputs, pending));
                            let (reached, recorded) = injected.disarm_if_reached_within(within);
                            drop_errors.extend(recorded);
                            reached
                        } else {
                            injected.arm();
                            let input = inputs[WARM].as_ref().unwrap();
                            let outcome = remote_step(&ranks, &e1, input, len(WARM), in_place);
                            let (reached, recorded) = injected.disarm_if_reached_within(within);
                            // A failure on a clock (the watchdog's poll) may fail the link between
                            // two calls; any other failure is met by a call.
                            let on_a_clock = injected.entry == "ncclCommGetAsyncError";
                            drop_errors.extend(recorded);
                            inputs[WARM] = None;
                            match outcome {
                                Swept::Delivered(values) => assert!(values == data(WARM), "{case}: wrong values"),
                                Swept::NotSent(e) | Swept::NotReadBack(e, None) => errors.push(e),
                                Swept::NotReadBack(e, Some(again)) => {
                                    assert!(again == data(WARM), "{case}: the second wait gave wrong values");
                                    errors.push(e);
                                }
                                Swept::NotReceived(slot, e) => {
                                    let again = receive_and_read_back_within(
                                        &ranks.1,
                                        &e1,
                                        slot,
                                        len(WARM),
                                        in_place,
                                        Some(REMOTE_RECEIVE_WAIT),
                                    );
                                    match again {
                                        Swept::Delivered(values) if !peer_failed(&e) => {
                                            assert!(values == data(WARM), "{case}: the second receive: wrong values")
                                        }
                                        Swept::NotReceived(_, again) if peer_failed(&e) && peer_failed(&again) => {}
                                        other => panic!("{case}: the receive failed with {e}; again: {other:?}"),
                                    }
                                    errors.push(e);
                                }
                            }
                            // The next steps: delivered, or, once the link failed, `PeerFailed`.
                            let mut link_failed = errors.iter().any(peer_failed);
                            let saw_peer_failed = link_failed;
                            for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                                match remote_step(&ranks, &e1, input.as_ref().unwrap(), len(t), in_place) {
                                    Swept::Delivered(values) => {
                                        assert!(!link_failed, "{case}: step {t} delivered after the link failed");
                                        assert!(values == data(t), "{case}: step {t}: wrong values");
                                    }
                                    Swept::NotSent(e) | Swept::NotReceived(_, e) | Swept::NotReadBack(e, None)
                                        if peer_failed(&e) =>
                                    {
                                        link_failed = true;
                                        errors.push(e);
                                    }
                                    other => panic!("{case}: step {t} after the failure: {other:?}"),
                                }
                            }
                            assert!(
                                saw_peer_failed || !link_failed || on_a_clock,
                                "{case}: the link failed after a step that did not report it"
                            );
                            if link_failed {
                                // Each rank's own account of the failure (the rank that failed first
                                // says why; its peer, that the connection closed, which it learns
                                // within milliseconds: until then a call of it may still succeed).
                                let until = std::time::Instant::now() + drop_limit;
                                let short = std::time::Duration::from_millis(1);
                                let mut accounts = 0;
                                while accounts < 2 && std::time::Instant::now() < until {
                                    accounts = 0;
                                    for account in [
                                        ranks.1.rx_wait::<u32>(0, 0, n, short).err(),
                                        ranks.0.tx(0, inputs[0].as_ref().unwrap(), n).err(),
                                    ]
                                    .into_iter()
                                    .flatten()
                                    .filter(peer_failed)
                                    {
                                        errors.push(account);
                                        accounts += 1;
                                    }
                                }
                                assert_eq!(accounts, 2, "{case}: a rank never learned that the link failed");
                            }
                            drop(inputs);
                            drop_errors.extend(drop_ranks_within(ranks, drop_limit, &case));
                            reached
                        };
                        RanksRun { reached, errors, drop_errors }
                    });
                }
            }
        }
        println!(
            "fault sweep across ranks: {cases} runs, each with one failing driver or NCCL call; {} of them did \
             not reach it: {unreached:?}",
            unreached.len()
        );
        assert!(unreached.len() * 10 <= cases, "the failure was not reached in too many runs");
    });
}

/// The setup sweep across ranks: every driver call and NCCL call that building two ranks of one
/// pipeline makes (the rendezvous, each rank's stages and streams, the communicator's join, the
/// first message that proves the link) is failed in turn, in whichever rank makes it, one per
/// run; so are the first polls of NCCL during the join. Whatever call fails: both setups end
/// within a bound of the peer timeout (never a hang); a rank whose setup failed returns a typed
/// error, and one of the errors names the failing call (a failure a setup got over is recorded);
/// two ranks whose setups both succeeded run a step bitwise; and once everything is dropped and
/// every queued operation ran, nothing is left allocated beyond one allocation per drop that
/// recorded it could not free safely, and nothing touched freed memory.
#[test]
fn every_failing_call_of_a_setup_across_ranks_is_a_typed_error_in_bounded_time() {
    with_double("every_failing_call_of_a_setup_across_ranks_is_a_typed_error_in_bounded_time", |double| {
        double::nccl_double().clear_faults();
        // A setup takes about 10 ms here; a run that fails one rank before the rendezvous has
        // the other wait one peer timeout for it (a sixth of the runs). 40 setups long, and its
        // signs of life every 40 ms: a busy machine's stalls are no silence.
        let peer_timeout = std::time::Duration::from_millis(400);
        let bound = peer_timeout * 4;
        let n = 1024;
        let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ 0x5e7).collect();
        // One step across the two ranks, bitwise.
        let step_delivers = |ranks: &(PpNRt, PpNRt), case: &str| {
            let primary = Engine::new(0).unwrap();
            let (e0, e1) = (ranks.0.engine(0, &primary).unwrap(), ranks.1.engine(1, &primary).unwrap());
            let input = {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&data).unwrap()
            };
            match remote_step(ranks, e1, &input, n, false) {
                Swept::Delivered(values) => assert!(values == data, "{case}: wrong values"),
                other => panic!("{case}: the step after the setup: {other:?}"),
            }
        };
        for transport in [ProcessTransport::Nccl, ProcessTransport::Ipc] {
            double.flush();
            let _ = ppnrt::take_drop_errors();
            // The calls of a setup, per entry point: the fewest of three setups (the waits for the
            // other rank poll, as many times as the wait lasts).
            let measured: Vec<Vec<(bool, String, u64)>> = (0..3)
                .map(|_| {
                    let mut built = None;
                    let mut nccl_made = Vec::new();
                    let primary = Engine::new(0).unwrap();
                    let driver_made = double.calls_made_by(|| {
                        nccl_made = nccl_calls_made_by(|| {
                            built = Some(ranks::try_two_ranks_configured(&primary, peer_timeout, |_, config| {
                                config.with_process_transport(transport)
                            }))
                        });
                    });
                    let (zero, one) = built.unwrap();
                    let ranks = (zero.unwrap(), one.unwrap());
                    step_delivers(&ranks, "a measured setup");
                    let errors = drop_ranks_within(ranks, bound, "a measured setup");
                    assert!(errors.is_empty(), "{errors:?}");
                    driver_made
                        .into_iter()
                        .map(|(e, c)| (false, e, c))
                        .chain(nccl_made.into_iter().map(|(e, c)| (true, e, c)))
                        .collect()
                })
                .collect();
            let fewest = |in_nccl: bool, entry: &str| {
                measured
                    .iter()
                    .map(|calls| calls.iter().find(|(n, e, _)| *n == in_nccl && e == entry).map_or(0, |(_, _, c)| *c))
                    .min()
                    .unwrap()
            };
            let mut faults: Vec<(bool, String, u64)> = measured[0]
                .iter()
                .map(|(in_nccl, entry, _)| (*in_nccl, entry.clone(), fewest(*in_nccl, entry)))
                .filter(|(_, _, calls)| *calls > 0)
                .collect();
            if transport == ProcessTransport::Nccl {
                assert!(
                    faults.iter().any(|(in_nccl, entry, _)| *in_nccl && entry == "ncclCommInitRankConfig"),
                    "the setup made no NCCL join: {faults:?}"
                );
                faults.push((true, "ncclCommGetAsyncError".to_string(), 2));
            } else {
                assert!(
                    faults
                        .iter()
                        .any(|(in_nccl, entry, _)| !*in_nccl && entry.starts_with("cuMemExportToShareableHandle")),
                    "the setup exported no slot: {faults:?}"
                );
            }
            let mut slowest = std::time::Duration::ZERO;
            let mut unreached = Vec::new();
            let what = format!("setup across ranks over {transport}");
            let cases = sweep_across_ranks(double, &faults, &what, &mut unreached, |injected| {
                let case = injected.case.clone();
                // Each run starts with no context current: a failed restore of the current
                // context in an earlier run changes nothing here.
                raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                // The primary engine made before the failure: it is the caller's, not the setup's.
                let primary = Engine::new(0).unwrap();
                let started = std::time::Instant::now();
                injected.arm();
                let (zero, one) = ranks::try_two_ranks_once(&primary, peer_timeout, &|_, config: PpConfig| {
                    config.with_process_transport(transport)
                });
                let took = started.elapsed();
                let (reached, mut drop_errors) =
                    injected.disarm_if_reached_within(std::time::Duration::from_millis(100));
                assert!(took < bound, "{case}: the setups took {took:?}");
                slowest = slowest.max(took);
                // Another socket took the rendezvous port: rank 1's setup ended with the wait for
                // it, wherever the failing call was; the run is made again, as one that did not
                // reach its call.
                let reached = reached && !zero.as_ref().is_err_and(ranks::port_taken);
                let mut errors = Vec::new();
                match (zero, one) {
                    (Ok(zero), Ok(one)) => {
                        let ranks = (zero, one);
                        step_delivers(&ranks, &case);
                        drop_errors.extend(drop_ranks_within(ranks, bound, &case));
                    }
                    (zero, one) => {
                        for built in [zero, one] {
                            match built {
                                Ok(rt) => drop_errors.extend(drop_ranks_within(rt, bound, &case)),
                                Err(e) => errors.push(e),
                            }
                        }
                    }
                }
                RanksRun { reached, errors, drop_errors }
            });
            println!(
                "setup fault sweep across ranks: {cases} runs, each with one failing driver or NCCL call, the slowest \
                 {slowest:?}; {} of them did not reach it: {unreached:?}",
                unreached.len()
            );
            assert!(unreached.len() * 10 <= cases, "the failure was not reached in too many runs");
        }
    });
}

/// A readback whose values came through a boundary from another rank is not given once that
/// boundary failed: the failure aborts the communicator, which cuts short a receive still queued
/// (the NCCL double then leaves the slot as it was, as NCCL's abort ends its kernels), so the
/// values would be an earlier step's. Each round: warm steps, one more step received and read
/// back with nothing run yet, then the watchdog's next poll of NCCL fails (in either rank: the
/// other learns it from the connection), and the readback is waited for only once rank 1's
/// boundary failed. The wait must give `PeerFailed` or, where the receive ran before the failure
/// (a poll of the receive's completion ran it), this step's values; never another step's. With
/// the check taken out (mutation `readback-after-failure`), the wait gives the earlier step's.
#[test]
fn a_readback_fed_by_a_failed_boundary_is_refused() {
    with_double("a_readback_fed_by_a_failed_boundary_is_refused", |double| {
        let nccl = double::nccl_double();
        nccl.clear_faults();
        let n = 1024;
        let data =
            |t: u32| -> Vec<u32> { (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (t << 20 | 0x3b)).collect() };
        let (mut refused, mut given) = (0, 0);
        for round in 0..12 {
            let ranks = ranks::two_ranks_configured(std::time::Duration::from_secs(3), |_, config| {
                config.with_process_transport(ProcessTransport::Nccl)
            });
            let primary = Engine::new(0).unwrap();
            let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
            let inputs: Vec<CudaSlice<u32>> = {
                let _stage = ranks.0.enter(0).unwrap();
                (0..4).map(|t| e0.htod(&data(t)).unwrap()).collect()
            };
            for (t, input) in inputs.iter().enumerate().take(3) {
                match remote_step(&ranks, &e1, input, n, false) {
                    Swept::Delivered(values) => assert!(values == data(t as u32), "round {round}: warm step {t}"),
                    other => panic!("round {round}: warm step {t}: {other:?}"),
                }
            }
            let slot = ranks.0.tx(0, &inputs[3], n).unwrap();
            let pending = {
                let _stage = ranks.1.enter(1).unwrap();
                let received = ranks.1.rx_wait::<u32>(0, slot, n, REMOTE_RECEIVE_WAIT).unwrap();
                ranks.1.readback(received).unwrap()
            };
            nccl.fail("ncclCommGetAsyncError", 1, NCCL_INTERNAL_ERROR);
            let until = std::time::Instant::now() + REMOTE_RECEIVE_WAIT;
            let next = (slot + 1) % ranks.1.n_slots();
            loop {
                match ranks.1.rx_wait::<u32>(0, next, n, std::time::Duration::from_millis(1)) {
                    Err(e) if peer_failed(&e) => break,
                    _ => assert!(std::time::Instant::now() < until, "round {round}: rank 1's boundary never failed"),
                }
            }
            nccl.clear_faults();
            match pending.wait() {
                Err(e) if peer_failed(&e) => refused += 1,
                Ok(values) => {
                    assert!(values == data(3), "round {round}: the values of another step were given");
                    given += 1;
                }
                Err(e) => panic!("round {round}: {e}"),
            }
            drop(pending);
            drop(inputs);
            drop_ranks_within(ranks, REMOTE_RECEIVE_WAIT, "a readback fed by a failed boundary");
            let _ = ppnrt::take_drop_errors();
        }
        println!("readbacks after their boundary failed: {refused} refused, {given} given (their receive had run)");
        assert!(refused > 0, "no receive was still queued when its boundary failed");
        double.flush();
    });
}

/// Per entry point, the fewer calls of two counts (an entry point missing from either is left out).
fn fewer_calls(first: Vec<(String, u64)>, second: &[(String, u64)]) -> Vec<(String, u64)> {
    first
        .into_iter()
        .filter_map(|(entry, calls)| {
            let other = second.iter().find(|(e, _)| *e == entry)?.1;
            Some((entry, calls.min(other)))
        })
        .collect()
}
