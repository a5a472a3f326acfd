//! `lightpath plot FILE.jsonl... -o OUT.svg`: draws the JSON lines of `lightpath perf --json`
//! runs (or of `scripts/compare.sh`'s `target/compare.jsonl`) as one SVG chart: message size
//! across, latency (median, µs), bandwidth (MB/s) or request rate (stream_rr) up, both axes
//! logarithmic, one line per provider and mode. So a sweep over soft beside the same sweep over
//! TCP is three commands:
//!
//! ```text
//! lightpath perf stream_lat 127.0.0.1 --all --json > soft.jsonl       # against a soft server
//! lightpath perf stream_lat 127.0.0.1 --all --json --provider tcp > tcp.jsonl
//! lightpath plot soft.jsonl tcp.jsonl -o stream_lat.svg
//! ```
//!
//! A series is named after the provider, plus `busy` for busy-polled runs, `loop` for an
//! event-loop server, `xN` for N connections and the place (`netns`) when the lines come from
//! more than one. Several lines for one series and size (rounds) are drawn as their median.
//! Only the SVG backend of `plotters` is used: text is written as SVG `<text>`, so no font
//! files are read.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;

/// Options of `lightpath plot`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// JSON-lines files from `lightpath perf ... --json` or `scripts/compare.sh` (`-` for
    /// standard input).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The SVG file to write.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// The test to draw (needed when the files hold several).
    #[arg(long)]
    pub test: Option<String>,
    /// Only lines measured here (`loopback` or `netns`, as compare.sh tags them).
    #[arg(long = "where", value_name = "PLACE")]
    pub place: Option<String>,
    /// Chart title (default: the test's name and what is drawn).
    #[arg(long)]
    pub title: Option<String>,
}

/// One measured point.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub test: String,
    pub series: String,
    pub place: Option<String>,
    pub size: u64,
    pub value: f64,
}

/// Reads one JSON line; `Ok(None)` for a blank line.
pub fn parse_line(line: &str) -> Result<Option<Point>> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    let r: serde_json::Value = serde_json::from_str(line).context("not JSON")?;
    let test = r["test"].as_str().ok_or_else(|| anyhow!("no \"test\" field"))?.to_string();
    let size = r["size"].as_u64().ok_or_else(|| anyhow!("no \"size\" field"))?;
    let provider = r["provider"].as_str().ok_or_else(|| anyhow!("no \"provider\" field"))?;
    let value = if test == "stream_rr" {
        r["msg_rate_mpps"].as_f64().map(|mpps| mpps * 1e3)
    } else if let Some(median) = r["lat_us"]["median"].as_f64() {
        Some(median)
    } else {
        r["bw_mb_s"].as_f64()
    }
    .ok_or_else(|| anyhow!("no latency, bandwidth or rate in the line"))?;
    let mut series = provider.to_string();
    if r["polling"].as_bool() == Some(true) {
        series.push_str(" busy");
    }
    if r["server"].as_str() == Some("loop") {
        series.push_str(" loop");
    }
    if let Some(conns) = r["conns"].as_u64().filter(|&c| c > 1) {
        series.push_str(&format!(" x{conns}"));
    }
    let place = r["where"].as_str().map(str::to_string);
    Ok(Some(Point { test, series, place, size, value }))
}

/// What the y axis shows for `test`.
fn y_description(test: &str) -> &'static str {
    if test == "stream_rr" {
        "requests per second [thousands]"
    } else if test.ends_with("_lat") {
        "latency, median [us]"
    } else {
        "bandwidth [MB/s]"
    }
}

fn human_size(size: u64) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// The series of one test: name → (size → median value).
pub type Series = BTreeMap<String, BTreeMap<u64, f64>>;

/// Picks the test to draw and gathers its series.
pub fn select(points: &[Point], test: Option<&str>, place: Option<&str>) -> Result<(String, Series)> {
    let points: Vec<&Point> = points
        .iter()
        .filter(|p| place.is_none_or(|want| p.place.as_deref().unwrap_or("loopback") == want))
        .collect();
    let mut tests: Vec<&str> = points.iter().map(|p| p.test.as_str()).collect();
    tests.sort_unstable();
    tests.dedup();
    let test = match (test, tests.as_slice()) {
        (Some(want), _) if tests.contains(&want) => want.to_string(),
        (Some(want), _) => bail!("no {want} lines in the input (it has: {})", list(&tests)),
        (None, [only]) => only.to_string(),
        (None, []) => bail!("the input has no results"),
        (None, many) => bail!("the input has several tests ({}); choose one with --test", list(many)),
    };
    let places = {
        let mut places: Vec<&str> = points
            .iter()
            .filter(|p| p.test == test)
            .map(|p| p.place.as_deref().unwrap_or("loopback"))
            .collect();
        places.sort_unstable();
        places.dedup();
        places.len()
    };
    let mut gathered: BTreeMap<String, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    for p in points.iter().filter(|p| p.test == test) {
        let mut name = p.series.clone();
        if places > 1 {
            name = format!("{name} ({})", p.place.as_deref().unwrap_or("loopback"));
        }
        gathered.entry(name).or_default().entry(p.size).or_default().push(p.value);
    }
    let series = gathered
        .into_iter()
        .map(|(name, by_size)| {
            let medians = by_size
                .into_iter()
                .map(|(size, mut values)| {
                    values.sort_by(f64::total_cmp);
                    (size, values[values.len() / 2])
                })
                .collect();
            (name, medians)
        })
        .collect();
    Ok((test, series))
}

