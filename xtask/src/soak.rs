//! `cargo xtask soak`: long runs of real worker processes with their resident memory and the
//! stores' key counts sampled, passing when both stay flat after warm-up.
//!
//! - `--minutes M` (decimals allowed): 4 processes (`tw-chaos-worker soak`) for M minutes.
//!   Ranks 0 to 2 stay in a dynamic RPC group and run rounds of mixed traffic, every result
//!   checked: calls to each other, RRefs created, forked to a third worker, used and dropped,
//!   a process group's all_reduce and all_gather_object, store set/get/add/delete. Rank 3 joins
//!   the group, makes calls and RRefs, and leaves, again and again. Rank 0 hosts both stores
//!   (the RPC group's and the process group's) and reports their key counts every second.
//! - `--calls N --rrefs N`: 2 processes; rank 0 makes N calls to rank 1 (64 in flight), then N
//!   RRef create/fetch/drop cycles on it.
//!
//! Every process's resident memory (`VmRSS` in `/proc/PID/status`) is sampled every second.
//!
//! **Flat**, for each curve: the first 25% of the run is warm-up. The rest is cut into four
//! quarters by time; the curve is flat when the mean of the last quarter is at most 5% above
//! the mean of the first quarter, plus a small absolute allowance (1 MiB for memory, 2 keys
//! for key counts) so that a few pages or one key in flight do not count as growth. A leak
//! that grows steadily over the run shows as the last quarter's mean above the first's.
//!
//! Prints a summary (start, after warm-up, end and maximum of every curve; flat or not) and
//! writes `target/soak/soak-<mode>.png` (plotters, bitmap backend) and a CSV of the samples.
//! The workers run in a network namespace of their own (fixed ports, nothing else there), so
//! this needs root and iproute2.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::chaos::netns::Hosts;

/// One curve: its name, unit, and (seconds since start, value) samples.
struct Curve {
    name: String,
    unit: &'static str,
    points: Vec<(f64, f64)>,
}

/// What a curve did over the run.
struct Verdict {
    start: f64,
    after_warmup: f64,
    end: f64,
    max: f64,
    first_quarter: f64,
    last_quarter: f64,
    flat: bool,
}

/// Share of the run counted as warm-up.
const WARMUP: f64 = 0.25;
/// Relative growth allowed between the first and the last quarter after warm-up.
const GROWTH: f64 = 0.05;

impl Curve {
    /// The verdict over the window `from..to` (seconds), whose first [`WARMUP`] is warm-up.
    fn verdict(&self, from: f64, to: f64, slack: f64) -> Option<Verdict> {
        let warm = from + (to - from) * WARMUP;
        let quarter = (to - warm) / 4.0;
        let mean = |from: f64, to: f64| {
            let v: Vec<f64> = self
                .points
                .iter()
                .filter(|(t, _)| *t >= from && *t <= to)
                .map(|p| p.1)
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        let first_quarter = mean(warm, warm + quarter)?;
        let last_quarter = mean(to - quarter, to)?;
        let window: Vec<(f64, f64)> = self
            .points
            .iter()
            .copied()
            .filter(|(t, _)| *t >= from && *t <= to)
            .collect();
        Some(Verdict {
            start: window.first()?.1,
            after_warmup: window.iter().find(|(t, _)| *t >= warm)?.1,
            end: window.last()?.1,
            max: window.iter().map(|p| p.1).fold(f64::MIN, f64::max),
            first_quarter,
            last_quarter,
            flat: last_quarter <= first_quarter * (1.0 + GROWTH) + slack,
        })
    }
}

/// `VmRSS` of `pid` in MiB, or `None` once it has exited.
fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

pub(crate) fn soak(args: &[String]) -> Result<()> {
    let usage = "usage: cargo xtask soak --minutes M | --calls N --rrefs N";
    let (mut minutes, mut calls, mut rrefs) = (None, None, None);
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let mut value = |what: &str| -> Result<f64> {
            let v = rest
                .next()
                .with_context(|| format!("{arg} needs {what}; {usage}"))?;
            v.parse::<f64>()
                .ok()
                .filter(|x| *x > 0.0)
                .with_context(|| format!("{arg} takes a positive number, not {v:?}"))
        };
        match arg.as_str() {
            "--minutes" => minutes = Some(value("a number of minutes")?),
            "--calls" => calls = Some(value("a count")? as u64),
            "--rrefs" => rrefs = Some(value("a count")? as u64),
            other => bail!("unexpected argument {other:?}; {usage}"),
        }
    }
    let mode = match (minutes, calls, rrefs) {
        (Some(m), None, None) => Mode::Mixed { minutes: m },
        (None, Some(c), Some(r)) => Mode::Count { calls: c, rrefs: r },
        _ => bail!("{usage}"),
    };
    let hosts = Hosts::create(1, "node")
        .map_err(|e| anyhow::anyhow!("soak runs its workers in a network namespace: {e}"))?;
    let bin = crate::chaos::build_test_bins(&["tw-chaos-worker"])?;
    run(&hosts, &bin.join("tw-chaos-worker"), mode)
}

