//! The settings' tests: the environment's parser (a property test among them), the builder's
//! checks, and the names errors give.

use std::time::Duration;

use super::*;

#[test]
fn defaults_are_one_stage_two_slots_auto() {
    let config = PpConfig::parse(None, None, None, None).unwrap();
    assert_eq!(config.n_stages(), 1);
    assert_eq!(config.slots(), 2);
    assert_eq!(config.transport(), TransportPolicy::Auto);
    assert_eq!(config.stage_devices(3), vec![3]);
}

#[test]
fn devices_imply_the_stage_count() {
    let config = PpConfig::parse(None, Some("0, 0,1,1"), Some("3"), Some("PEER")).unwrap();
    assert_eq!(config.n_stages(), 4);
    assert_eq!(config.stage_devices(7), vec![0, 0, 1, 1]);
    assert_eq!(config.slots(), 3);
    assert_eq!(config.transport(), TransportPolicy::Peer);
    assert_eq!(config.to_string(), "PPNRT_STAGES=4 PPNRT_DEVICES=0,0,1,1 PPNRT_SLOTS=3 PPNRT_TRANSPORT=peer");
}

#[test]
fn malformed_values_name_setting_value_and_reason() {
    type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Option<&'a str>, &'a str, &'a str);
    let cases: &[Case<'_>] = &[
        (Some("0"), None, None, None, STAGES_VAR, "0"),
        (Some("abc"), None, None, None, STAGES_VAR, "abc"),
        (Some("-1"), None, None, None, STAGES_VAR, "-1"),
        (Some("1000"), None, None, None, STAGES_VAR, "1000"),
        (Some("3"), Some("0,1"), None, None, DEVICES_VAR, "0,1"),
        (None, Some("0,x"), None, None, DEVICES_VAR, "0,x"),
        (None, Some("0,-2"), None, None, DEVICES_VAR, "0,-2"),
        (None, Some(""), None, None, DEVICES_VAR, ""),
        (None, None, Some("0"), None, SLOTS_VAR, "0"),
        (None, None, Some("two"), None, SLOTS_VAR, "two"),
        (None, None, None, Some("carrier-pigeon"), TRANSPORT_VAR, "carrier-pigeon"),
    ];
    for &(stages, devices, slots, transport, setting, value) in cases {
        let err = PpConfig::parse(stages, devices, slots, transport).unwrap_err();
        assert_eq!(err.setting, setting, "{err}");
        assert_eq!(err.value, value, "{err}");
        assert!(err.to_string().contains(setting), "{err}");
    }
}

#[test]
fn process_settings_parse_and_validate() {
    let base = PpConfig::parse(None, Some("0,0,1,1"), None, None).unwrap();
    let config =
        base.clone().parse_processes(Some("0,0,1,1"), Some("1"), Some("10.0.0.1:29500"), Some("5000")).unwrap();
    assert_eq!(config.ranks(), vec![0, 0, 1, 1]);
    assert_eq!((config.rank(), config.world()), (1, 2));
    assert_eq!(config.rendezvous(), Some("10.0.0.1:29500"));
    assert_eq!(config.peer_timeout(), Duration::from_millis(5000));
    let rank0 = config.clone().with_rank(0);
    assert_eq!(rank0.fingerprint(), config.fingerprint(), "the fingerprint leaves the rank out");
    assert_ne!(rank0.to_string(), config.to_string());
    type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Option<&'a str>, &'a str);
    let cases: &[Case<'_>] = &[
        (Some("0,1"), None, Some("h:1"), None, RANKS_VAR),
        (Some("0,0,2,2"), None, Some("h:1"), None, RANKS_VAR),
        (Some("0,x,1,1"), None, Some("h:1"), None, RANKS_VAR),
        (Some("0,0,1,1"), Some("2"), Some("h:1"), None, RANK_VAR),
        (Some("0,0,1,1"), Some("-1"), Some("h:1"), None, RANK_VAR),
        (Some("0,0,1,1"), Some("1"), None, None, RENDEZVOUS_VAR),
        (Some("0,0,1,1"), Some("1"), Some(" "), None, RENDEZVOUS_VAR),
        (Some("0,0,1,1"), Some("1"), Some("h:1"), Some("0"), PEER_TIMEOUT_VAR),
        (Some("0,0,1,1"), Some("1"), Some("h:1"), Some("soon"), PEER_TIMEOUT_VAR),
        (None, Some("1"), None, None, RANK_VAR),
    ];
    for &(ranks, rank, addr, timeout, setting) in cases {
        let err = base.clone().parse_processes(ranks, rank, addr, timeout).unwrap_err();
        assert_eq!(err.setting, setting, "{err}");
    }
    // One rank needs no rendezvous.
    assert_eq!(base.parse_processes(Some("0,0,0,0"), None, None, None).unwrap().world(), 1);
}

