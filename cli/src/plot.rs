//! The loss curve of `localnet up` as a PNG: held-out loss per epoch (blue, with markers) and
//! the corpus's entropy floor (red). Drawn by plotters into a pixel buffer and encoded by `png`,
//! so no font or system library is needed: plotters' text needs a font backend, so the few
//! labels (tick values, `loss`, `floor`, `epoch`) use a built-in 3×5 pixel font instead.

use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;

/// Size of the picture in pixels.
pub const WIDTH: u32 = 640;
pub const HEIGHT: u32 = 400;

/// The curve's colour (also what the tests look for).
pub const LOSS_COLOR: RGBColor = RGBColor(31, 90, 200);
pub const FLOOR_COLOR: RGBColor = RGBColor(210, 40, 40);

/// Renders the curve into an RGB buffer (`WIDTH × HEIGHT × 3`). `losses[0]` is the loss before
/// the first epoch, `losses[e]` after epoch `e`; `floor`, where the corpus has a known one.
pub fn render(losses: &[f32], floor: Option<f32>) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(!losses.is_empty(), "no loss to plot");
    anyhow::ensure!(
        losses.iter().chain(&floor).all(|v| v.is_finite()),
        "losses must be finite to plot"
    );
    let mut buf = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let lo = losses
            .iter()
            .chain(&floor)
            .copied()
            .fold(f32::INFINITY, f32::min) as f64;
        let hi = losses
            .iter()
            .chain(&floor)
            .copied()
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        let pad = ((hi - lo) * 0.08).max(0.05);
        let (y0, y1) = (lo - pad, hi + pad);
        let x1 = (losses.len() - 1).max(1) as f64;
        let mut chart = ChartBuilder::on(&root)
            .margin_top(30)
            .margin_right(20)
            .margin_left(70)
            .margin_bottom(50)
            .build_cartesian_2d(0f64..x1, y0..y1)
            .map_err(plot_err)?;
        let area = chart.plotting_area();
        let ((px0, py0), (px1, py1)) = (
            area.map_coordinate(&(0.0, y1)),
            area.map_coordinate(&(x1, y0)),
        );
        // Frame, y ticks with values, x ticks with epoch numbers.
        root.draw(&Rectangle::new([(px0, py0), (px1, py1)], BLACK))
            .map_err(plot_err)?;
        for i in 0..=4 {
            let v = y0 + (y1 - y0) * f64::from(i) / 4.0;
            let (_, y) = area.map_coordinate(&(0.0, v));
            root.draw(&PathElement::new(
                vec![(px0, y), (px1, y)],
                RGBColor(225, 225, 225),
            ))
            .map_err(plot_err)?;
            root.draw(&PathElement::new(vec![(px0 - 5, y), (px0, y)], BLACK))
                .map_err(plot_err)?;
            let label = format!("{v:.2}");
            text(&root, &label, px0 - 8 - text_width(&label), y - 5, &BLACK)?;
        }
        let step = (losses.len() / 10).max(1);
        for e in (0..losses.len()).step_by(step) {
            let (x, _) = area.map_coordinate(&(e as f64, y0));
            root.draw(&PathElement::new(vec![(x, py1), (x, py1 + 5)], BLACK))
                .map_err(plot_err)?;
            let label = e.to_string();
            text(&root, &label, x - text_width(&label) / 2, py1 + 9, &BLACK)?;
        }
        text(
            &root,
            "epoch",
            (px0 + px1) / 2 - text_width("epoch") / 2,
            py1 + 28,
            &BLACK,
        )?;
        // Legend above the frame.
        let legend = [("loss", LOSS_COLOR), ("floor", FLOOR_COLOR)];
        for (i, (name, color)) in legend[..1 + usize::from(floor.is_some())]
            .iter()
            .copied()
            .enumerate()
        {
            let x = px0 + 10 + 110 * i as i32;
            root.draw(&PathElement::new(
                vec![(x, 15), (x + 24, 15)],
                color.stroke_width(3),
            ))
            .map_err(plot_err)?;
            text(&root, name, x + 32, 10, &color)?;
        }
        if let Some(floor) = floor {
            chart
                .draw_series(LineSeries::new(
                    [(0.0, f64::from(floor)), (x1, f64::from(floor))],
                    FLOOR_COLOR.stroke_width(2),
                ))
                .map_err(plot_err)?;
        }
        let points: Vec<(f64, f64)> = losses
            .iter()
            .enumerate()
            .map(|(e, l)| (e as f64, f64::from(*l)))
            .collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                LOSS_COLOR.stroke_width(2),
            ))
            .map_err(plot_err)?;
        chart
            .draw_series(
                points
                    .iter()
                    .map(|p| Circle::new(*p, 4, LOSS_COLOR.filled())),
            )
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(buf)
}

