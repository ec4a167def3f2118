//! The processes table on a machine with one GPU: two processes sharing it over IPC and over
//! NCCL, beside the in-process boundary and the raw two-process IPC loop (`raw_ipc`).

use std::fmt::Write as _;

use ppnrt::{PpConfig, PpNRt};

use super::{Figures, Nccl, ROUNDS, TRANSPORT_VAR, figures_of, hop, median, ranks, stream};
use crate::Gpus;

/// The boundary between two processes on one GPU (the machine has one): the in-process boundary
/// within the GPU ([0, 0] stages) and the IPC boundary between two processes sharing it alternate
/// in rounds; the NCCL boundary between them (over its socket transport: NCCL refuses two ranks
/// on one GPU otherwise) runs once. Two processes on one GPU share it by time-slicing between
/// their contexts (no MPS), which an in-process boundary never pays: the ratios include it.
pub(super) fn one_gpu(gpus: &Gpus, report: &mut String) {
    let primary = &gpus.engines[0];
    let in_process = || {
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 0, 0]).with_slots(2), primary).unwrap();
        let hop = hop(&rt, primary).unwrap();
        drop(rt);
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 0]).with_slots(2), primary).unwrap();
        let (tx, rx, step, gbs) = stream(&rt, primary);
        Figures {
            tx: tx.unwrap(),
            rx: rx.unwrap(),
            hop,
            step: step.unwrap(),
            large_gbs: gbs.unwrap(),
            ..Figures::default()
        }
    };
    let shared = Nccl { sockets: false, no_graph_mixing: false, recv_graphs: true, shared_gpu: true };
    let across = |transport: &str, nccl: Nccl| {
        let env = [(TRANSPORT_VAR, transport)];
        let mut results = ranks("hop", "0,1,0", nccl, &env);
        results.extend(ranks("stream", "0,1", nccl, &env));
        figures_of(&results)
    };
    let raw_loop = |flags: &str| {
        let env = [(crate::raw_ipc::FLAGS_VAR, flags)];
        let mut results = ranks("raw-ipc-hop", "0,1,0", shared, &env);
        results.extend(ranks("raw-ipc-stream", "0,1", shared, &env));
        figures_of(&results)
    };
    // Each round: in-process, the crate's IPC boundary, then the raw loop with its flags on the
    // device and on the host.
    let mut raw_rounds = Vec::new();
    let rounds: Vec<(Figures, Figures)> = (0..ROUNDS)
        .map(|_| {
            let pair = (in_process(), across("ipc", shared));
            raw_rounds.push((raw_loop("device"), raw_loop("host")));
            pair
        })
        .collect();
    let nccl = ppnrt::nccl::nccl().is_ok().then(|| across("nccl", Nccl { sockets: true, ..shared }));
    let _ = writeln!(
        report,
        "\n### Boundary between two processes on one GPU (IPC, NCCL) beside the in-process boundary\n"
    );
    let _ = writeln!(
        report,
        "| boundary | host tx (µs) | host rx (µs) | tx + rx (µs) | isolated hop 32 KiB (µs) | pipelined step 32 KiB (µs) | 64 MiB (GB/s) |"
    );
    let _ = writeln!(report, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rows: Vec<(String, Figures)> = Vec::new();
    for (r, ((in_round, ipc_round), (raw_device, raw_host))) in rounds.iter().zip(&raw_rounds).enumerate() {
        rows.push((format!("round {}: in-process, one GPU", r + 1), *in_round));
        rows.push((format!("round {}: IPC, two processes on the GPU", r + 1), *ipc_round));
        rows.push((format!("round {}: raw IPC loop, flags on the device", r + 1), *raw_device));
        rows.push((format!("round {}: raw IPC loop, flags on the host", r + 1), *raw_host));
    }
    if let Some(f) = nccl {
        rows.push(("NCCL (sockets), two processes on the GPU".into(), f));
    }
    for (name, f) in &rows {
        let line = format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} | {:.1} |",
            f.tx,
            f.rx,
            f.tx + f.rx,
            f.hop,
            f.step,
            f.large_gbs
        );
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    let _ = writeln!(report);
    let per_round = |ratio: &dyn Fn(&Figures, &Figures) -> f64| -> (f64, String) {
        let mut ratios: Vec<f64> = rounds.iter().map(|(a, b)| ratio(a, b)).collect();
        let listed = ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        (median(&mut ratios), listed)
    };
    let (hop_ratio, hop_rounds) = per_round(&|a, b| b.hop / a.hop);
    let (gbs, gbs_rounds) = per_round(&|a, b| b.large_gbs / a.large_gbs);
    let (tx_extra, tx_rounds) = per_round(&|a, b| b.tx - a.tx);
    let (step_ratio, step_rounds) = per_round(&|a, b| b.step / a.step);
    // The raw loop the crate is held to: per round, the faster of its two flag placements.
    let raw_best: Vec<Figures> = raw_rounds
        .iter()
        .map(|(device, host)| Figures {
            hop: device.hop.min(host.hop),
            step: device.step.min(host.step),
            large_gbs: device.large_gbs.max(host.large_gbs),
            ..Figures::default()
        })
        .collect();
    let against_raw = |ratio: &dyn Fn(&Figures, &Figures) -> f64| -> (f64, String) {
        let mut ratios: Vec<f64> = rounds.iter().zip(&raw_best).map(|((_, ipc), raw)| ratio(ipc, raw)).collect();
        let listed = ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        (median(&mut ratios), listed)
    };
    let (raw_hop, raw_hop_rounds) = against_raw(&|ipc, raw| ipc.hop / raw.hop);
    let (raw_gbs, raw_gbs_rounds) = against_raw(&|ipc, raw| ipc.large_gbs / raw.large_gbs);
    let (raw_step, raw_step_rounds) = against_raw(&|ipc, raw| ipc.step / raw.step);
    let targets = [
        (
            "IPC, one GPU: 32 KiB isolated hop ≤ 1.10× the raw two-process IPC loop (the faster flag placement)"
                .to_string(),
            format!("{raw_hop:.2}× in the median round (rounds {raw_hop_rounds}×)"),
            raw_hop <= 1.10,
        ),
        (
            "IPC, one GPU: 64 MiB boundary ≥ 0.97× the raw two-process IPC loop".to_string(),
            format!("{raw_gbs:.3}× in the median round (rounds {raw_gbs_rounds}×)"),
            raw_gbs >= 0.97,
        ),
        (
            "IPC, one GPU: pipelined 32 KiB step ≤ 1.10× the raw two-process IPC loop".to_string(),
            format!("{raw_step:.2}× in the median round (rounds {raw_step_rounds}×)"),
            raw_step <= 1.10,
        ),
        (
            "IPC, one GPU: 32 KiB isolated hop ≤ 1.10× the in-process hop (time-slicing included)".to_string(),
            format!("{hop_ratio:.2}× in the median round (rounds {hop_rounds}×)"),
            hop_ratio <= 1.10,
        ),
        (
            "IPC, one GPU: 64 MiB boundary ≥ 0.97× in-process".to_string(),
            format!("{gbs:.3}× in the median round (rounds {gbs_rounds}×)"),
            gbs >= 0.97,
        ),
        (
            "IPC, one GPU: host tx ≤ in-process tx + 1 µs".to_string(),
            format!("+{tx_extra:.2} µs in the median round (rounds +{tx_rounds} µs)"),
            tx_extra <= 1.0,
        ),
        (
            "IPC, one GPU: pipelined 32 KiB step (no target)".to_string(),
            format!("{step_ratio:.2}× in-process in the median round (rounds {step_rounds}×)"),
            true,
        ),
    ];
    for (name, measured, met) in targets {
        let line = format!("| {name} | {measured} | {} |", if met { "yes" } else { "NO" });
        println!("TARGET {line}");
        let _ = writeln!(report, "{line}");
    }
}
