//! `tensorwire validate` as a user runs it: the real binary, real files, exit codes and output.

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn validate(plan: &str, json: bool) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    std::fs::write(&path, plan).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorwire"));
    cmd.arg("validate").arg(&path);
    if json {
        cmd.arg("--json");
    }
    cmd.output().unwrap()
}

/// Runs with `--json` and returns (exit code, the one JSON object on stdout).
fn validate_json(plan: &str) -> (i32, Value) {
    let out = validate(plan, true);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "exactly one JSON line expected, got {stdout:?}"
    );
    (
        out.status.code().unwrap(),
        serde_json::from_str(&stdout).unwrap(),
    )
}

#[test]
fn the_issue_examples() {
    // The valid output of the issue: trainer0 maps cuda:0 to the ps's cuda:1.
    let plan = r#"{"static_group": true, "workers": [
        {"name": "trainer0", "device_count": 2, "devices": ["cuda:0"], "device_maps": {"ps": {"cuda:0": "cuda:1"}}},
        {"name": "ps", "device_count": 2}]}"#;
    let (code, v) = validate_json(plan);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["valid"], true);
    assert_eq!(
        v["workers"]["trainer0"]["devices"],
        serde_json::json!(["cuda:0"])
    );
    assert_eq!(
        v["workers"]["trainer0"]["reverse_device_maps"],
        serde_json::json!({})
    );
    assert_eq!(
        v["workers"]["ps"]["reverse_device_maps"],
        serde_json::json!({"trainer0": {"cuda:1": "cuda:0"}})
    );
    assert_eq!(v["workers"]["ps"]["devices"], serde_json::json!(["cuda:1"]));

    // The issue's input also maps cpu, which trainer0 did not declare: PyTorch refuses that.
    let plan = plan.replace(
        r#"{"cuda:0": "cuda:1"}"#,
        r#"{"cuda:0": "cuda:1", "cpu": "cpu"}"#,
    );
    let (code, v) = validate_json(&plan);
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["error"]["kind"], "unexpected_source_devices");
    assert_eq!(v["error"]["node"], "trainer0");
    assert_eq!(v["error"]["target"], "ps");
}

#[test]
fn invalid_plans_report_kind_node_target_and_exit_1() {
    let plan = r#"{"workers": [
        {"name": "trainer0", "device_count": 2, "device_maps": {"ps": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}},
        {"name": "ps", "device_count": 2}]}"#;
    let (code, v) = validate_json(plan);
    assert_eq!(code, 1);
    assert_eq!(v["valid"], false);
    assert_eq!(v["error"]["kind"], "duplicated_target_devices");
    assert_eq!(v["error"]["node"], "trainer0");
    assert_eq!(v["error"]["target"], "ps");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Node trainer0 has duplicated target devices in its device map for ps\n"),
        "{msg}"
    );
    assert!(msg.contains("cuda:1: cuda:1"), "{msg}");

    let (code, v) = validate_json(
        r#"{"workers": [{"name": "w", "device_count": 1, "devices": ["cuda:0", "cuda:0"]}]}"#,
    );
    assert_eq!(code, 1);
    assert_eq!(v["error"]["kind"], "duplicated_devices");
    assert_eq!(v["error"]["target"], Value::Null);
}

#[test]
fn dynamic_groups_skip_unknown_targets() {
    let plan = r#"{"static_group": false, "workers": [
        {"name": "a", "device_count": 1, "device_maps": {"later": {"cuda:0": "cuda:3"}}}]}"#;
    assert_eq!(validate_json(plan).0, 0);
    let plan = plan.replace("false", "true");
    let (code, v) = validate_json(&plan);
    assert_eq!(
        (code, v["error"]["kind"].as_str()),
        (1, Some("invalid_target_node_names"))
    );
}

#[test]
fn unusable_input_names_the_field_and_exits_2() {
    let cases = [
        ("this is not json", None),
        ("[1, 2]", None),
        (r#"{"workers": [{"name": "a"}]}"#, Some("workers[0]")),
        (
            r#"{"workers": [{"name": "a", "device_count": 1, "devices": ["gpu:0"]}]}"#,
            Some("workers[0].devices[0]"),
        ),
        (
            r#"{"workers": [{"name": "a", "device_count": 1, "devices": ["cuda:-1"]}]}"#,
            Some("workers[0].devices[0]"),
        ),
        (
            r#"{"workers": [{"name": "a", "device_count": 1, "device_maps": {"b": {"cuda:x": "cpu"}}}]}"#,
            Some("workers[0].device_maps.b.cuda:x"),
        ),
        (
            r#"{"workers": [{"name": "a", "device_count": 1}, {"name": "a", "device_count": 1}]}"#,
            Some("workers[1].name"),
        ),
        (
            r#"{"workers": [{"name": "", "device_count": 1}]}"#,
            Some("workers[0].name"),
        ),
        (
            r#"{"workers": [{"name": "a/b", "device_count": 1}]}"#,
            Some("workers[0].name"),
        ),
        (
            r#"{"workers": [{"name": "a", "device_count": -3}]}"#,
            Some("workers[0].device_count"),
        ),
        (
            r#"{"workers": [{"name": "a", "device_count": 1, "device_map": {}}]}"#,
            Some("workers[0].device_map"),
        ),
        (r#"{"workers": []}"#, Some("workers")),
    ];
    for (plan, field) in cases {
        let (code, v) = validate_json(plan);
        assert_eq!(code, 2, "{plan}: {v}");
        assert_eq!(v["error"]["kind"], "unusable_input", "{plan}");
        assert_eq!(v["error"]["field"].as_str(), field, "{plan}: {v}");
        let human = validate(plan, false);
        assert_eq!(human.status.code(), Some(2));
        let stderr = String::from_utf8(human.stderr).unwrap();
        assert!(stderr.starts_with("tensorwire validate: "), "{stderr}");
        if let Some(field) = field {
            assert!(stderr.contains(field), "{stderr}");
        }
    }
    let long = "x".repeat(128);
    let (code, v) = validate_json(&format!(
        r#"{{"workers": [{{"name": "{long}", "device_count": 0}}]}}"#
    ));
    assert_eq!(code, 2);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("128 characters"),
        "{v}"
    );
}

#[test]
fn human_report_reads_well() {
    let plan = r#"{"workers": [{"name": "ps", "device_count": 2}, {"name": "t", "device_count": 1, "device_maps": {"ps": {"cuda:0": "cuda:1"}}}]}"#;
    let out = validate(plan, false);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("valid (static group of 2 workers)"), "{text}");
    assert!(text.contains("to t: {cuda:1: cuda:0}"), "{text}");
}

#[test]
fn reads_standard_input_and_missing_files_fail_cleanly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["validate", "-", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"workers": [{"name": "solo", "device_count": 0}]}"#)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));

    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["validate", "/definitely/not/here.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr)
        .unwrap()
        .contains("cannot read /definitely/not/here.json"));
}

#[test]
fn shipped_examples_work_as_the_readme_says() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/");
    let ok = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["validate", &format!("{root}cluster-plan.json")])
        .output()
        .unwrap();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["validate", &format!("{root}cluster-plan-bad.json")])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
}