fn list(names: &[&str]) -> String {
    names.join(", ")
}

/// Width of the legend column, in pixels.
const LEGEND_WIDTH: u32 = 220;

/// Line colours, distinct on white.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
    RGBColor(90, 90, 90),
];

/// Draws `series` of `test` into an SVG document.
pub fn render(test: &str, series: &Series, title: Option<&str>) -> Result<String> {
    let sizes = series.values().flat_map(|s| s.keys().copied());
    let (mut x_min, mut x_max) = sizes.fold((u64::MAX, 0), |(lo, hi), s| (lo.min(s), hi.max(s)));
    let values = series.values().flat_map(|s| s.values().copied()).filter(|v| *v > 0.0);
    let (y_min, y_max) = values.fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if x_max == 0 || y_max <= 0.0 {
        bail!("nothing to draw: no positive values");
    }
    if x_min == x_max {
        x_min = (x_min / 2).max(1);
        x_max *= 2;
    }
    // Across: log2 of the size on a linear axis, so ticks fall on powers of two.
    let (x_min, x_max) = ((x_min as f64).log2() - 0.3, (x_max as f64).log2() + 0.3);
    let (y_min, y_max) = (y_min / 1.5, y_max * 1.5);
    let title = title.map_or_else(|| format!("{test}: {}", y_description(test)), str::to_string);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 600)).into_drawing_area();
        let draw_err = |err: &dyn std::fmt::Display| anyhow!("drawing the chart: {err}");
        root.fill(&WHITE).map_err(|e| draw_err(&e))?;
        // The legend goes in a column of its own on the right, clear of the lines.
        let (plot_area, legend_area) = root.split_horizontally(1100 - LEGEND_WIDTH);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(&title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80)
            .build_cartesian_2d(x_min..x_max, (y_min..y_max).log_scale())
            .map_err(|e| draw_err(&e))?;
        chart
            .configure_mesh()
            .x_desc("message size")
            .y_desc(y_description(test))
            .x_labels(12)
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 && *x >= 0.0 {
                    human_size(1u64 << (x.round() as u32).min(62))
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| match *v {
                v if v >= 10.0 => format!("{v:.0}"),
                v if v >= 1.0 => format!("{v:.1}"),
                v => format!("{v:.2}"),
            })
            .draw()
            .map_err(|e| draw_err(&e))?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()].to_rgba();
            // Past the palette, lines repeat its colours dashed.
            let dashed = i >= COLORS.len();
            let line: Vec<(f64, f64)> =
                points.iter().map(|(s, v)| ((*s as f64).log2(), *v)).filter(|(_, v)| *v > 0.0).collect();
            if dashed {
                chart
                    .draw_series(DashedLineSeries::new(line.clone(), 8, 5, color.stroke_width(2)))
                    .map_err(|e| draw_err(&e))?;
            } else {
                chart
                    .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                    .map_err(|e| draw_err(&e))?;
            }
            chart
                .draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|e| draw_err(&e))?;
            let y = 60 + 22 * i as i32;
            let marks: &[(i32, i32)] = if dashed { &[(10, 18), (24, 34)] } else { &[(10, 34)] };
            for &(from, to) in marks {
                let mark = PathElement::new(vec![(from, y), (to, y)], color.stroke_width(2));
                legend_area.draw(&mark).map_err(|e| draw_err(&e))?;
            }
            legend_area
                .draw(&Text::new(name.as_str(), (42, y - 7), ("sans-serif", 14)))
                .map_err(|e| draw_err(&e))?;
        }
        root.present().map_err(|e| draw_err(&e))?;
    }
    Ok(svg)
}

/// Reads every file's points.
fn read_points(files: &[PathBuf]) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for file in files {
        let reader: Box<dyn BufRead> = if file.as_os_str() == "-" {
            Box::new(BufReader::new(std::io::stdin()))
        } else {
            Box::new(BufReader::new(
                std::fs::File::open(file).with_context(|| format!("cannot open {}", file.display()))?,
            ))
        };
        for (n, line) in reader.lines().enumerate() {
            let line = line.with_context(|| format!("cannot read {}", file.display()))?;
            let point = parse_line(&line).with_context(|| {
                format!("{}:{}: not a `lightpath perf --json` result line", file.display(), n + 1)
            })?;
            points.extend(point);
        }
    }
    Ok(points)
}