/// Encodes an RGB buffer of `WIDTH × HEIGHT` as PNG bytes.
pub fn encode_png(rgb: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, WIDTH, HEIGHT);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().context("PNG header")?;
        w.write_image_data(rgb).context("PNG data")?;
    }
    Ok(out)
}

/// Renders the curve and writes it to `path` as PNG.
pub fn write_loss_png(path: &Path, losses: &[f32], floor: Option<f32>) -> anyhow::Result<()> {
    let png = encode_png(&render(losses, floor)?)?;
    std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the loss plot: {e:?}")
}

/// Pixels per font dot.
const SCALE: i32 = 2;

/// A 3×5 glyph, one row per entry, bit 2 the leftmost dot.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        'c' => [0, 7, 4, 4, 7],
        'e' => [0, 7, 7, 4, 7],
        'f' => [3, 2, 7, 2, 2],
        'h' => [4, 4, 7, 5, 5],
        'l' => [6, 2, 2, 2, 7],
        'o' => [0, 7, 5, 5, 7],
        'p' => [0, 7, 5, 7, 4],
        'r' => [0, 5, 6, 4, 4],
        's' => [0, 7, 6, 3, 7],
        _ => [0; 5],
    }
}

fn text_width(s: &str) -> i32 {
    s.chars().count() as i32 * 4 * SCALE
}

/// Draws `s` with its top-left corner at `(x, y)` in the built-in pixel font.
fn text<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    s: &str,
    x: i32,
    y: i32,
    color: &RGBColor,
) -> anyhow::Result<()> {
    for (i, c) in s.chars().enumerate() {
        let gx = x + i as i32 * 4 * SCALE;
        for (row, bits) in glyph(c).iter().enumerate() {
            for col in 0..3 {
                if bits & (4 >> col) != 0 {
                    let (px, py) = (gx + col * SCALE, y + row as i32 * SCALE);
                    area.draw(&Rectangle::new(
                        [(px, py), (px + SCALE, py + SCALE)],
                        color.filled(),
                    ))
                    .map_err(plot_err)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve_pixels(rgb: &[u8]) -> Vec<usize> {
        rgb.chunks(3)
            .enumerate()
            .filter(|(_, p)| *p == [LOSS_COLOR.0, LOSS_COLOR.1, LOSS_COLOR.2])
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn writes_a_png_that_decodes_to_the_rendered_curve() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("loss.png");
        let losses = [4.16, 3.69, 3.27, 3.15];
        write_loss_png(&path, &losses, Some(1.89)).expect("plot");
        let bytes = std::fs::read(&path).expect("written");
        // Signature, then the IHDR chunk with the picture's size.
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        assert_eq!(&bytes[16..20], &WIDTH.to_be_bytes());
        assert_eq!(&bytes[20..24], &HEIGHT.to_be_bytes());
        // It decodes to exactly the pixels rendered.
        let mut reader = png::Decoder::new(std::io::Cursor::new(&bytes))
            .read_info()
            .expect("decodes");
        let mut decoded = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut decoded).expect("frame");
        assert_eq!((info.width, info.height), (WIDTH, HEIGHT));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let rendered = render(&losses, Some(1.89)).expect("render");
        assert_eq!(&decoded[..info.buffer_size()], &rendered[..]);
        // The curve is there, and so is the floor.
        assert!(curve_pixels(&rendered).len() > 500);
        assert!(
            rendered
                .chunks(3)
                .filter(|p| *p == [FLOOR_COLOR.0, FLOOR_COLOR.1, FLOOR_COLOR.2])
                .count()
                > 500
        );
    }

    #[test]
    fn different_losses_draw_different_curves() {
        let a = render(&[4.0, 3.5, 3.2], Some(1.9)).expect("a");
        let b = render(&[4.0, 3.0, 3.4], Some(1.9)).expect("b");
        let (ca, cb) = (curve_pixels(&a), curve_pixels(&b));
        assert!(!ca.is_empty() && !cb.is_empty());
        assert_ne!(ca, cb, "the curve does not follow the losses");
        // Same input, same picture.
        assert_eq!(a, render(&[4.0, 3.5, 3.2], Some(1.9)).expect("again"));
    }

    #[test]
    fn a_corpus_without_a_floor_draws_none() {
        let red = |buf: &[u8]| {
            buf.chunks_exact(3)
                .filter(|p| *p == [FLOOR_COLOR.0, FLOOR_COLOR.1, FLOOR_COLOR.2])
                .count()
        };
        assert_eq!(red(&render(&[4.0, 3.0], None).expect("none")), 0);
        assert!(red(&render(&[4.0, 3.0], Some(3.5)).expect("floor")) > 100);
    }

    #[test]
    fn refuses_what_it_cannot_plot() {
        assert!(render(&[], Some(1.0)).is_err());
        assert!(render(&[f32::NAN], Some(1.0)).is_err());
        // A single point (no epoch finished yet) still plots.
        assert!(render(&[4.0], Some(1.9)).is_ok());
    }
}
