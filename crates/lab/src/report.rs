//! What an experiment produces: a table for people, a JSON record for machines, a
//! Markdown report for the repository.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chart::{Lines, StackedBars};
use crate::stats::Stats;

/// One measured quantity.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Section of the table.
    pub group: String,
    /// What was measured.
    pub name: String,
    /// Unit of the values.
    pub unit: String,
    /// Over the iterations.
    pub stats: Stats,
    /// Median of per-iteration ratios to a baseline row measured in the same run:
    /// (baseline name, ratio).
    #[serde(default, deserialize_with = "nan::ratio")]
    pub ratio: Option<(String, f64)>,
    /// What the paper (or the reference) says, as text.
    #[serde(default)]
    pub reference: Option<String>,
}

/// A target the experiment checks its own result against.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Check {
    /// The claim, e.g. "optimised grant copy 1500 B, batch 32 ≤ 3× memcpy".
    pub what: String,
    /// Measured value (a ratio or a percentage, as `unit` says).
    #[serde(deserialize_with = "nan::f64")]
    pub value: f64,
    /// Unit of `value` and `target`.
    pub unit: String,
    /// The target.
    pub target: String,
    /// Whether the measurement meets it.
    pub met: bool,
    /// A target of the paper's (or the issue's), or a check that the run was set up as
    /// it says: listed apart, so that neither stands for the other.
    #[serde(default)]
    pub kind: CheckKind,
}

/// What a [`Check`] judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    /// A target: the paper's figure, or what an issue asks of pvio.
    #[default]
    Target,
    /// The run's set-up did what it says (a workload outran a rate, a sender kept up):
    /// no claim about the mechanism.
    Setup,
}

/// An experiment's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Registry id.
    pub id: String,
    /// Title.
    pub title: String,
    /// Paper reference.
    pub paper: String,
    /// A short paragraph: what runs where.
    #[serde(default)]
    pub setup: String,
    /// Full configuration.
    #[serde(default)]
    pub config: serde_json::Value,
    /// Measurements.
    pub rows: Vec<Row>,
    /// Targets.
    pub checks: Vec<Check>,
    /// Observations worth keeping with the numbers.
    #[serde(default)]
    pub notes: Vec<String>,
    /// Stacked-bar charts of the breakdowns, written beside the report as PNG.
    #[serde(default)]
    pub charts: Vec<StackedBars>,
    /// Line charts, written beside the report as PNG.
    #[serde(default)]
    pub lines: Vec<Lines>,
    /// The idle policy its machines used, where the experiment chose its own rather
    /// than the run's (`pvio up` halt-polls, as do two hosts on one pair of cores);
    /// the records name it instead of the run's.
    #[serde(default)]
    pub idle: Option<String>,
    /// How much of the cores the host's other processes and the VM's hypervisor took
    /// while the record was taken (`pvio reproduce` measures it around each experiment).
    #[serde(default)]
    pub host: Option<crate::host::HostLoad>,
}

/// What [`Report::write`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// `<id>.json`.
    pub json: PathBuf,
    /// `<id>.md`.
    pub md: PathBuf,
    /// `<id>-<chart>.png`, one per chart drawn.
    pub charts: Vec<PathBuf>,
    /// Why a chart was not drawn.
    pub chart_errors: Vec<String>,
}

impl Report {
    /// Records `config`, the experiment's typed configuration, as the record's
    /// `config` (its fields by name).
    pub fn set_config(&mut self, config: &impl Serialize) {
        self.config = serde_json::to_value(config)
            .unwrap_or_else(|e| serde_json::json!({ "unrecorded": e.to_string() }));
    }

    /// An empty report.
    pub fn new(id: &str, title: &str, paper: &str) -> Self {
        Self {
            id: id.into(),
            title: title.into(),
            paper: paper.into(),
            setup: String::new(),
            config: serde_json::Value::Null,
            rows: Vec::new(),
            checks: Vec::new(),
            notes: Vec::new(),
            charts: Vec::new(),
            lines: Vec::new(),
            idle: None,
            host: None,
        }
    }

    /// Adds a row from raw samples.
    pub fn row(&mut self, group: &str, name: &str, unit: &str, samples: &[f64]) -> &mut Row {
        self.rows.push(Row {
            group: group.into(),
            name: name.into(),
            unit: unit.into(),
            stats: Stats::of(samples),
            ratio: None,
            reference: None,
        });
        let last = self.rows.len() - 1;
        &mut self.rows[last]
    }

    /// Adds a check of a target.
    pub fn check(&mut self, what: &str, value: f64, unit: &str, target: &str, met: bool) {
        self.checks.push(Check {
            what: what.into(),
            value,
            unit: unit.into(),
            target: target.into(),
            met,
            kind: CheckKind::Target,
        });
    }

