//! Plots as PNG and SVG (plotters): latency CDFs of one or several runs, and sweep curves (goodput
//! and SLO attainment against request rate, one line per configuration).
//!
//! Every plot is written twice, `STEM.png` and `STEM.svg`, from one drawing function generic over
//! the backend, so the two never disagree. Text needs a TrueType font: plotters' `ab_glyph`
//! renderer is pure Rust and reads the font registered here, found in the usual system places
//! (Debian's `fonts-dejavu-core`) or named by `CLEAVE_PLOT_FONT`. With no font, plotting fails with
//! an error that says so; the numbers in the result files do not depend on it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{BenchError, Result};

/// One named line: `(x, y)` points in drawing order.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel of a latency-CDF figure: a metric and, per run, its samples in milliseconds.
#[derive(Debug, Clone)]
pub struct CdfPanel {
    pub metric: String,
    pub runs: Vec<(String, Vec<f64>)>,
}

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers the first font found as plotters' "sans-serif", once per process.
fn ensure_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let env = std::env::var_os("CLEAVE_PLOT_FONT").map(PathBuf::from);
        let candidates = env.iter().cloned().chain(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                // Leaked once: plotters keeps fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                return plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{} is not a TrueType font", path.display()));
            }
        }
        Err(format!(
            "no TrueType font found (tried {}; install fonts-dejavu-core or set CLEAVE_PLOT_FONT)",
            FONT_CANDIDATES.join(", ")
        ))
    })
    .clone()
    .map_err(|msg| BenchError::Plot { path: PathBuf::new(), msg })
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot { path: path.to_path_buf(), msg: e.to_string() }
}

/// A figure drawable on any plotters backend (generic methods cannot be closures, hence a trait).
trait Figure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String>;
}

/// Draws `fig` into `STEM.png` and `STEM.svg`; returns both paths.
fn write_both(stem: &Path, size: (u32, u32), fig: &impl Figure) -> Result<Vec<PathBuf>> {
    ensure_font()?;
    if let Some(dir) = stem.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    }
    // Appended, not `with_extension`: a stem like `cdf-rate0.15` has a dot that is not an extension.
    let with = |ext: &str| {
        let mut p = stem.as_os_str().to_owned();
        p.push(".");
        p.push(ext);
        PathBuf::from(p)
    };
    let (png, svg) = (with("png"), with("svg"));
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        fig.draw(&root).map_err(|e| plot_err(&png, e))?;
        root.present().map_err(|e| plot_err(&png, e))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        fig.draw(&root).map_err(|e| plot_err(&svg, e))?;
        root.present().map_err(|e| plot_err(&svg, e))?;
    }
    Ok(vec![png, svg])
}

/// The empirical CDF of `samples`: sorted values against cumulative fraction.
pub fn cdf_points(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    COLORS[i % COLORS.len()]
}

/// Range of `values` padded a little, never empty.
fn span(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo < 1e-9 {
        hi = lo + 1.0;
    }
    (lo, hi + (hi - lo) * 0.05)
}

/// A line chart in `area`: one line per series, an optional dashed horizontal reference (an SLO or
/// an attainment target) and an optional vertical one.
fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    hline: Option<(f64, &str)>,
    vline: Option<(f64, &str)>,
) -> std::result::Result<(), String> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).chain(vline.map(|v| v.0));
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).chain(hline.map(|h| h.0));
    let (x0, x1) = span(xs, true);
    let (y0, y1) = span(ys, true);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        // Markers only where they say which points were measured (sweeps), not on dense CDFs.
        if s.points.len() <= 30 {
            chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(|e| e.to_string())?;
        }
    }
    if let Some((y, label)) = hline {
        let style = BLACK.mix(0.6).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(vec![(x0, y), (x1, y)], 6, 4, style))
            .map_err(|e| e.to_string())?
            .label(label.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    if let Some((x, label)) = vline {
        let style = RED.mix(0.6).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(vec![(x, y0), (x, y1)], 6, 4, style))
            .map_err(|e| e.to_string())?
            .label(label.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

struct CdfFigure<'a> {
    title: &'a str,
    panels: &'a [CdfPanel],
    slos_ms: &'a [(String, f64)],
    rows: usize,
    cols: usize,
}

impl Figure for CdfFigure<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root.titled(self.title, ("sans-serif", 22)).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((self.rows, self.cols));
        for (panel, area) in self.panels.iter().zip(areas.iter()) {
            let series: Vec<Series> =
                panel.runs.iter().map(|(label, v)| Series { label: label.clone(), points: cdf_points(v) }).collect();
            let slo = self.slos_ms.iter().find(|(m, _)| *m == panel.metric).map(|(_, v)| (*v, "SLO"));
            let x_label = format!("{} (ms)", panel.metric);
            draw_lines(area, &panel.metric, &x_label, "fraction of requests", &series, None, slo)?;
        }
        Ok(())
    }
}

