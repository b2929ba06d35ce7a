//! `tensorwire validate PLAN.json [--json]`: checks a cluster plan's device maps before launch.
//!
//! Exit codes: 0 the plan is valid, 1 it breaks a device-map rule, 2 it cannot be checked
//! (unreadable, not JSON, a missing or malformed field, bad or duplicate worker names).

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{json, Value};
use tensorwire_core::device::DeviceList;
use tensorwire_core::plan::{ClusterPlan, PlanInputError, PlanReport};
use tensorwire_core::validate::DeviceMapError;

/// Arguments of `tensorwire validate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The cluster plan, a JSON file (`-` reads standard input). Example:
    /// {"static_group": true, "workers": [{"name": "trainer0", "device_count": 2,
    /// "devices": ["cuda:0"], "device_maps": {"ps": {"cuda:0": "cuda:1"}}}, ...]}
    plan: PathBuf,
    /// Print exactly one JSON object on standard output instead of a report.
    #[arg(long)]
    json: bool,
}

/// Why a plan could not be checked at all.
struct Unusable {
    /// The JSON path of the field at fault, when one is known.
    field: Option<String>,
    message: String,
}

pub(crate) fn run(args: Args) -> ExitCode {
    let plan = match load(&args.plan) {
        Ok(plan) => plan,
        Err(e) => return unusable(&args, e),
    };
    match plan.check() {
        Err(e) => unusable(&args, input_error(e)),
        Ok(Ok(report)) => {
            if args.json {
                println!("{}", valid_json(&report));
            } else {
                print!("{}", valid_text(&args.plan, &plan, &report));
            }
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            if args.json {
                println!("{}", invalid_json(&e));
            } else {
                print!("{}", invalid_text(&args.plan, &e));
            }
            ExitCode::from(1)
        }
    }
}

fn load(path: &Path) -> Result<ClusterPlan, Unusable> {
    let text = if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map(|_| s)
            .map_err(|e| format!("cannot read the plan from standard input: {e}"))
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let text = text.map_err(|message| Unusable {
        field: None,
        message,
    })?;
    if !text.trim_start().starts_with('{')
        && !text.trim().is_empty()
        && serde_json::from_str::<Value>(&text).is_ok()
    {
        return Err(Unusable {
            field: None,
            message: format!(
                "{}: a plan must be a JSON object with a \"workers\" list",
                path.display()
            ),
        });
    }
    let de = &mut serde_json::Deserializer::from_str(&text);
    let plan: ClusterPlan = serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("{} is not valid JSON: {inner}", path.display())
        } else if field == "." {
            format!("{inner}")
        } else {
            format!("{field}: {inner}")
        };
        Unusable {
            field: (field != ".").then_some(field),
            message,
        }
    })?;
    Ok(plan)
}

fn input_error(e: PlanInputError) -> Unusable {
    let field = match &e {
        PlanInputError::NoWorkers => "workers".to_owned(),
        PlanInputError::BadName { index, .. } => format!("workers[{index}].name"),
        PlanInputError::DuplicateName { second, .. } => format!("workers[{second}].name"),
        _ => "workers".to_owned(),
    };
    Unusable {
        field: Some(field),
        message: e.to_string(),
    }
}

fn unusable(args: &Args, e: Unusable) -> ExitCode {
    if args.json {
        let out = json!({
            "valid": Value::Null,
            "error": {
                "kind": "unusable_input",
                "field": e.field,
                "message": e.message,
            }
        });
        println!("{out}");
    }
    eprintln!("tensorwire validate: {}", e.message);
    ExitCode::from(2)
}

fn valid_json(report: &PlanReport) -> Value {
    json!({ "valid": true, "workers": report.workers })
}

fn invalid_json(e: &DeviceMapError) -> Value {
    json!({
        "valid": false,
        "error": {
            "kind": e.kind().as_str(),
            "node": e.node(),
            "target": e.target(),
            "message": e.to_string(),
        }
    })
}

fn valid_text(path: &Path, plan: &ClusterPlan, report: &PlanReport) -> String {
    let mut out = String::new();
    let group = if plan.static_group {
        "static"
    } else {
        "dynamic"
    };
    let n = report.workers.len();
    let workers = if n == 1 { "worker" } else { "workers" };
    let _ = writeln!(
        out,
        "{}: valid ({group} group of {n} {workers})",
        path.display()
    );
    for (name, w) in &report.workers {
        let _ = writeln!(out, "  {name}");
        let _ = writeln!(out, "    devices: {}", DeviceList(&w.devices));
        if w.reverse_device_maps.is_empty() {
            let _ = writeln!(out, "    reverse device maps: none");
        } else {
            let _ = writeln!(out, "    reverse device maps (where its responses land):");
            for (to, map) in w.reverse_device_maps.iter() {
                let _ = writeln!(out, "      to {to}: {map}");
            }
        }
    }
    out
}

fn invalid_text(path: &Path, e: &DeviceMapError) -> String {
    let place = match e.target() {
        Some(t) => format!("worker {}, device map for {t}", e.node()),
        None => format!("worker {}", e.node()),
    };
    let mut out = format!("{}: INVALID: {} ({place})\n", path.display(), e.kind());
    for line in e.to_string().lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}