#[derive(Clone, Copy)]
enum Mode {
    Mixed { minutes: f64 },
    Count { calls: u64, rrefs: u64 },
}

fn run(hosts: &Hosts, worker: &Path, mode: Mode) -> Result<()> {
    let (name, world, env): (&str, usize, Vec<(&str, String)>) = match mode {
        Mode::Mixed { minutes } => (
            "mixed",
            4,
            vec![(
                "TW_SOAK_SECS",
                ((minutes * 60.0).round() as u64).to_string(),
            )],
        ),
        Mode::Count { calls, rrefs } => (
            "count",
            2,
            vec![
                ("TW_CALLS", calls.to_string()),
                ("TW_RREFS", rrefs.to_string()),
            ],
        ),
    };
    let t0 = Instant::now();
    let (tx, lines) = mpsc::channel::<(usize, f64, String)>();
    let mut pids = Vec::new();
    for rank in 0..world {
        let mut cmd = hosts.command(0, worker);
        cmd.arg(if name == "mixed" { "soak" } else { "count" })
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "29500")
            .env("TW_PG_PORT", "29501")
            .env("TENSORWIRE_SECRET", format!("soak-{}", hosts.prefix()))
            .env_remove("TENSORWIRE_IFNAME")
            .env_remove("RUST_LOG")
            .envs(env.iter().map(|(k, v)| (k, v)));
        let index = hosts.spawn(&mut cmd);
        pids.push((index, hosts.pid(index)));
        let (_, stdout, stderr) = hosts.take(index);
        for stream in [
            Box::new(stdout.context("piped")?) as Box<dyn Read + Send>,
            Box::new(stderr.context("piped")?),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, t0.elapsed().as_secs_f64(), line));
                }
            });
        }
    }
    drop(tx);
    let mut rss: Vec<Curve> = (0..world)
        .map(|r| Curve {
            name: format!(
                "rank {r}{}",
                if name == "mixed" && r == 3 {
                    " (joins and leaves)"
                } else {
                    ""
                }
            ),
            unit: "MiB",
            points: Vec::new(),
        })
        .collect();
    let mut keys = [
        Curve {
            name: "RPC group's store".into(),
            unit: "keys",
            points: Vec::new(),
        },
        Curve {
            name: "process group's store".into(),
            unit: "keys",
            points: Vec::new(),
        },
    ];
    let mut said: Vec<(usize, String)> = Vec::new();
    // When rank 0 last reported progress of each phase (count mode), in seconds.
    let mut progress_at: std::collections::HashMap<&str, f64> = Default::default();
    let limit = match mode {
        Mode::Mixed { minutes } => Duration::from_secs_f64(minutes * 60.0 + 300.0),
        Mode::Count { calls, rrefs } => Duration::from_secs(600 + (calls + rrefs * 10) / 1000),
    };
    let mut next_sample = Instant::now();
    let mut last_progress = Instant::now();
    loop {
        if t0.elapsed() > limit {
            bail!("the soak ran past {limit:?}; last lines: {:?}", tail(&said));
        }
        let now = Instant::now();
        if now >= next_sample {
            let t = t0.elapsed().as_secs_f64();
            for (r, (_, pid)) in pids.iter().enumerate() {
                if let Some(m) = rss_mib(*pid) {
                    rss[r].points.push((t, m));
                }
            }
            next_sample += Duration::from_secs(1);
        }
        match lines.recv_timeout(next_sample.saturating_duration_since(Instant::now())) {
            Ok((rank, t, line)) => {
                if let Some(rest) = line.strip_prefix("KEYS ") {
                    let field = |k: &str| -> Option<f64> {
                        rest.split_whitespace()
                            .find_map(|f| f.strip_prefix(k))?
                            .parse()
                            .ok()
                    };
                    if let (Some(a), Some(b)) = (field("rpc="), field("pg=")) {
                        keys[0].points.push((t, a));
                        keys[1].points.push((t, b));
                    }
                } else {
                    if rank == 0 && line.starts_with("PROGRESS calls=") {
                        progress_at.insert("calls", t);
                    }
                    if line.starts_with("PROGRESS")
                        && last_progress.elapsed() > Duration::from_secs(15)
                    {
                        eprintln!("xtask: soak: {:.0} s: [{rank}] {line}", t);
                        last_progress = Instant::now();
                    }
                    said.push((rank, line));
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let duration = t0.elapsed().as_secs_f64();
    let codes: Vec<Option<i32>> = pids
        .iter()
        .map(|(i, _)| hosts.with_child(*i, |c| c.wait().ok().and_then(|s| s.code())))
        .collect();
    let out_dir = crate::workspace_root().join("target").join("soak");
    std::fs::create_dir_all(&out_dir)?;
    let png = out_dir.join(format!("soak-{name}.png"));
    let csv = out_dir.join(format!("soak-{name}.csv"));
    write_csv(&csv, rss.iter().chain(keys.iter()))?;

    // The run's span for the verdict: until the first process exited (then memory falls and
    // key counts drop as workers leave, which is not what is judged).
    let span = rss
        .iter()
        .filter_map(|c| c.points.last().map(|p| p.0))
        .fold(duration, f64::min);
    println!(
        "soak ({name}): {world} processes, {:.1} min",
        duration / 60.0
    );
    for (r, line) in &said {
        if line.starts_with("OK ") || line.starts_with("FAIL") {
            println!("  [{r}] {line}");
        }
    }
    println!(
        "  flat = after {:.0}% warm-up, the last quarter's mean at most {:.0}% above the first \
         quarter's (+1 MiB / +2 keys); judged over the first {span:.0} s (until a process began \
         to exit)",
        WARMUP * 100.0,
        GROWTH * 100.0
    );
    println!(
        "  {:<40} {:>9} {:>12} {:>9} {:>9} {:>10} {:>10}  flat",
        "curve", "start", "after warm", "end", "max", "1st qtr", "last qtr"
    );
    let mut failed = Vec::new();
    // What is judged: every curve over the whole run, or (count mode) the calls and the RRef
    // cycles as two windows, each with its own warm-up (their steady states differ).
    let calls_end = progress_at.get("calls").copied();
    let mut windows: Vec<(String, &Curve, f64, f64, f64)> = Vec::new();
    for c in &rss {
        match (name, calls_end) {
            ("count", Some(mid)) => {
                windows.push((format!("{} during calls", c.name), c, 0.0, mid, 1.0));
                windows.push((format!("{} during RRef cycles", c.name), c, mid, span, 1.0));
            }
            _ => windows.push((c.name.clone(), c, 0.0, span, 1.0)),
        }
    }
    if name == "mixed" {
        for c in &keys {
            windows.push((c.name.clone(), c, 0.0, span, 2.0));
        }
    }
    for (label, curve, from, to, slack) in windows {
        let Some(v) = curve.verdict(from, to, slack) else {
            failed.push(format!("{label}: too few samples to judge"));
            continue;
        };
        println!(
            "  {:<40} {:>9.1} {:>12.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1}  {} ({})",
            label,
            v.start,
            v.after_warmup,
            v.end,
            v.max,
            v.first_quarter,
            v.last_quarter,
            if v.flat { "yes" } else { "NO" },
            curve.unit
        );
        if !v.flat {
            failed.push(format!("{label} grew"));
        }
    }
    if let Err(e) = plot(&png, name, &rss, &keys) {
        println!("  (no plot: {e:#})");
    } else {
        println!("  plot: {}", png.display());
    }
    println!("  samples: {}", csv.display());
    if codes.iter().any(|c| *c != Some(0)) {
        failed.push(format!("exit codes {codes:?}; {:?}", tail(&said)));
    }
    if failed.is_empty() {
        println!("soak passed");
        Ok(())
    } else {
        bail!("soak failed: {}", failed.join("; "))
    }
}

fn tail(said: &[(usize, String)]) -> Vec<String> {
    said.iter()
        .rev()
        .take(10)
        .rev()
        .map(|(r, l)| format!("[{r}] {l}"))
        .collect()
}

fn write_csv<'a>(path: &Path, curves: impl Iterator<Item = &'a Curve>) -> Result<()> {
    let mut out = String::from("curve,unit,seconds,value\n");
    for c in curves {
        for (t, v) in &c.points {
            out.push_str(&format!("{},{},{t:.2},{v:.3}\n", c.name, c.unit));
        }
    }
    std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))
}