/// Every rendezvous address and peer timeout is checked before a runtime is built: no
/// malformed address reaches the rendezvous, and no timeout overflows a deadline (a
/// `Duration::MAX` timeout used to panic in `PpNRt::new`) or fails healthy peers (signs of
/// life go out at most every 10 ms).
#[test]
fn rendezvous_addresses_and_peer_timeouts_are_checked() {
    let two = PpConfig::with_devices(&[0, 0]).with_ranks(&[0, 1]).with_rank(1);
    for addr in ["garbage", "localhost:99999", "localhost:0", ":29500", "::1:29500", "host name:1", "h:", "h:-1"] {
        let err = two.clone().with_rendezvous(addr).validate().unwrap_err();
        assert_eq!((err.setting, err.value.as_str()), ("PpConfig::with_rendezvous", addr), "{err}");
    }
    for addr in ["localhost:29500", "10.0.0.1:1", "[::1]:65535", "node-7.cluster:29500"] {
        assert!(two.clone().with_rendezvous(addr).validate().is_ok(), "{addr}");
    }
    let with = |timeout: Duration| two.clone().with_rendezvous("h:1").with_peer_timeout(timeout).validate();
    for timeout in [Duration::ZERO, Duration::from_millis(1), Duration::from_millis(99), Duration::MAX] {
        let err = with(timeout).unwrap_err();
        assert_eq!(err.setting, "PpConfig::with_peer_timeout", "{timeout:?}: {err}");
    }
    for timeout in [MIN_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT, MAX_PEER_TIMEOUT] {
        assert!(with(timeout).is_ok(), "{timeout:?}");
    }
    let base = PpConfig::parse(None, Some("0,0"), None, None).unwrap();
    for text in ["1", "99", "99999999999999"] {
        let err = base.clone().parse_processes(Some("0,1"), Some("1"), Some("h:1"), Some(text)).unwrap_err();
        assert_eq!(err.setting, PEER_TIMEOUT_VAR, "{text}: {err}");
    }
}

#[test]
fn builder_validation_matches_parsing() {
    assert!(PpConfig::new(0).validate().is_err());
    assert!(PpConfig::new(4).with_slots(0).validate().is_err());
    assert!(PpConfig::with_devices(&[0, 1, 0, 1]).with_slots(4).validate().is_ok());
    assert!(PpConfig::with_devices(&[]).validate().is_err());
}

