//! Charts of an experiment's results, written as PNG with plotters: stacked bars for
//! breakdowns, lines for a cost against a setting.
//!
//! Text needs a TrueType font: the first of [`FONT_PATHS`] that exists (Debian's
//! `fonts-dejavu-core`) is loaded once. Without one the chart is not drawn and the
//! caller is told why; the numbers are in the report either way.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::Error;

/// Where a sans-serif TrueType font is looked for.
pub const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// One bar: its label and its segments, bottom to top.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bar {
    /// Under the bar.
    pub label: String,
    /// (class, value) pairs; a class keeps its colour across bars.
    #[serde(deserialize_with = "crate::report::nan::labelled")]
    pub segments: Vec<(String, f64)>,
}

/// A stacked-bar chart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StackedBars {
    /// File-name part: the chart is written as `<experiment id>-<name>.png`.
    pub name: String,
    /// Caption.
    pub title: String,
    /// The y axis' unit.
    pub unit: String,
    /// Left to right.
    pub bars: Vec<Bar>,
}

fn font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let bytes = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or("no TrueType font found (install fonts-dejavu-core)")?;
        // Registered once for the process's life, as plotters requires.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the font file could not be parsed".to_string())
    })
    .clone()
}

/// The series' legend, top right.
fn legend<'a, X, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
) -> Result<(), Error>
where
    X: Ranged,
    Y: Ranged,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(Error::other)
}

impl StackedBars {
    /// The classes in first-seen order (legend and colour order).
    fn classes(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for b in &self.bars {
            for (c, _) in &b.segments {
                if !out.contains(&c.as_str()) {
                    out.push(c);
                }
            }
        }
        out
    }

    /// Draws the chart into `path` (PNG).
    pub fn render(&self, path: &Path) -> Result<(), Error> {
        font().map_err(Error::Other)?;
        let n = self.bars.len().max(1);
        let top = self
            .bars
            .iter()
            .map(|b| b.segments.iter().map(|s| s.1.max(0.0)).sum::<f64>())
            .fold(0.0, f64::max)
            .max(1.0)
            * 1.15;
        // Two empty slots at the right hold the legend.
        let width = (160 + 110 * (n as u32 + 2)).max(700);
        let root = BitMapBackend::new(path, (width, 620)).into_drawing_area();
        root.fill(&WHITE).map_err(Error::other)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(60)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n + 1).into_segmented(), 0.0..top)
            .map_err(Error::other)?;
        let labels: Vec<String> = self.bars.iter().map(|b| b.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(&self.unit)
            .x_labels(n + 2)
            .x_label_style(("sans-serif", 13))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .draw()
            .map_err(Error::other)?;
        for (k, class) in self.classes().into_iter().enumerate() {
            let colour = Palette99::pick(k).mix(0.9);
            let mut rects = Vec::new();
            for (i, b) in self.bars.iter().enumerate() {
                let mut base = 0.0;
                for (c, v) in &b.segments {
                    let v = v.max(0.0);
                    if c == class && v > 0.0 {
                        rects.push(Rectangle::new(
                            [
                                (SegmentValue::Exact(i), base),
                                (SegmentValue::Exact(i + 1), base + v),
                            ],
                            colour.filled(),
                        ));
                    }
                    base += v;
                }
            }
            chart
                .draw_series(rects.into_iter().map(|mut r| {
                    r.set_margin(0, 0, 14, 14);
                    r
                }))
                .map_err(Error::other)?
                .label(class)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 12, y + 6)], colour.filled())
                });
        }
        legend(&mut chart)?;
        root.present().map_err(Error::other)?;
        Ok(())
    }
}

/// One line of a [`Lines`] chart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    /// In the legend.
    pub label: String,
    /// (x, y) points, drawn in order.
    #[serde(deserialize_with = "crate::report::nan::points")]
    pub points: Vec<(f64, f64)>,
}

/// A chart of lines over a numeric x axis (a cost against an offset, a rate, a setting).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lines {
    /// File-name part: the chart is written as `<experiment id>-<name>.png`.
    pub name: String,
    /// Caption.
    pub title: String,
    /// The x axis' unit.
    pub x_unit: String,
    /// The y axis' unit.
    pub unit: String,
    /// The lines.
    pub series: Vec<Series>,
}

impl Lines {
    /// Draws the chart into `path` (PNG); the y axis starts at zero.
    pub fn render(&self, path: &Path) -> Result<(), Error> {
        font().map_err(Error::Other)?;
        let pts = || self.series.iter().flat_map(|s| s.points.iter());
        let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (x0, x1) = if x0 < x1 { (x0, x1) } else { (0.0, 1.0) };
        // Headroom above the highest point holds the legend.
        let top = pts().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.6;
        let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(Error::other)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, 0.0..top)
            .map_err(Error::other)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_unit)
            .y_desc(&self.unit)
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(Error::other)?;
        for (k, s) in self.series.iter().enumerate() {
            let colour = Palette99::pick(k).mix(0.9);
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    colour.stroke_width(2),
                ))
                .map_err(Error::other)?
                .label(&s.label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 14, y)], colour.stroke_width(2))
                });
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(Error::other)?;
        }
        legend(&mut chart)?;
        root.present().map_err(Error::other)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_written_as_a_png_when_a_font_exists() {
        let c = StackedBars {
            name: "t".into(),
            title: "test".into(),
            unit: "ns/pkt".into(),
            bars: vec![
                Bar {
                    label: "a".into(),
                    segments: vec![("x".into(), 3.0), ("y".into(), 2.0)],
                },
                Bar {
                    label: "b".into(),
                    segments: vec![("y".into(), 4.0)],
                },
            ],
        };
        assert_eq!(c.classes(), vec!["x", "y"]);
        let dir = std::env::temp_dir().join(format!("pvio-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t.png");
        match c.render(&path) {
            Ok(()) => {
                let bytes = std::fs::read(&path).expect("written");
                assert_eq!(&bytes[1..4], b"PNG");
            }
            // Only a missing font may stop it, and then nothing is written.
            Err(e) => {
                assert!(e.to_string().contains("font"), "{e}");
                assert!(!path.exists());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_line_chart_is_written_as_a_png_when_a_font_exists() {
        let c = Lines {
            name: "l".into(),
            title: "test".into(),
            x_unit: "offset".into(),
            unit: "ns".into(),
            series: vec![Series {
                label: "copy".into(),
                points: vec![(0.0, 1.0), (1.0, 2.0), (2.0, 1.5)],
            }],
        };
        let dir = std::env::temp_dir().join(format!("pvio-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("l.png");
        match c.render(&path) {
            Ok(()) => assert_eq!(&std::fs::read(&path).expect("written")[1..4], b"PNG"),
            Err(e) => {
                assert!(e.to_string().contains("font"), "{e}");
                assert!(!path.exists());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
