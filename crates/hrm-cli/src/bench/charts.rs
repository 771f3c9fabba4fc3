//! PNG bar charts for the A/B report, drawn with plotters on an in-memory bitmap.
//!
//! Text is rendered with ab_glyph from the DejaVu Sans bytes compiled into the binary, so the
//! charts look the same on any machine and need no system fonts.

use anyhow::{Context, Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::OnceLock;

const FONT: &str = "sans-serif";
const BAR: RGBColor = RGBColor(52, 101, 164);
/// Each panel is this many pixels wide and high.
const PANEL: (u32, u32) = (480, 360);

/// One panel: a metric measured for every target. `None` (not measured) draws no bar.
pub struct Panel<'a> {
    pub title: &'a str,
    pub values: Vec<Option<f64>>,
}

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    ok.then_some(())
        .ok_or_else(|| anyhow!("the bundled DejaVu Sans font did not load"))
}

/// Draws `panels` side by side in rows of `columns`, one bar per target, and writes a PNG.
pub fn write_bars(
    path: &Path,
    targets: &[String],
    panels: &[Panel<'_>],
    columns: usize,
) -> Result<()> {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let size = (PANEL.0 * columns as u32, PANEL.1 * rows as u32);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    draw_bars(&root, targets, panels, (rows, columns))
        .with_context(|| format!("writing {}", path.display()))
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    targets: &[String],
    panels: &[Panel<'_>],
    grid: (usize, usize),
) -> Result<()> {
    register_font()?;
    root.fill(&WHITE).map_err(plot_error)?;
    for (area, panel) in root.split_evenly(grid).iter().zip(panels) {
        draw_panel(area, targets, panel)?;
    }
    root.present().map_err(plot_error)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    targets: &[String],
    panel: &Panel<'_>,
) -> Result<()> {
    let top = panel
        .values
        .iter()
        .flatten()
        .copied()
        .fold(0.0f64, f64::max);
    let top = if top > 0.0 { top * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT, 18))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(56)
        // plotters' integer ranges are inclusive when segmented: 0..n-1 gives n slots.
        .build_cartesian_2d(
            (0..targets.len().saturating_sub(1)).into_segmented(),
            0.0..top,
        )
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(targets.len())
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => targets.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_label_formatter(&|v| format_value(*v))
        .max_light_lines(1)
        .label_style((FONT, 13))
        .draw()
        .map_err(plot_error)?;
    let bars = panel
        .values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.map(|v| (i, v)));
    chart
        .draw_series(bars.clone().map(|(i, v)| {
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), v),
                ],
                BAR.filled(),
            );
            bar.set_margin(0, 0, 18, 18);
            bar
        }))
        .map_err(plot_error)?;
    chart
        .draw_series(bars.map(|(i, v)| {
            Text::new(
                format_value(v),
                (SegmentValue::CenterOf(i), v + top * 0.02),
                (FONT, 13)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))
        .map_err(plot_error)?;
    Ok(())
}

fn format_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels of the bar colour in each bar (a run of columns holding that colour), left to
    /// right, in a one-panel chart.
    fn bar_pixels(values: Vec<Option<f64>>) -> Vec<usize> {
        let targets: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let size = PANEL;
        let mut pixels = vec![255u8; (size.0 * size.1 * 3) as usize];
        let panels = [Panel { title: "t", values }];
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        draw_bars(&root, &targets, &panels, (1, 1)).unwrap();
        drop(root);
        let mut columns = vec![0usize; size.0 as usize];
        for (k, px) in pixels.chunks_exact(3).enumerate() {
            if px == [BAR.0, BAR.1, BAR.2] {
                columns[k % size.0 as usize] += 1;
            }
        }
        let mut bars = Vec::new();
        let mut in_bar = false;
        for count in columns {
            match (count > 0, in_bar) {
                (true, false) => bars.push(count),
                (true, true) => *bars.last_mut().unwrap() += count,
                _ => {}
            }
            in_bar = count > 0;
        }
        bars
    }

    #[test]
    fn bars_are_as_tall_as_their_values() {
        let bars = bar_pixels(vec![Some(10.0), Some(20.0), None]);
        assert_eq!(bars.len(), 2, "an unmeasured value draws no bar: {bars:?}");
        let ratio = bars[1] as f64 / bars[0] as f64;
        assert!((ratio - 2.0).abs() < 0.1, "{bars:?}");
        let bars = bar_pixels(vec![None, Some(5.0), Some(5.0)]);
        assert_eq!(bars.len(), 2, "{bars:?}");
        assert!(bars[0].abs_diff(bars[1]) <= bars[0] / 50, "{bars:?}");
    }

    #[test]
    fn charts_are_written_as_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.png");
        let targets = vec!["hrm".to_string(), "llama.cpp".to_string()];
        let panels = [
            Panel {
                title: "p50 ms",
                values: vec![Some(12.5), Some(30.0)],
            },
            Panel {
                title: "tokens/s",
                values: vec![Some(250.0), None],
            },
        ];
        write_bars(&path, &targets, &panels, 2).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // Width and height from the IHDR chunk: two panels side by side.
        let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((width, height), (2 * PANEL.0, PANEL.1));
        // One target (a single slot) draws too.
        let one = [Panel {
            title: "req/s",
            values: vec![Some(3.0)],
        }];
        write_bars(&dir.path().join("one.png"), &targets[..1], &one, 2).unwrap();
    }
}