/// Latency CDFs, one panel per metric (laid out in a grid of two columns), one line per run, with
/// the metric's SLO as a vertical line when `slos_ms` names it. Writes `STEM.png` and `STEM.svg`.
pub fn latency_cdfs(stem: &Path, title: &str, panels: &[CdfPanel], slos_ms: &[(String, f64)]) -> Result<Vec<PathBuf>> {
    if panels.is_empty() {
        return Err(BenchError::InvalidArg("a CDF plot needs at least one metric".into()));
    }
    let cols = panels.len().min(2);
    let rows = panels.len().div_ceil(cols);
    let size = (560 * cols as u32, 400 * rows as u32 + 40);
    write_both(stem, size, &CdfFigure { title, panels, slos_ms, rows, cols })
}

struct LinesFigure<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    hline: Option<(f64, &'a str)>,
}

impl Figure for LinesFigure<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        draw_lines(root, self.title, self.x_label, self.y_label, self.series, self.hline, None)
    }
}

/// A line chart of `series` (for sweeps: goodput or attainment against request rate), with an
/// optional dashed horizontal reference. Writes `STEM.png` and `STEM.svg`.
pub fn lines(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    hline: Option<(f64, &str)>,
) -> Result<Vec<PathBuf>> {
    write_both(stem, (800, 520), &LinesFigure { title, x_label, y_label, series, hline })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_sorted_and_ends_at_one() {
        let p = cdf_points(&[3.0, 1.0, f64::NAN, 2.0]);
        assert_eq!(p, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }

    #[test]
    fn writes_png_and_svg() {
        let dir = tempfile::tempdir().unwrap();
        let panels = vec![
            CdfPanel { metric: "TTFT".into(), runs: vec![("a".into(), vec![1.0, 5.0, 9.0]), ("b".into(), vec![2.0])] },
            CdfPanel { metric: "TPOT".into(), runs: vec![("a".into(), vec![])] },
        ];
        let files = latency_cdfs(&dir.path().join("cdf"), "test", &panels, &[("TTFT".into(), 4.0)]).unwrap();
        let series = vec![Series { label: "1p1d".into(), points: vec![(0.1, 0.1), (0.2, 0.19)] }];
        let more =
            lines(&dir.path().join("sub/g"), "goodput", "rate", "req/s", &series, Some((0.9, "target"))).unwrap();
        for f in files.iter().chain(&more) {
            let bytes = std::fs::read(f).unwrap();
            assert!(bytes.len() > 1000, "{} is {} bytes", f.display(), bytes.len());
        }
        let svg = std::fs::read_to_string(dir.path().join("cdf.svg")).unwrap();
        assert!(svg.contains("TTFT") && svg.contains("<svg"), "the SVG names its panel");
        assert_eq!(&std::fs::read(dir.path().join("cdf.png")).unwrap()[1..4], b"PNG");
        let dotted = lines(&dir.path().join("rate0.15"), "t", "x", "y", &series, None).unwrap();
        assert_eq!(dotted[0], dir.path().join("rate0.15.png"), "a dot in the stem is kept");
    }
}
