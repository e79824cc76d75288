//! The benchmark's plot: capture and restore time against workload size, casfs and
//! each peer, log-log (plotters, SVG).

use std::path::Path;

use anyhow::{anyhow, bail, Context};
use plotters::prelude::*;

use super::report::Report;

/// Debian's DejaVu Sans (package fonts-dejavu-core), for the labels.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn load_font() -> anyhow::Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes =
            std::fs::read(FONT).map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .map_err(|_| format!("{FONT}: not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

const COLORS: [RGBColor; 7] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

/// Draws capture (initial) and restore time against files, one line per tool.
pub fn draw(r: &Report, path: &Path) -> anyhow::Result<()> {
    let panels = [
        ("capture", "initial capture"),
        ("restore", "restore into an empty directory"),
    ];
    if !panels
        .iter()
        .any(|(sc, _)| r.results.iter().any(|s| s.scenario == *sc))
    {
        bail!("the report has no capture or restore results to plot");
    }
    load_font()?;
    let root = SVGBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let areas = root.split_evenly((1, 2));
    let mut tools: Vec<String> = vec!["casfs".into()];
    for s in &r.results {
        if !tools.contains(&s.tool) {
            tools.push(s.tool.clone());
        }
    }
    for ((scenario, title), area) in panels.iter().zip(areas.iter()) {
        let pts: Vec<_> = r
            .results
            .iter()
            .filter(|s| s.scenario == *scenario)
            .collect();
        if pts.is_empty() {
            continue;
        }
        let (x0, x1) = pts.iter().fold((f64::MAX, 0f64), |(a, b), s| {
            (a.min(s.files as f64), b.max(s.files as f64))
        });
        let (y0, y1) = pts.iter().fold((f64::MAX, 0f64), |(a, b), s| {
            (a.min(s.median_ms), b.max(s.median_ms))
        });
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{title} (ms, log-log)"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(
                (x0 * 0.8..x1 * 1.25).log_scale(),
                (y0.max(0.1) * 0.7..y1 * 1.5).log_scale(),
            )
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("files in the workspace")
            .y_desc("median ms")
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for (i, tool) in tools.iter().enumerate() {
            let mut line: Vec<(f64, f64)> = pts
                .iter()
                .filter(|s| &s.tool == tool)
                .map(|s| (s.files as f64, s.median_ms))
                .collect();
            if line.is_empty() {
                continue;
            }
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            let c = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(line.clone(), c.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(tool.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
            chart
                .draw_series(line.into_iter().map(|p| Circle::new(p, 3, c.filled())))
                .map_err(|e| anyhow!("{e}"))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present()
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("writing {}", path.display()))
}