/// An error about a value set in code names the builder call that set it; one about a value
/// read from the environment names its variable, also when code changed other settings.
#[test]
fn errors_name_the_call_or_the_variable_that_set_the_value() {
    let setting = |config: PpConfig| config.validate().unwrap_err().setting;
    assert_eq!(setting(PpConfig::with_devices(&[])), "PpConfig::with_devices");
    assert_eq!(setting(PpConfig::with_devices(&[0, -1])), "PpConfig::with_devices");
    assert_eq!(setting(PpConfig::new(0)), "PpConfig::new");
    assert_eq!(setting(PpConfig::new(MAX_STAGES + 1)), "PpConfig::new");
    assert_eq!(setting(PpConfig::new(2).with_slots(0)), "PpConfig::with_slots");
    assert_eq!(setting(PpConfig::new(2).with_ranks(&[0, 2])), "PpConfig::with_ranks");
    assert_eq!(setting(PpConfig::new(2).with_rank(1)), "PpConfig::with_rank");
    assert_eq!(setting(PpConfig::new(2).with_ranks(&[0, 1])), "PpConfig::with_rendezvous");
    let text = PpConfig::with_devices(&[]).validate().unwrap_err().to_string();
    assert!(text.contains("PpConfig::with_devices") && !text.contains("PPNRT_"), "{text}");
    // Read from the environment: the variables, whatever code set afterwards.
    let env = PpConfig::parse(Some("2"), None, Some("3"), None).unwrap();
    assert_eq!(env.clone().parse_processes(Some("0,1"), None, None, None).unwrap_err().setting, RENDEZVOUS_VAR);
    let err = env.clone().parse_processes(Some("0,1"), Some("1"), Some("h:1"), Some("5")).unwrap_err();
    assert_eq!(err.setting, PEER_TIMEOUT_VAR);
    let coded = env.clone().with_ranks(&[0, 1]).with_rank(1).with_rendezvous("h:1");
    assert_eq!(setting(coded.clone().with_slots(99)), "PpConfig::with_slots");
    assert_eq!(setting(coded.with_peer_timeout(Duration::ZERO)), "PpConfig::with_peer_timeout");
    let err = env.parse_processes(Some("0,1"), Some("1"), Some("h:1"), None).unwrap().with_rank(2).validate();
    assert_eq!(err.unwrap_err().setting, "PpConfig::with_rank");
    let parsed = PpConfig::parse(Some("2"), None, None, None).unwrap();
    assert_eq!(parsed, PpConfig::new(2), "where a value came from is not part of the configuration");
}

/// Property test: on any input (random bytes, near-valid lists, huge numbers, odd
/// whitespace and signs) the parser returns a value or a `ConfigError` naming one of the four
/// settings, never panics, and every configuration it accepts passes `validate`.
#[test]
fn the_parser_never_panics_and_accepts_only_valid_configs() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let atoms = [
        "",
        " ",
        "0",
        "1",
        "2",
        "8",
        "-1",
        "+3",
        "256",
        "257",
        "65",
        "4294967296",
        "99999999999999999999",
        ",",
        ",,",
        "0,0",
        "0,1,0,1",
        " 1 , 0 ",
        "x",
        "auto",
        "PEER",
        "staged",
        "host",
        "\u{0}",
        "é",
        "0x10",
        "1e3",
        "NaN",
    ];
    let field = |next: &mut dyn FnMut() -> u64| -> Option<String> {
        match next() % 5 {
            0 => None,
            1 => Some(atoms[(next() % atoms.len() as u64) as usize].to_string()),
            2 => Some(
                (0..next() % 6).map(|_| atoms[(next() % atoms.len() as u64) as usize]).collect::<Vec<_>>().join(","),
            ),
            3 => Some((0..next() % 12).map(|_| char::from_u32((next() % 0x250) as u32).unwrap_or('?')).collect()),
            _ => Some(format!("{}", next() as i64 % 300)),
        }
    };
    let mut accepted = 0;
    for _ in 0..20_000 {
        let (a, b, c, d) = (field(&mut next), field(&mut next), field(&mut next), field(&mut next));
        match PpConfig::parse(a.as_deref(), b.as_deref(), c.as_deref(), d.as_deref()) {
            Ok(config) => {
                accepted += 1;
                assert!(config.validate().is_ok(), "{config}");
                assert_eq!(config.stage_devices(0).len(), config.n_stages());
                assert!((1..=MAX_SLOTS).contains(&config.slots()));
            }
            Err(e) => {
                assert!([STAGES_VAR, DEVICES_VAR, SLOTS_VAR, TRANSPORT_VAR].contains(&e.setting), "{e}");
                assert!(!e.reason.is_empty());
            }
        }
    }
    assert!(accepted > 100, "the generator should reach valid configurations too ({accepted})");
}

