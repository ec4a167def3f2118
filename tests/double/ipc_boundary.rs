//! The IPC boundary against what a caller or a peer rank may do (ranks as threads of this
//! process, through the doubles): a failure upstream carried by NCCL never lets a step cut short
//! reach the next rank over IPC as whole; a slot read in place and forgotten stops the boundary
//! without a hang, and both ranks' drops are bounded.

use crate::{double, ranks};

use std::sync::Arc;
use std::time::Duration;

use double::with_double;
use ppnrt::{CudaSlice, Engine, Error, PpError, PpNRt, Transport};

const N: usize = 2048;

fn pattern(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect()
}

/// Stage 0's input of step `seed`: `N` pattern values on its stream.
fn input(rt: &PpNRt, primary: &Engine, seed: u32) -> CudaSlice<u32> {
    let _stage = rt.enter(0).unwrap();
    let engine = rt.engine(0, primary).unwrap();
    let mut x = engine.alloc::<u32>(N).unwrap();
    engine.fill_pattern(&mut x, seed).unwrap();
    x
}

fn is_peer_failed(e: &Error) -> bool {
    matches!(e, Error::Pipeline(PpError::PeerFailed { .. }))
}

/// Peer access off in the driver double until dropped.
struct NoPeer<'a>(&'a double::Double);

impl<'a> NoPeer<'a> {
    fn on(double: &'a double::Double) -> NoPeer<'a> {
        double.no_peer(true);
        NoPeer(double)
    }
}

impl Drop for NoPeer<'_> {
    fn drop(&mut self) {
        self.0.no_peer(false);
    }
}

/// A rank whose boundary from upstream is carried by NCCL and whose boundary downstream is IPC
/// (rank 0 on device 0, ranks 1 and 2 on device 1, and no peer access between the devices):
/// rank 0 announces a step and dies before its send ran; rank 1 had taken it and forwarded it to
/// rank 2, which reads it back. Rank 1's NCCL abort cuts its receive short, and its stream runs
/// on into the IPC send queued behind it: that send must not copy the cut-short slot into rank
/// 2's and mark it filled before rank 2 knows of the failure. Rank 2 is slow to fail its links
/// (400 ms, [`ProtocolFault::SlowToFail`](ppnrt::pp::ProtocolFault::SlowToFail)): its readback
/// must be refused with `PeerFailed`, never return the cut-short step as `Ok`.
#[test]
fn a_step_cut_short_over_nccl_upstream_never_reaches_an_ipc_boundary_downstream_as_ok() {
    with_double("a_step_cut_short_over_nccl_upstream_never_reaches_an_ipc_boundary_downstream_as_ok", |double| {
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while this test sets it.
        unsafe {
            std::env::set_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            std::env::set_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
        }
        let timeout = Duration::from_millis(800);
        // The driver is initialised before peer access goes (its start reads the environment).
        let primary = Engine::new(0).unwrap();
        let ranks = {
            let _no_peer = NoPeer::on(double);
            ranks::chain_of_ranks(&[0, 1, 1], timeout, |rank, config| match rank {
                0 => config.with_fault(ppnrt::pp::ProtocolFault::AnnounceWithoutSend),
                2 => config.with_fault(ppnrt::pp::ProtocolFault::SlowToFail(400)),
                _ => config,
            })
        };
        let transports: Vec<Transport> = ranks[1].plan().boundaries.iter().map(|b| b.transport).collect();
        assert_eq!(transports, [Transport::Nccl, Transport::Ipc], "{}", ranks[1].plan());
        let x = input(&ranks[0], &primary, 11);
        ranks[0].enter(0).and_then(|_stage| ranks[0].tx(0, &x, N)).unwrap(); // announced, never sent
        drop(x);
        let wait = Duration::from_secs(5);
        let mut ranks = ranks.into_iter().map(Arc::new);
        let (zero, one, two) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
        // Rank 1 takes the step and forwards it.
        let forward = {
            let one = Arc::clone(&one);
            std::thread::spawn(move || {
                let _stage = one.enter(1)?;
                let received = one.rx_wait::<u32>(0, 0, N, wait)?;
                one.tx(1, &received, N).map(|_| ())
            })
        };
        let pending = {
            let _stage = two.enter(2).unwrap();
            let received = two.rx_wait::<u32>(1, 0, N, wait).unwrap();
            two.readback(received).unwrap()
        };
        // Rank 0 goes: rank 1 fails its boundary from it within the peer timeout.
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(zero);
            let _ = done.send(());
        });
        let (read, readback) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = read.send(pending.wait().map(<[u32]>::to_vec));
        });
        let outcome = readback.recv_timeout(Duration::from_secs(10)).expect("rank 2's readback returned");
        dropped.recv_timeout(Duration::from_secs(10)).expect("rank 0's drop returned");
        let forwarded = forward.join().unwrap();
        assert!(forwarded.is_ok() || forwarded.as_ref().is_err_and(is_peer_failed), "{forwarded:?}");
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop((one, two));
            let _ = done.send(ppnrt::take_drop_errors());
        });
        dropped.recv_timeout(Duration::from_secs(10)).expect("the other ranks' drops returned");
        // SAFETY: as above.
        unsafe {
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV");
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND");
        }
        match outcome {
            Err(e) if is_peer_failed(&e) => {}
            Ok(values) => panic!(
                "rank 2 read a step cut short upstream back as Ok ({} values, the first {:?})",
                values.len(),
                &values[..values.len().min(4)]
            ),
            Err(other) => panic!("rank 2's readback of a step cut short upstream: {other}"),
        }
    });
}