/// A TTF font from the system for the plot's text, if there is one.
fn font() -> Option<&'static [u8]> {
    let candidates = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ];
    let bytes = candidates.iter().find_map(|p| std::fs::read(p).ok())?;
    Some(Box::leak(bytes.into_boxed_slice()))
}

fn plot(path: &Path, name: &str, rss: &[Curve], keys: &[Curve]) -> Result<()> {
    use plotters::prelude::*;
    let text = font().is_some_and(|f| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, f).is_ok()
    });
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels: Vec<(&[Curve], &str)> = if keys.iter().any(|c| !c.points.is_empty()) {
        vec![(rss, "resident memory (MiB)"), (keys, "store keys")]
    } else {
        vec![(rss, "resident memory (MiB)")]
    };
    let areas = root.split_evenly((panels.len(), 1));
    let colors = [&RED, &BLUE, &GREEN, &MAGENTA, &CYAN, &BLACK];
    for (area, (curves, title)) in areas.iter().zip(panels) {
        let t_max = curves
            .iter()
            .flat_map(|c| c.points.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let y_max = curves
            .iter()
            .flat_map(|c| c.points.iter().map(|p| p.1))
            .fold(1.0, f64::max)
            * 1.15;
        let mut builder = ChartBuilder::on(area);
        builder
            .margin(15)
            .x_label_area_size(35)
            .y_label_area_size(60);
        if text {
            builder.caption(format!("soak ({name}): {title}"), ("sans-serif", 22));
        }
        let mut chart = builder.build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("seconds").y_desc(title);
        } else {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw()?;
        for (i, c) in curves.iter().enumerate() {
            let color = colors[i % colors.len()];
            let series = chart.draw_series(LineSeries::new(c.points.iter().copied(), color))?;
            if text {
                series
                    .label(c.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            }
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}
