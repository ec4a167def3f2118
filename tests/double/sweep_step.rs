//! The fault sweep of an eager step: every driver call of a step fails in turn; the error names
//! it, nothing is lost, the step can be made again.

use super::*;

/// One failing driver call of a fault sweep: the `nth` call of `entry`, counted from when it is
/// armed (an entry point of the NCCL double when `in_nccl`).
pub(crate) struct Injected<'d> {
    pub(crate) double: &'d double::Double,
    pub(crate) in_nccl: bool,
    pub(crate) entry: &'d str,
    pub(crate) nth: i32,
    /// Names the run in assertion messages.
    pub(crate) case: String,
    pub(crate) calls_before: Option<u64>,
}

impl Injected<'_> {
    /// Calls of the entry so far.
    pub(crate) fn calls(&self) -> u64 {
        if self.in_nccl { double::nccl_double().calls(self.entry) } else { self.double.calls(self.entry) }
    }

    /// Makes the call fail from here on: right before the operation swept.
    pub(crate) fn arm(&mut self) {
        self.calls_before = Some(self.calls());
        if self.in_nccl {
            double::nccl_double().fail(self.entry, self.nth, NCCL_INTERNAL_ERROR);
        } else {
            self.double.fail(self.entry, self.nth, OUT_OF_MEMORY);
        }
    }

    /// Whether the operation reached the failing call.
    pub(crate) fn reached(&self) -> bool {
        self.calls() - self.calls_before.expect("armed before") >= self.nth as u64
    }

    /// Ends the failure, right after the operation, and checks that the operation reached it;
    /// returns the errors recorded meanwhile for `take_drop_errors`.
    pub(crate) fn disarm(&mut self) -> Vec<Error> {
        self.disarm_within(std::time::Duration::ZERO)
    }

    /// [`disarm`](Self::disarm) for a call that a background thread may make: waits up to
    /// `within` for it first.
    pub(crate) fn disarm_within(&mut self, within: std::time::Duration) -> Vec<Error> {
        let (reached, errors) = self.disarm_if_reached_within(within);
        assert!(reached, "{}: the failure was not reached", self.case);
        errors
    }

    /// [`disarm_within`](Self::disarm_within) for an operation whose calls depend on timing:
    /// whether the failure was reached, and the errors recorded meanwhile.
    pub(crate) fn disarm_if_reached_within(&mut self, within: std::time::Duration) -> (bool, Vec<Error>) {
        let until = std::time::Instant::now() + within;
        while !self.reached() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.double.clear_faults();
        if self.in_nccl {
            double::nccl_double().clear_faults();
        }
        (self.reached(), typed_drop_errors())
    }

    /// Whether `error` names the failing call.
    pub(crate) fn names(&self, error: &Error) -> bool {
        error.to_string().contains(self.entry.trim_end_matches("_v2"))
    }

    /// Asserts that `error` names the failing call.
    pub(crate) fn assert_named(&self, error: &Error) {
        assert!(self.names(error), "{}: the error does not name the call: {error}", self.case);
    }
}

