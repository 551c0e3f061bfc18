//! (7) Settings: partial updates, field-naming errors, JSON forms.

use std::time::Duration;

use cleave_planner::{Decision, LinearCosts, Mode, Planner, PlannerConfig, PlannerError, PlannerUpdate, TargetsUpdate};

#[test]
fn a_partial_update_changes_only_its_fields() {
    let mut cfg = PlannerConfig::default();
    let before = cfg.clone();
    let u: PlannerUpdate =
        serde_json::from_str(r#"{"mode": "auto", "targets": {"ttft_ms": 2000}, "window_s": 10}"#).unwrap();
    cfg.apply(&u).unwrap();
    assert_eq!(cfg.mode, Mode::Auto);
    assert_eq!(cfg.targets.ttft_ms, 2000.0);
    assert_eq!(cfg.window, Duration::from_secs(10));
    let expected = PlannerConfig {
        mode: Mode::Auto,
        window: Duration::from_secs(10),
        targets: cleave_planner::Targets { ttft_ms: 2000.0, ..before.targets.clone() },
        ..before
    };
    assert_eq!(cfg, expected);
}

#[test]
fn invalid_updates_name_the_field_and_change_nothing() {
    let mut p = Planner::new(PlannerConfig::default(), Box::new(LinearCosts::default())).unwrap();
    let before = p.config().clone();
    let cases: &[(&str, &str)] = &[
        (r#"{"targets": {"ttft_ms": -1}}"#, "targets.ttft_ms"),
        (r#"{"targets": {"tpot_ms": 0}}"#, "targets.tpot_ms"),
        (r#"{"targets": {"quantile": 1.0}}"#, "targets.quantile"),
        (r#"{"targets": {"attainment": 0}}"#, "targets.attainment"),
        (r#"{"limits": {"min_prefill": 5, "max_prefill": 2}}"#, "limits.min_prefill"),
        (r#"{"limits": {"max_nodes": 0}}"#, "limits.max_nodes"),
        (r#"{"limits": {"min_prefill": 3, "min_decode": 3, "max_nodes": 5}}"#, "limits.max_nodes"),
        (r#"{"limits": {"step_budgets": []}}"#, "limits.step_budgets"),
        (r#"{"limits": {"step_budgets": [64, 0]}}"#, "limits.step_budgets"),
        (r#"{"confirm_ticks": 0}"#, "confirm_ticks"),
        (r#"{"window_s": 0}"#, "window_s"),
        (r#"{"scale_down_margin": 0.95}"#, "scale_down_margin"),
        (r#"{"scale_up_margin": -0.5}"#, "scale_up_margin"),
    ];
    for (json, field) in cases {
        let u: PlannerUpdate = serde_json::from_str(json).unwrap();
        let err = p.update(&u).unwrap_err();
        match &err {
            PlannerError::InvalidField { field: f, .. } => assert_eq!(f, field, "{json}"),
            other => panic!("{json}: {other:?}"),
        }
        assert!(err.to_string().contains(field), "{err}");
        assert_eq!(p.config(), &before, "{json} changed the config");
    }
    // A NaN cannot come from JSON; from Rust it is refused like any other bad value.
    let nan = PlannerUpdate {
        targets: Some(TargetsUpdate { ttft_ms: Some(f64::NAN), ..Default::default() }),
        ..Default::default()
    };
    let err = p.update(&nan).unwrap_err();
    assert!(err.to_string().contains("targets.ttft_ms = NaN"), "{err}");
    // Limits that leave no plannable configuration.
    let u: PlannerUpdate = serde_json::from_str(r#"{"limits": {"min_colocated": 1, "min_prefill": 1}}"#).unwrap();
    assert!(matches!(p.update(&u), Err(PlannerError::NoConfiguration { min_prefill: 1, min_colocated: 1, .. })));
    assert_eq!(p.config(), &before);
}

#[test]
fn unknown_and_mistyped_json_fields_are_refused() {
    for json in [
        r#"{"mdoe": "auto"}"#,
        r#"{"targets": {"ttft": 2000}}"#,
        r#"{"limits": {"max_node": 3}}"#,
        r#"{"window": 10}"#,
        r#"{"mode": "AUTO"}"#,
        r#"{"window_s": -1}"#,
    ] {
        assert!(serde_json::from_str::<PlannerUpdate>(json).is_err(), "{json} was accepted");
    }
    assert_eq!(serde_json::from_str::<PlannerUpdate>("{}").unwrap(), PlannerUpdate::default());
}

#[test]
fn config_and_decision_json_forms_round_trip() {
    let cfg = PlannerConfig::default();
    let v = serde_json::to_value(&cfg).unwrap();
    assert_eq!(v["mode"], "off");
    assert_eq!(v["window_s"], 20.0);
    assert_eq!(v["cooldown_s"], 15.0);
    assert_eq!(v["limits"]["step_budgets"][4], 2048);
    assert_eq!(serde_json::from_value::<PlannerConfig>(v).unwrap(), cfg);

    let d: Decision = serde_json::from_str(
        r#"{"at_ms": 5000, "mode": "advise",
            "current": {"prefill": 1, "decode": 1, "colocated": 0, "step_budget": null},
            "target": {"prefill": 0, "decode": 0, "colocated": 1, "step_budget": 256},
            "actions": [{"kind": "switch_role", "node": 1, "from": "prefill", "to": "both"},
                        {"kind": "set_step_budget", "node": 1, "tokens": 256},
                        {"kind": "stop_node", "node": 2}],
            "applied": false, "reason": "colocate", "why": "w",
            "inputs": {"arrival_rate": 1.0, "mean_prompt_tokens": 64.0, "mean_output_tokens": 32.0,
                       "demand_span_s": 10.0, "queued_prefill_tokens": 0, "running_seqs": 2, "observed_ttft_ms": null,
                       "observed_tpot_ms": 40.0, "attainment": 1.0, "completions": 12},
            "predicted": {"current": {"ttft_ms": 300.0, "tpot_ms": null, "prefill_utilisation": 1.2, "decode_batch": 2.0},
                          "target": {"ttft_ms": 350.0, "tpot_ms": 70.0, "prefill_utilisation": 0.3, "decode_batch": 2.0},
                          "ttft_correction": 1.0, "tpot_correction": 1.1}}"#,
    )
    .unwrap();
    assert_eq!(d.reason.as_str(), "colocate");
    let back: Decision = serde_json::from_value(serde_json::to_value(&d).unwrap()).unwrap();
    assert_eq!(back, d);
}