/// Runs `lightpath plot`.
pub fn run(args: Args) -> Result<ExitCode> {
    let points = read_points(&args.files)?;
    let (test, series) = select(&points, args.test.as_deref(), args.place.as_deref())?;
    let svg = render(&test, &series, args.title.as_deref())?;
    std::fs::write(&args.output, svg).with_context(|| format!("cannot write {}", args.output.display()))?;
    let names: Vec<&str> = series.keys().map(String::as_str).collect();
    eprintln!(
        "lightpath plot: {test}, {} series ({}) -> {}",
        series.len(),
        names.join(", "),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lat_line(provider: &str, size: u64, median: f64, polling: bool) -> String {
        format!(
            r#"{{"test":"stream_lat","provider":"{provider}","size":{size},"iters":10,"conns":1,"server":"threads","polling":{polling},"lat_us":{{"min":1.0,"median":{median},"p99":9.0,"max":9.0,"avg":2.0}},"verified":true}}"#
        )
    }

    #[test]
    fn lines_become_named_points() {
        let p = parse_line(&lat_line("soft", 64, 3.5, true)).unwrap().unwrap();
        assert_eq!(
            (p.test.as_str(), p.series.as_str(), p.size, p.value),
            ("stream_lat", "soft busy", 64, 3.5)
        );
        let rr = r#"{"row":"stream_rr x16 (loop)","where":"netns","test":"stream_rr","provider":"tcp","size":64,"conns":16,"server":"loop","polling":false,"msg_rate_mpps":0.05}"#;
        let p = parse_line(rr).unwrap().unwrap();
        assert_eq!(p.series, "tcp loop x16");
        assert_eq!(p.place.as_deref(), Some("netns"));
        assert!((p.value - 50.0).abs() < 1e-9);
        let bw = r#"{"test":"write_bw","provider":"soft","size":65536,"iters":5,"bw_mb_s":1234.5,"verified":true}"#;
        assert_eq!(parse_line(bw).unwrap().unwrap().value, 1234.5);
        assert_eq!(parse_line("  ").unwrap(), None);
        assert!(parse_line("# stream_lat over soft").is_err());
        assert!(parse_line(r#"{"test":"send_lat","provider":"soft","size":8}"#).is_err());
    }

    #[test]
    fn selection_needs_one_test_and_takes_medians() {
        let mut points: Vec<Point> = [
            lat_line("soft", 8, 3.0, false),
            lat_line("soft", 8, 5.0, false),
            lat_line("soft", 8, 4.0, false),
            lat_line("tcp", 8, 6.0, false),
        ]
        .iter()
        .map(|l| parse_line(l).unwrap().unwrap())
        .collect();
        let (test, series) = select(&points, None, None).unwrap();
        assert_eq!(test, "stream_lat");
        assert_eq!(series["soft"][&8], 4.0);
        assert_eq!(series["tcp"][&8], 6.0);
        points.push(Point {
            test: "write_bw".into(),
            series: "soft".into(),
            place: None,
            size: 8,
            value: 1.0,
        });
        let err = select(&points, None, None).unwrap_err().to_string();
        assert!(err.contains("--test") && err.contains("write_bw"), "{err}");
        assert_eq!(select(&points, Some("write_bw"), None).unwrap().1.len(), 1);
        assert!(select(&points, Some("read_lat"), None).unwrap_err().to_string().contains("no read_lat"));
        assert!(select(&[], None, None).is_err());
    }

    #[test]
    fn the_svg_holds_every_series() {
        let lines: Vec<String> = [2u64, 64, 4096, 1 << 20]
            .iter()
            .flat_map(|&size| {
                let s = size as f64;
                [lat_line("soft", size, 3.0 + s / 1e4, false), lat_line("tcp", size, 5.0 + s / 2e4, false)]
            })
            .chain([lat_line("shm", 64, 0.6, true)])
            .collect();
        let points: Vec<Point> = lines.iter().map(|l| parse_line(l).unwrap().unwrap()).collect();
        let (test, series) = select(&points, None, None).unwrap();
        let svg = render(&test, &series, None).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        // Text is written as <text> elements, one line each: the legend, the title, the axes.
        let texts: Vec<&str> = svg.lines().filter(|l| !l.starts_with('<')).collect();
        for name in
            ["soft", "tcp", "shm busy", "stream_lat: latency, median [us]", "message size", "1 MiB", "4 KiB"]
        {
            assert!(texts.contains(&name), "no text {name:?} in the SVG: {texts:?}");
        }
        // Each series: its line and its legend mark (2 px wide; the axes are 1 px), and a
        // circle per point.
        assert_eq!(svg.matches(r#"stroke-width="2""#).count(), 2 * 3, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 4 + 4 + 1, "{svg}");
    }
}