/// Runs `run` once for each driver call that one operation makes (`calls`: entry points, calls
/// each), with that call failing: `run` sets the operation up, [`arm`](Injected::arm)s the
/// failure right before it and [`disarm`](Injected::disarm)s it right after, and checks the
/// outcome. After each run, once every queued operation ran, the double must have seen no access
/// to freed memory. Returns the number of runs.
pub(crate) fn sweep_calls(
    double: &double::Double,
    calls: &[(String, u64)],
    what: &str,
    mut run: impl FnMut(&mut Injected<'_>),
) -> usize {
    let mut runs = 0;
    for (entry, made) in calls {
        for nth in 1..=*made as i32 {
            let case = format!("{what}: call {nth} of {made} to {entry} failing");
            let mut injected = Injected { double, in_nccl: false, entry, nth, case, calls_before: None };
            double.flush();
            let _ = ppnrt::take_drop_errors();
            let violations = double.violations();
            run(&mut injected);
            assert!(injected.calls_before.is_some(), "{}: never armed", injected.case);
            double.clear_faults();
            double.flush();
            assert_eq!(double.violations(), violations, "{}: {}", injected.case, double.last_violation());
            let _ = ppnrt::take_drop_errors();
            runs += 1;
        }
    }
    runs
}

/// How one step of the fault sweep ended.
#[derive(Debug)]
pub(crate) enum Swept {
    /// Every call succeeded: the values read back.
    Delivered(Vec<u32>),
    /// `tx` (or entering its stage) failed: nothing was sent.
    NotSent(Error),
    /// `tx` succeeded and receiving failed: the slot to receive again.
    NotReceived(usize, Error),
    /// Received, and a later call failed (the copy out of the slot, the readback or its wait);
    /// for a failed wait, what a second wait gave.
    NotReadBack(Error, Option<Vec<u32>>),
}

/// Receives slot `slot` of boundary 0 (a copy by `rx`, or in place and copied out on the stage's
/// stream) and reads it back: `Delivered`, `NotReceived` when the receive failed, or
/// `NotReadBack` (for a failed wait, with what a second wait gave).
pub(crate) fn receive_and_read_back(rt: &PpNRt, e1: &Engine, slot: usize, n: usize, in_place: bool) -> Swept {
    receive_and_read_back_within(rt, e1, slot, n, in_place, None)
}

/// [`receive_and_read_back`], waiting up to `wait` for the slot to be filled when given (a
/// boundary from another rank fills it in the background).
pub(crate) fn receive_and_read_back_within(
    rt: &PpNRt,
    e1: &Engine,
    slot: usize,
    n: usize,
    in_place: bool,
    wait: Option<std::time::Duration>,
) -> Swept {
    let stage = match rt.enter(1) {
        Ok(stage) => stage,
        Err(e) => return Swept::NotReceived(slot, e),
    };
    let received = if in_place {
        let lent = match wait.map_or_else(|| rt.rx_in_place::<u32>(0, slot, n), |t| rt.rx_in_place_wait(0, slot, n, t))
        {
            Ok(lent) => lent,
            Err(e) => return Swept::NotReceived(slot, e),
        };
        let copied = e1.alloc::<u32>(n).map_err(Error::from).and_then(|mut out| {
            e1.dtod(&lent.view()?, &mut out)?;
            Ok(out)
        });
        match copied {
            Ok(out) => out,
            Err(e) => return Swept::NotReadBack(e, None),
        }
    } else {
        match wait.map_or_else(|| rt.rx::<u32>(0, slot, n), |t| rt.rx_wait(0, slot, n, t)) {
            Ok(received) => received,
            Err(e) => return Swept::NotReceived(slot, e),
        }
    };
    let pending = match rt.readback(received) {
        Ok(pending) => pending,
        Err(e) => return Swept::NotReadBack(e, None),
    };
    drop(stage);
    match pending.wait() {
        Ok(values) => Swept::Delivered(values.to_vec()),
        // A boundary from another rank failed: the values are not given, now or later.
        Err(e) if peer_failed(&e) => Swept::NotReadBack(e, None),
        Err(e) => {
            // A failed wait loses nothing: the next one gives the values.
            let again = pending.wait().map(<[u32]>::to_vec).unwrap_or_else(|e| panic!("the second wait failed: {e}"));
            Swept::NotReadBack(e, Some(again))
        }
    }
}

/// One decode-like step for the fault sweep: `tx` of `input` from stage 0, the receive on
/// stage 1, a deferred readback of what arrived.
pub(crate) fn sweep_step(rt: &PpNRt, e1: &Engine, input: &CudaSlice<u32>, n: usize, in_place: bool) -> Swept {
    match rt.enter(0).and_then(|_stage| rt.tx(0, input, n)) {
        Ok(slot) => receive_and_read_back(rt, e1, slot, n, in_place),
        Err(e) => Swept::NotSent(e),
    }
}

/// The fault sweep: every driver call that a warm step makes (`tx`, `rx` or an in-place receive
/// copied out, a deferred readback and its wait, the drops) is failed in turn, one per run, on
/// every transport. Whatever call fails, the step returns a typed error naming it or delivers
/// the right values (a failure the crate can only record, in a drop); a step whose `tx` went out
/// but whose receive failed is received by a second try, whole; a readback whose wait failed
/// gives its values to a second wait; and the next steps deliver their values. The step's input is dropped at once and the next step is larger (its slot is
/// allocated again, the old one freed), so work a failed call left queued and unordered would
/// touch freed memory: the double counts every such access, through the runtime's drop too.
#[test]
fn every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing", |double| {
        const WARM: usize = 4;
        const AFTER: usize = 3;
        let n = 4096;
        // Step t's length: the step after the swept one is four times as long, so its slot grows.
        let len = |t: usize| if t == WARM + 1 { 4 * n } else { n };
        let data = |t: usize| -> Vec<u32> {
            (0..len(t) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ ((t as u32) << 20 | 0x5a5)).collect()
        };
        let primary = Engine::new(0).unwrap();
        let mut cases = 0;
        for (devices, policy) in EVERY_TRANSPORT {
            for in_place in [false, true] {
                let what = format!("{policy:?} {devices:?}{}", if in_place { " in place" } else { "" });
                // A runtime with its inputs made and WARM steps run: every slot, event and
                // pinned buffer a step of length n needs exists.
                let warm = || {
                    let rt = PpNRt::new(PpConfig::with_devices(&devices).with_transport(policy), &primary).unwrap();
                    let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
                    let inputs: Vec<Option<CudaSlice<u32>>> = {
                        let _stage = rt.enter(0).unwrap();
                        (0..WARM + 1 + AFTER).map(|t| Some(e0.htod(&data(t)).unwrap())).collect()
                    };
                    for (t, input) in inputs.iter().enumerate().take(WARM) {
                        match sweep_step(&rt, &e1, input.as_ref().unwrap(), n, in_place) {
                            Swept::Delivered(values) => assert!(values == data(t), "{what}: warm step {t}"),
                            other => panic!("{what}: warm step {t}: {other:?}"),
                        }
                    }
                    double.flush();
                    // Each step starts with no context current: a failed restore of the current
                    // context in an earlier run changes nothing here.
                    raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                    (rt, e1, inputs)
                };
                // The driver calls of one warm step, per entry point.
                let calls: Vec<(String, u64)> = {
                    let (rt, e1, inputs) = warm();
                    let mut step = None;
                    let calls = double.calls_made_by(|| {
                        step = Some(sweep_step(&rt, &e1, inputs[WARM].as_ref().unwrap(), n, in_place))
                    });
                    assert!(matches!(step, Some(Swept::Delivered(_))), "{what}: {step:?}");
                    calls
                };
                assert!(calls.iter().map(|(_, c)| c).sum::<u64>() >= 5, "{what}: a step made only {calls:?}");
                cases += sweep_calls(double, &calls, &what, |injected| {
                    let case = injected.case.clone();
                    let (rt, e1, mut inputs) = warm();
                    injected.arm();
                    let outcome = sweep_step(&rt, &e1, inputs[WARM].as_ref().unwrap(), n, in_place);
                    injected.disarm();
                    // Freed at once: its free waits for whatever the step left reading it.
                    inputs[WARM] = None;
                    match &outcome {
                        Swept::Delivered(values) => assert!(*values == data(WARM), "{case}: wrong values delivered"),
                        Swept::NotSent(e) | Swept::NotReadBack(e, None) => injected.assert_named(e),
                        Swept::NotReadBack(e, Some(again)) => {
                            injected.assert_named(e);
                            assert!(*again == data(WARM), "{case}: the second wait gave wrong values");
                        }
                        Swept::NotReceived(slot, e) => {
                            injected.assert_named(e);
                            match receive_and_read_back(&rt, &e1, *slot, n, in_place) {
                                Swept::Delivered(again) => {
                                    assert!(again == data(WARM), "{case}: the second receive got wrong values")
                                }
                                other => panic!("{case}: the second receive: {other:?}"),
                            }
                        }
                    }
                    for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                        match sweep_step(&rt, &e1, input.as_ref().unwrap(), len(t), in_place) {
                            Swept::Delivered(values) => assert!(values == data(t), "{case}: step {t} wrong"),
                            other => panic!("{case}: step {t} after the failure: {other:?}"),
                        }
                    }
                });
            }
        }
        println!("fault sweep: {cases} runs, each with one failing driver call");
    });
}