    /// Adds a check of the run's set-up, listed apart from the targets.
    pub fn setup_check(&mut self, what: &str, value: f64, unit: &str, target: &str, met: bool) {
        self.check(what, value, unit, target, met);
        if let Some(c) = self.checks.last_mut() {
            c.kind = CheckKind::Setup;
        }
    }

    /// The checks of one kind.
    fn checks_of(&self, kind: CheckKind) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(move |c| c.kind == kind)
    }

    /// Adds a check that a count is zero.
    pub fn check_none(&mut self, what: &str, count: u64, unit: &str) {
        self.check(what, count as f64, unit, "= 0", count == 0);
    }

    /// The human table: columns sized to their contents.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "== {} — {} ({})", self.id, self.title, self.paper);
        if !self.setup.is_empty() {
            let _ = writeln!(out, "{}", self.setup);
        }
        let header = [
            "group",
            "measurement",
            "median",
            "min",
            "max",
            "p99",
            "unit",
            "ratio",
            "reference",
        ];
        let mut lines: Vec<[String; 9]> = vec![header.map(String::from)];
        for r in &self.rows {
            lines.push([
                r.group.clone(),
                r.name.clone(),
                fmt_num(r.stats.median),
                fmt_num(r.stats.min),
                fmt_num(r.stats.max),
                fmt_num(r.stats.p99),
                r.unit.clone(),
                r.ratio
                    .as_ref()
                    .map_or(String::new(), |(b, x)| format!("{x:.2}x {b}")),
                r.reference.clone().unwrap_or_default(),
            ]);
        }
        let widths: Vec<usize> = (0..9)
            .map(|c| {
                lines
                    .iter()
                    .map(|l| l[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for l in &lines {
            let cells: Vec<String> = l
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    let pad = widths[c] - s.chars().count();
                    // Numbers right-aligned, text left-aligned.
                    if (2..=5).contains(&c) {
                        format!("{}{s}", " ".repeat(pad))
                    } else {
                        format!("{s}{}", " ".repeat(pad))
                    }
                })
                .collect();
            let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        }
        for (kind, title) in [
            (CheckKind::Target, "targets:"),
            (CheckKind::Setup, "set-up checks:"),
        ] {
            if self.checks_of(kind).next().is_none() {
                continue;
            }
            let _ = writeln!(out, "{title}");
            for c in self.checks_of(kind) {
                let _ = writeln!(
                    out,
                    "  [{}] {}: {} {} (target {})",
                    if c.met { "met" } else { "MISSED" },
                    c.what,
                    fmt_num(c.value),
                    c.unit,
                    c.target
                );
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        out
    }

    /// The Markdown report.
    pub fn markdown(&self, env: &RunEnv) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# {}: {}\n", self.id, self.title);
        let _ = writeln!(md, "Paper: {}  ", self.paper);
        let _ = writeln!(
            md,
            "Revision `{}`, {} on {} ({}, {} cores; idle pCPUs: {}).\n",
            env.revision,
            env.date,
            env.host,
            env.cpu,
            env.cores,
            self.idle.as_deref().unwrap_or(&env.idle)
        );
        if let Some(h) = &self.host {
            let _ = writeln!(md, "{}\n", h.line());
        }
        if !self.setup.is_empty() {
            let _ = writeln!(md, "{}\n", self.setup);
        }
        let _ = writeln!(md, "| group | measurement | median | min | max | p99 | unit | ratio (same run) | reference |");
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.group,
                r.name,
                fmt_num(r.stats.median),
                fmt_num(r.stats.min),
                fmt_num(r.stats.max),
                fmt_num(r.stats.p99),
                r.unit,
                r.ratio
                    .as_ref()
                    .map_or(String::new(), |(b, x)| format!("{x:.2}× {b}")),
                r.reference.clone().unwrap_or_default()
            );
        }
        for (kind, title) in [
            (CheckKind::Target, "Targets"),
            (CheckKind::Setup, "Set-up checks"),
        ] {
            if self.checks_of(kind).next().is_none() {
                continue;
            }
            let _ = writeln!(md, "\n## {title}\n");
            for c in self.checks_of(kind) {
                let _ = writeln!(
                    md,
                    "- {} **{}**: {} {} (target {})",
                    if c.met { "✅" } else { "❌" },
                    c.what,
                    fmt_num(c.value),
                    c.unit,
                    c.target
                );
            }
        }
        if !self.notes.is_empty() {
            let _ = writeln!(md, "\n## Notes\n");
            for n in &self.notes {
                let _ = writeln!(md, "- {n}");
            }
        }
        md
    }

    /// The file a chart of this report is written to, beside its JSON.
    pub fn chart_file(&self, name: &str) -> String {
        format!("{}-{}.png", self.id, name)
    }

    /// Writes `<dir>/<id>.json`, `<dir>/<id>.md` and a PNG per chart.
    pub fn write(&self, dir: &Path, env: &RunEnv) -> std::io::Result<Written> {
        std::fs::create_dir_all(dir)?;
        let json = dir.join(format!("{}.json", self.id));
        let md = dir.join(format!("{}.md", self.id));
        let record = serde_json::json!({ "env": env, "experiment": self });
        std::fs::write(
            &json,
            serde_json::to_string_pretty(&record).map_err(std::io::Error::other)?,
        )?;
        let mut text = self.markdown(env);
        let (mut charts, mut chart_errors) = (Vec::new(), Vec::new());
        if !self.charts.is_empty() || !self.lines.is_empty() {
            // A fresh machine lacks the charts' font; a chart still not drawn says why.
            if let Err(e) = rig::tools::ensure(&[rig::tools::FONTS]) {
                chart_errors.push(e.to_string());
            }
        }
        let drawers = self
            .charts
            .iter()
            .map(|c| {
                (
                    &c.name,
                    &c.title,
                    Box::new(|p: &Path| c.render(p)) as Box<dyn Fn(&Path) -> _>,
                )
            })
            .chain(self.lines.iter().map(|c| {
                (
                    &c.name,
                    &c.title,
                    Box::new(|p: &Path| c.render(p)) as Box<dyn Fn(&Path) -> _>,
                )
            }));
        for (name, title, render) in drawers {
            let file = self.chart_file(name);
            let path = dir.join(&file);
            match render(&path) {
                Ok(()) => {
                    let _ = writeln!(text, "\n![{title}]({file})");
                    charts.push(path);
                }
                Err(e) => chart_errors.push(format!("{file}: {e}")),
            }
        }
        std::fs::write(&md, text)?;
        Ok(Written {
            json,
            md,
            charts,
            chart_errors,
        })
    }
}

