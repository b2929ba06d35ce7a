//! A curve's output: its JSON and its plot (log-log panels), and the helpers the curves share.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use super::super::Usage;
use super::Output;

/// One line of a plot.
pub(super) struct Series {
    pub(super) name: String,
    pub(super) points: Vec<(f64, f64)>,
}

impl Series {
    pub(super) fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
        }
    }
}

/// One panel of a plot (log-log axes).
pub(super) struct Panel {
    pub(super) title: String,
    pub(super) x_desc: String,
    pub(super) y_desc: String,
    pub(super) series: Vec<Series>,
    /// Vertical marks: (x, label).
    pub(super) marks: Vec<(f64, String)>,
}

/// A TTF font from the system for the plot's text, if there is one (without one the plot has
/// lines and no text).
pub(super) fn font() -> Option<&'static [u8]> {
    static FONT: std::sync::OnceLock<Option<&'static [u8]>> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        let candidates = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        ];
        let bytes = candidates.iter().find_map(|p| std::fs::read(p).ok())?;
        Some(&*Box::leak(bytes.into_boxed_slice()))
    })
}

/// Draws `panels` one above the other into `path`.
pub(super) fn plot(path: &Path, panels: &[Panel]) -> Result<()> {
    use plotters::prelude::*;
    let text = font().is_some_and(|f| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, f).is_ok()
    });
    let height = 420 * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1100, height)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    let colors = [
        RGBColor(200, 30, 30),
        RGBColor(30, 30, 200),
        RGBColor(20, 140, 20),
        RGBColor(180, 0, 180),
        RGBColor(0, 150, 150),
        RGBColor(0, 0, 0),
        RGBColor(220, 120, 0),
        RGBColor(120, 120, 120),
    ];
    for (area, panel) in areas.iter().zip(panels) {
        let all = || {
            panel
                .series
                .iter()
                .flat_map(|s| s.points.iter().copied())
                .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
        };
        let (x0, x1) = all().fold((f64::MAX, f64::MIN), |(a, b), (x, _)| (a.min(x), b.max(x)));
        let (y0, y1) = all().fold((f64::MAX, f64::MIN), |(a, b), (_, y)| (a.min(y), b.max(y)));
        if x0 > x1 {
            continue;
        }
        let (x0, x1) = (x0 / 1.5, x1 * 1.5);
        let (y0, y1) = (y0 / 2.0, y1 * 2.0);
        let mut builder = ChartBuilder::on(area);
        builder
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70);
        if text {
            builder.caption(&panel.title, ("sans-serif", 20));
        }
        let mut chart = builder
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(|e| anyhow::anyhow!("drawing {}: {e:?}", path.display()))?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc(panel.x_desc.as_str())
                .y_desc(panel.y_desc.as_str());
        } else {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw().map_err(err)?;
        for (x, label) in &panel.marks {
            let line = chart
                .draw_series(LineSeries::new(
                    [(*x, y0), (*x, y1)],
                    RGBColor(150, 150, 150).stroke_width(1),
                ))
                .map_err(err)?;
            if text {
                let grey = RGBColor(110, 110, 110);
                line.label(label.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
            }
        }
        for (i, s) in panel.series.iter().enumerate() {
            let color = colors[i % colors.len()];
            let points: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
                .collect();
            let drawn = chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(err)?;
            if text {
                drawn
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            }
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(err)?;
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Writes the curve's JSON (with its plot's path) and draws the plot.
pub(super) fn finish(
    name: &str,
    out: &Output,
    mut json: Map<String, Value>,
    panels: &[Panel],
) -> Result<()> {
    let png = out
        .png
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("tensorwire-curve-{name}.png")));
    plot(&png, panels)?;
    json.insert("curve".into(), json!(name));
    json.insert("png".into(), json!(png.display().to_string()));
    json.insert(
        "cores".into(),
        json!(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)),
    );
    super::super::bench_common::write_json(&json, out.json.as_ref())?;
    eprintln!("tensorwire bench: drew {}", png.display());
    Ok(())
}

pub(super) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The x and a named field of every point, for a plot.
pub(super) fn xy(points: &[Value], field: &str) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
        .collect()
}

pub(super) fn check_worlds(world: &[usize], max: usize) -> Result<()> {
    if world.is_empty() || world.iter().any(|w| *w < 2 || *w > max) {
        bail!(Usage(format!(
            "--world sizes must be between 2 and {max} (got {world:?})"
        )));
    }
    Ok(())
}

/// Blocks of a measurement that alternate between the raw baseline and the agent.
pub(super) const BLOCKS: usize = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_without_points_is_drawn_blank_and_with_points_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.png");
        let panel = |points: Vec<(f64, f64)>| Panel {
            title: "t".into(),
            x_desc: "x".into(),
            y_desc: "y".into(),
            series: vec![Series::new("s", points)],
            marks: vec![(4.0, "m".into())],
        };
        plot(
            &path,
            &[panel(vec![(1.0, 2.0), (8.0, 30.0)]), panel(vec![])],
        )
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn world_sizes_out_of_range_are_usage_errors() {
        let e = check_worlds(&[2, 1], 64).unwrap_err();
        assert!(e.downcast_ref::<Usage>().is_some(), "{e}");
        assert!(e.to_string().contains("[2, 1]"), "{e}");
        assert!(check_worlds(&[65], 64).is_err());
        assert!(check_worlds(&[], 64).is_err());
        check_worlds(&[2, 64], 64).unwrap();
    }
}