/// The plan's refusal names the setting as the caller gave it: the builder call for a value set
/// in code, the variable for one read from the environment.
#[test]
fn plan_errors_name_the_builder_call_or_the_variable() {
    use crate::pp::plan::Plan;
    let refuse = |config: &PpConfig| {
        Plan::choose_named(
            &config.stage_devices(0),
            &config.ranks(),
            config.rank(),
            config.transport(),
            |_, _| false,
            config.setting_names(),
        )
        .unwrap_err()
    };
    let in_code = PpConfig::with_devices(&[0, 1]).with_transport(TransportPolicy::Peer);
    let err = refuse(&in_code);
    assert_eq!(err.setting, "PpConfig::with_transport", "{err}");
    assert!(err.reason.contains("(PpConfig::with_devices=0,1)"), "{err}");
    let from_env = PpConfig::parse(None, Some("0,1"), None, Some("peer")).unwrap();
    let err = refuse(&from_env);
    assert_eq!(err.setting, TRANSPORT_VAR, "{err}");
    assert!(err.reason.contains(&format!("({DEVICES_VAR}=0,1)")), "{err}");
    // A policy set in code over a configuration read from the environment is named in code.
    let err = refuse(&from_env.with_transport(TransportPolicy::Peer));
    assert_eq!(err.setting, "PpConfig::with_transport", "{err}");
}

/// The transport between ranks: parsed from its variable (an unknown value names it), set in
/// code, part of the fingerprint when not `auto` (ranks that disagree are refused at the
/// rendezvous), and a forced `ipc` that cannot work names the builder call or the variable.
#[test]
fn the_process_transport_setting_parses_and_errors_name_its_source() {
    use crate::pp::process_transport::ProcessTransport;
    let base = || PpConfig::parse(None, Some("0,0"), None, None).unwrap();
    assert_eq!(base().process_transport(), ProcessTransport::Auto);
    assert_eq!(base().parse_process_transport(Some(" IPC ")).unwrap().process_transport(), ProcessTransport::Ipc);
    assert_eq!(base().parse_process_transport(Some("nccl")).unwrap().process_transport(), ProcessTransport::Nccl);
    let err = base().parse_process_transport(Some("shm")).unwrap_err();
    assert_eq!((err.setting, err.value.as_str()), (PROCESS_TRANSPORT_VAR, "shm"), "{err}");
    let config = base().with_process_transport(ProcessTransport::Nccl);
    assert!(config.to_string().ends_with(" PPNRT_PROCESS_TRANSPORT=nccl"), "{config}");
    assert_ne!(config.fingerprint(), base().fingerprint());
    assert_eq!(base().to_string(), base().parse_process_transport(Some("auto")).unwrap().to_string());
    // A forced ipc that cannot work: named as the caller set it.
    use crate::rendezvous::{DeviceIdentity, HostIdentity, RankIdentity};
    let identity = |boot: &str| RankIdentity {
        host: HostIdentity { boot_id: boot.into(), hostname: "n".into() },
        uid: 1,
        devices: vec![DeviceIdentity { ordinal: 0, uuid: [1; 16], peer_access: vec![] }],
    };
    let refuse = |config: &PpConfig| {
        let mut plan = crate::pp::plan::Plan::choose_named(
            &[0, 0],
            &[0, 1],
            0,
            TransportPolicy::Auto,
            |_, _| true,
            config.setting_names(),
        )
        .unwrap();
        plan.choose_processes_named(
            &[identity("a"), identity("b")],
            config.process_transport(),
            config.setting_names(),
            false,
        )
        .unwrap_err()
    };
    let in_code = PpConfig::with_devices(&[0, 0]).with_process_transport(ProcessTransport::Ipc);
    assert_eq!(refuse(&in_code).setting, "PpConfig::with_process_transport");
    let from_env = base().parse_process_transport(Some("ipc")).unwrap();
    let err = refuse(&from_env);
    assert_eq!(err.setting, PROCESS_TRANSPORT_VAR);
    assert!(err.reason.contains("boundary 0 cannot use ipc: other host"), "{err}");
}