/// Where and when a run happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunEnv {
    /// `git describe` of the source, or "unknown".
    pub revision: String,
    /// RFC 3339 UTC.
    pub date: String,
    /// Host name.
    pub host: String,
    /// CPU model.
    pub cpu: String,
    /// Cores available to the process.
    pub cores: usize,
    /// Kernel release.
    #[serde(default)]
    pub kernel: String,
    /// Quick mode.
    pub quick: bool,
    /// How the machines' idle pCPUs waited (the run's [`crate::Context`]).
    #[serde(default)]
    pub idle: String,
}

impl RunEnv {
    /// Reads the environment of this run, asked for as `cx`.
    pub fn capture(cx: &crate::Context) -> Self {
        let (quick, idle) = (cx.mode == crate::Mode::Quick, cx.idle);
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
        };
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let revision = std::process::Command::new("git")
            .args(["describe", "--always", "--dirty"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        Self {
            revision,
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            host: read("/proc/sys/kernel/hostname"),
            cpu,
            cores: mem::cpu::online_cores(),
            kernel: read("/proc/sys/kernel/osrelease"),
            quick,
            idle: idle.name(),
        }
    }
}

/// Reading records back: serde_json writes a NaN or an infinity as `null` (JSON has
/// neither), and a record read back takes `null` as NaN rather than refusing the record.
pub(crate) mod nan {
    use serde::{Deserialize, Deserializer};

    /// A number, or `null` as NaN.
    pub(crate) fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }

    /// A ratio to a named baseline, its number `null` as NaN.
    pub(crate) fn ratio<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<(String, f64)>, D::Error> {
        Ok(Option::<(String, Option<f64>)>::deserialize(d)?
            .map(|(base, x)| (base, x.unwrap_or(f64::NAN))))
    }

    /// Labelled numbers (a bar's segments), each `null` as NaN.
    pub(crate) fn labelled<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(String, f64)>, D::Error> {
        Ok(Vec::<(String, Option<f64>)>::deserialize(d)?
            .into_iter()
            .map(|(l, x)| (l, x.unwrap_or(f64::NAN)))
            .collect())
    }

    /// Points, each coordinate `null` as NaN.
    pub(crate) fn points<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(f64, f64)>, D::Error> {
        let nan = |x: Option<f64>| x.unwrap_or(f64::NAN);
        Ok(Vec::<(Option<f64>, Option<f64>)>::deserialize(d)?
            .into_iter()
            .map(|(x, y)| (nan(x), nan(y)))
            .collect())
    }
}

/// Formats a number with about four significant digits.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        format!("{:.3e}", v)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}
