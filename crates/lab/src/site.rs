//! The whole reproduction on one page, and what changed between two runs.
//!
//! `reproduce` leaves one JSON record per experiment in its results folder
//! ([`Report::write`]). This module reads a folder's records back ([`Folder::read`]) and
//! writes `index.html` beside them ([`write_index`]): the run's environment, every
//! experiment's checks with the paper's numbers beside pvio's, its table, its charts
//! and its notes, grouped by paper, with links to the JSON. The page is one file with
//! its style inline and the charts' PNGs beside it, so it opens from the disk with no
//! server and no network.
//!
//! [`compare`] takes two folders (a change's before and after) and lists every check
//! whose verdict changed or whose value moved, and every ratio to a same-run baseline
//! that moved, so that a change's effect on the whole reproduction is one page
//! (`compare.html`) or one terminal screen.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::report::{fmt_num, Check, CheckKind, Report, Row, RunEnv};

/// One experiment's record, as [`Report::write`] leaves it in `<id>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// Where and when it ran.
    pub env: RunEnv,
    /// What it measured.
    pub experiment: Report,
}

/// A results folder's records.
#[derive(Debug, Clone)]
pub struct Folder {
    /// The folder.
    pub dir: PathBuf,
    /// Its records, in the order `reproduce` runs the experiments (others after, by id).
    pub records: Vec<Record>,
    /// JSON files that are not records: (file name, why).
    pub unreadable: Vec<(String, String)>,
}

impl Folder {
    /// Reads every `*.json` record in `dir`.
    pub fn read(dir: &Path) -> std::io::Result<Self> {
        let mut records = Vec::new();
        let mut unreadable = Vec::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        for f in files {
            let name = f
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into());
            let parsed = std::fs::read_to_string(&f)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<Record>(&t).map_err(|e| e.to_string()));
            match parsed {
                Ok(r) => records.push(r),
                Err(why) => unreadable.push((name, why)),
            }
        }
        let order: Vec<&str> = crate::registry().iter().map(|e| e.id).collect();
        let rank = |id: &str| order.iter().position(|&o| o == id).unwrap_or(order.len());
        records.sort_by(|a, b| {
            let (a, b) = (&a.experiment.id, &b.experiment.id);
            rank(a).cmp(&rank(b)).then_with(|| a.cmp(b))
        });
        Ok(Self {
            dir: dir.to_path_buf(),
            records,
            unreadable,
        })
    }

    /// The environment of the newest record: the page's own.
    pub fn newest_env(&self) -> Option<&RunEnv> {
        self.records
            .iter()
            .map(|r| &r.env)
            .max_by(|a, b| a.date.cmp(&b.date))
    }

    fn get(&self, id: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.experiment.id == id)
    }
}

/// The papers the experiments reproduce, by the number their references start with;
/// the last takes every experiment of pvio's own (an issue's benchmark).
const PAPERS: [(&str, &str); 5] = [
    (
        "000",
        "Santos, Turner, Janakiraman, Pratt: Bridging the Gap between Software and \
         Hardware Techniques for I/O Virtualization (USENIX ATC 2008)",
    ),
    (
        "001",
        "Nakajima, Oi: Optimizations of Large Receive Offload in Xen",
    ),
    (
        "002",
        "Raj, Schwan: Virtualization Services: Accelerated I/O Support in Multi-Core Systems",
    ),
    (
        "004",
        "IOSUP (draft): Improving I/O Performance of All Peripheral Devices Using \
         Page-Table Cache",
    ),
    ("", "pvio's own benchmarks and robustness runs"),
];

/// Which of [`PAPERS`] an experiment's reference names.
fn paper_of(reference: &str) -> usize {
    PAPERS
        .iter()
        .position(|(key, _)| !key.is_empty() && reference.starts_with(key))
        .unwrap_or(PAPERS.len() - 1)
}

/// Text for HTML.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Targets met, of how many.
fn tally(checks: &[Check], kind: CheckKind) -> (usize, usize) {
    let of = checks.iter().filter(|c| c.kind == kind);
    (of.clone().filter(|c| c.met).count(), of.count())
}

fn env_line(env: &RunEnv, idle: Option<&str>) -> String {
    format!(
        "revision <code>{}</code>, {}, on {} ({}, {} cores, Linux {}); {} mode; idle pCPUs: {}",
        esc(&env.revision),
        esc(&env.date),
        esc(&env.host),
        esc(&env.cpu),
        env.cores,
        esc(&env.kernel),
        if env.quick { "quick" } else { "full" },
        esc(idle.unwrap_or(&env.idle)),
    )
}

const STYLE: &str = "
body{font:15px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header,main{max-width:76rem;margin:0 auto;padding:0 1.2rem}
header{padding-top:1rem}
h1{font-size:1.55rem;margin:.4rem 0}h2{font-size:1.2rem;margin:2rem 0 .6rem;border-bottom:2px solid #c9d1dc}
h3{font-size:1.05rem;margin:0 0 .2rem}
.env,.ref{color:#556;font-size:.88rem}
article{background:#fff;border:1px solid #dde2ea;border-radius:6px;padding:.9rem 1.1rem;margin:1rem 0}
table{border-collapse:collapse;font-size:.82rem;width:100%}
th,td{padding:.22rem .45rem;border-bottom:1px solid #e7ebf0;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th{background:#eef1f5;position:sticky;top:0}
.wrap{overflow-x:auto;max-height:32rem;margin:.6rem 0}
ul.checks{list-style:none;padding:0;margin:.5rem 0}
ul.checks li{padding:.15rem .4rem;margin:.1rem 0;border-left:4px solid;font-size:.9rem}
li.met{border-color:#2e8540;background:#f1f8f2}li.missed{border-color:#c0392b;background:#fcf1f0}
.mark{font-weight:600;margin-right:.35rem}
figure{margin:.6rem 0;display:inline-block;max-width:100%}
figure img{max-width:100%;height:auto;border:1px solid #e1e5eb}
figcaption{font-size:.82rem;color:#556}
.badge{display:inline-block;border-radius:3px;padding:0 .4rem;font-size:.8rem;color:#fff}
.ok{background:#2e8540}.some{background:#b9770e}.none{background:#c0392b}.na{background:#7f8c8d}
details{margin:.4rem 0;font-size:.9rem}summary{cursor:pointer;color:#334}
ul.notes{font-size:.88rem}
.moved-up{color:#2e8540}.moved-down{color:#c0392b}
";

/// Counts the charts that loaded and those that did not, for a reader's browser and
/// for the test that renders the page in one (`data-charts-loaded`, `-failed`).
const SCRIPT: &str = "(function(){var im=Array.prototype.slice.call(document.images),left=im.length,ok=0,bad=0;\
function done(){document.body.setAttribute('data-charts-loaded',ok);document.body.setAttribute('data-charts-failed',bad);}\
if(!left){done();return;}\
im.forEach(function(i){var seen=false;function f(){if(seen)return;seen=true;if(i.naturalWidth>0){ok++;}else{bad++;}if(--left===0){done();}}\
if(i.complete){f();}else{i.addEventListener('load',f);i.addEventListener('error',f);}});})();";

fn badge(met: usize, of: usize) -> String {
    let class = if of == 0 {
        "na"
    } else if met == of {
        "ok"
    } else if met == 0 {
        "none"
    } else {
        "some"
    };
    format!("<span class=\"badge {class}\">{met} of {of}</span>")
}

/// The summary at the top: one line per experiment, by paper.
fn summary(html: &mut String, f: &Folder) {
    let _ = writeln!(
        html,
        "<table class=\"summary\"><tr><th>experiment</th><th>paper</th>\
         <th>targets met</th><th>set-up checks</th><th>record</th></tr>"
    );
    for r in &f.records {
        let e = &r.experiment;
        let (tm, tn) = tally(&e.checks, CheckKind::Target);
        let (sm, sn) = tally(&e.checks, CheckKind::Setup);
        let _ = writeln!(
            html,
            "<tr><td><a href=\"#exp-{id}\">{id}</a>: {title}</td><td>{paper}</td>\
             <td>{}</td><td>{}</td><td><a href=\"{id}.json\">JSON</a></td></tr>",
            badge(tm, tn),
            badge(sm, sn),
            id = esc(&e.id),
            title = esc(&e.title),
            paper = esc(&e.paper),
        );
    }
    let _ = writeln!(html, "</table>");
}

fn checks_html(html: &mut String, e: &Report) {
    for (kind, title) in [
        (CheckKind::Target, "Targets"),
        (CheckKind::Setup, "Set-up checks"),
    ] {
        let mut of = e.checks.iter().filter(|c| c.kind == kind).peekable();
        if of.peek().is_none() {
            continue;
        }
        let _ = writeln!(html, "<h4>{title}</h4><ul class=\"checks\">");
        for c in of {
            let _ = writeln!(
                html,
                "<li class=\"{}\"><span class=\"mark\">{}</span>{}: <b>{} {}</b> \
                 (target {})</li>",
                if c.met { "met" } else { "missed" },
                if c.met { "met" } else { "missed" },
                esc(&c.what),
                esc(&fmt_num(c.value)),
                esc(&c.unit),
                esc(&c.target),
            );
        }
        let _ = writeln!(html, "</ul>");
    }
}

fn rows_html(html: &mut String, rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        html,
        "<div class=\"wrap\"><table><tr><th>group</th><th>measurement</th><th>median</th>\
         <th>min</th><th>max</th><th>p99</th><th>unit</th><th>ratio (same run)</th>\
         <th>paper / reference</th></tr>"
    );
    for r in rows {
        let s = &r.stats;
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&r.group),
            esc(&r.name),
            fmt_num(s.median),
            fmt_num(s.min),
            fmt_num(s.max),
            fmt_num(s.p99),
            esc(&r.unit),
            r.ratio
                .as_ref()
                .map_or(String::new(), |(b, x)| format!("{x:.2}× {}", esc(b))),
            esc(r.reference.as_deref().unwrap_or("")),
        );
    }
    let _ = writeln!(html, "</table></div>");
}

/// The charts listed in the record: each one drawn is shown, each one missing said so.
fn charts_html(html: &mut String, dir: &Path, e: &Report) {
    let charts = e.charts.iter().map(|c| (&c.name, &c.title));
    for (name, title) in charts.chain(e.lines.iter().map(|c| (&c.name, &c.title))) {
        let file = e.chart_file(name);
        if dir.join(&file).is_file() {
            let _ = writeln!(
                html,
                "<figure><img src=\"{f}\" alt=\"{t}\" width=\"900\"><figcaption>{t}</figcaption></figure>",
                f = esc(&file),
                t = esc(title),
            );
        } else {
            let _ = writeln!(
                html,
                "<p class=\"ref\">Chart “{}” was not drawn (no {}).</p>",
                esc(title),
                esc(&file)
            );
        }
    }
}

/// One experiment's section.
fn article(html: &mut String, f: &Folder, r: &Record, page: Option<&RunEnv>) {
    let e = &r.experiment;
    let (tm, tn) = tally(&e.checks, CheckKind::Target);
    let _ = writeln!(
        html,
        "<article class=\"experiment\" id=\"exp-{id}\" data-id=\"{id}\">\
         <h3>{id}: {title} {}</h3><p class=\"ref\">{paper}</p>",
        badge(tm, tn),
        id = esc(&e.id),
        title = esc(&e.title),
        paper = esc(&e.paper),
    );
    let differs = page.is_some_and(|p| p.revision != r.env.revision || p.quick != r.env.quick);
    if differs || e.idle.is_some() {
        let _ = writeln!(
            html,
            "<p class=\"env\">This record: {}</p>",
            env_line(&r.env, e.idle.as_deref())
        );
    }
    if let Some(h) = e.host.filter(|h| h.disturbed) {
        let _ = writeln!(
            html,
            "<p class=\"env disturbed\">Disturbed: other processes took {:.1}% of a core and \
             the hypervisor {:.1}% while this record was taken; its figures include that.</p>",
            100.0 * h.others_cores,
            100.0 * h.steal_cores
        );
    }
    checks_html(html, e);
    if !e.setup.is_empty() {
        let _ = writeln!(
            html,
            "<details><summary>What runs where</summary><p>{}</p></details>",
            esc(&e.setup)
        );
    }
    charts_html(html, &f.dir, e);
    rows_html(html, &e.rows);
    if !e.notes.is_empty() {
        let _ = writeln!(html, "<ul class=\"notes\">");
        for n in &e.notes {
            let _ = writeln!(html, "<li>{}</li>", esc(n));
        }
        let _ = writeln!(html, "</ul>");
    }
    let _ = writeln!(
        html,
        "<p class=\"ref\"><a href=\"{id}.json\">{id}.json</a> · <a href=\"{id}.md\">{id}.md</a></p></article>",
        id = esc(&e.id)
    );
}

/// The page over a folder's records.
pub fn index_html(f: &Folder) -> String {
    let page = f.newest_env();
    let mut html = String::new();
    let _ = writeln!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>pvio: the reproduction</title><style>{STYLE}</style></head>\
         <body data-experiments=\"{}\"><header><h1>pvio: the papers' figures, reproduced</h1>",
        f.records.len()
    );
    match page {
        Some(env) => {
            let _ = writeln!(html, "<p class=\"env\">{}</p>", env_line(env, None));
        }
        None => {
            let _ = writeln!(html, "<p class=\"env\">No records in this folder yet.</p>");
        }
    }
    let (met, of) = f.records.iter().fold((0, 0), |(m, n), r| {
        let (a, b) = tally(&r.experiment.checks, CheckKind::Target);
        (m + a, n + b)
    });
    let _ = writeln!(
        html,
        "<p>{} experiments; the papers' and issues' targets met: {}.</p></header><main>",
        f.records.len(),
        badge(met, of)
    );
    summary(&mut html, f);
    for (k, (key, title)) in PAPERS.iter().enumerate() {
        let of: Vec<&Record> = f
            .records
            .iter()
            .filter(|r| paper_of(&r.experiment.paper) == k)
            .collect();
        if of.is_empty() {
            continue;
        }
        let anchor = if key.is_empty() { "pvio" } else { key };
        let _ = writeln!(
            html,
            "<section class=\"paper\" id=\"paper-{anchor}\"><h2>{}</h2>",
            esc(title)
        );
        for r in of {
            article(&mut html, f, r, page);
        }
        let _ = writeln!(html, "</section>");
    }
    if !f.unreadable.is_empty() {
        let _ = writeln!(html, "<h2>Files that are not records</h2><ul>");
        for (name, why) in &f.unreadable {
            let _ = writeln!(html, "<li><code>{}</code>: {}</li>", esc(name), esc(why));
        }
        let _ = writeln!(html, "</ul>");
    }
    let _ = writeln!(html, "</main><script>{SCRIPT}</script></body></html>");
    html
}

/// Writes `<dir>/index.html` over the records in `dir`; returns its path.
pub fn write_index(dir: &Path) -> std::io::Result<PathBuf> {
    let f = Folder::read(dir)?;
    let path = dir.join("index.html");
    std::fs::write(&path, index_html(&f))?;
    Ok(path)
}

/// How a result moved between two runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Moved {
    /// A check met in one run and missed in the other.
    Verdict,
    /// A check's value moved by more than the threshold, its verdict the same.
    Value,
    /// A row's ratio to its same-run baseline moved by more than the threshold.
    Ratio,
    /// In the new run only.
    Added,
    /// In the old run only.
    Removed,
}

/// One result that moved.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// How.
    pub moved: Moved,
    /// The experiment's id.
    pub experiment: String,
    /// The check's claim, or the row's group and name.
    pub what: String,
    /// Before and after (a check's value, a row's ratio).
    pub old: Option<f64>,
    /// After.
    pub new: Option<f64>,
    /// Their unit (a row's: "× `<baseline>`").
    pub unit: String,
    /// A check's verdict before and after.
    pub met: (Option<bool>, Option<bool>),
}

impl Change {
    /// The relative move, new over old less one (`None` where either is missing or old
    /// is zero).
    pub fn relative(&self) -> Option<f64> {
        match (self.old, self.new) {
            (Some(o), Some(n)) if o != 0.0 => Some(n / o - 1.0),
            _ => None,
        }
    }
}

fn moved_by(old: f64, new: f64, threshold: f64) -> bool {
    if old == 0.0 {
        new != 0.0
    } else {
        ((new - old) / old).abs() > threshold
    }
}

/// Every check whose verdict changed or whose value moved by more than `threshold` (a
/// fraction: 0.1 is 10%), every row ratio that moved as far, and every check and
/// experiment in one run only; in the new run's order.
pub fn compare(old: &Folder, new: &Folder, threshold: f64) -> Vec<Change> {
    let mut out = Vec::new();
    for n in &new.records {
        let id = &n.experiment.id;
        match old.get(id) {
            Some(o) => compare_one(&o.experiment, &n.experiment, threshold, &mut out),
            None => out.push(whole(Moved::Added, id)),
        }
    }
    for o in old
        .records
        .iter()
        .filter(|o| new.get(&o.experiment.id).is_none())
    {
        out.push(whole(Moved::Removed, &o.experiment.id));
    }
    out
}

fn whole(moved: Moved, id: &str) -> Change {
    Change {
        moved,
        experiment: id.into(),
        what: "the whole experiment".into(),
        old: None,
        new: None,
        unit: String::new(),
        met: (None, None),
    }
}

/// A check's claim without what it measured: the parenthesised parts that hold numbers
/// ("cheaper in 4 of 5 rounds, p = 0.031") dropped, so that the same claim matches
/// across runs whose measurements differ.
fn claim(what: &str) -> String {
    let mut out = String::with_capacity(what.len());
    let mut rest = what;
    while let Some(open) = rest.find(" (") {
        let Some(len) = rest[open..].find(')') else {
            break;
        };
        let group = &rest[open..open + len + 1];
        out.push_str(&rest[..open]);
        if !group.chars().any(|c| c.is_ascii_digit()) {
            out.push_str(group);
        }
        rest = &rest[open + len + 1..];
    }
    out.push_str(rest);
    out
}

/// The old run's check that `c` is: the same text, or else the one check of the same
/// claim.
fn counterpart<'a>(c: &Check, old: &'a [Check]) -> Option<&'a Check> {
    old.iter().find(|o| o.what == c.what).or_else(|| {
        let key = claim(&c.what);
        let mut same = old.iter().filter(|o| claim(&o.what) == key);
        match (same.next(), same.next()) {
            (Some(one), None) => Some(one),
            _ => None,
        }
    })
}

fn compare_one(o: &Report, n: &Report, threshold: f64, out: &mut Vec<Change>) {
    for c in &n.checks {
        let prev = counterpart(c, &o.checks);
        let moved = match prev {
            None => Some(Moved::Added),
            Some(p) if p.met != c.met => Some(Moved::Verdict),
            Some(p) if moved_by(p.value, c.value, threshold) => Some(Moved::Value),
            Some(_) => None,
        };
        if let Some(moved) = moved {
            out.push(Change {
                moved,
                experiment: n.id.clone(),
                what: c.what.clone(),
                old: prev.map(|p| p.value),
                new: Some(c.value),
                unit: c.unit.clone(),
                met: (prev.map(|p| p.met), Some(c.met)),
            });
        }
    }
    let matched: Vec<&Check> = n
        .checks
        .iter()
        .filter_map(|c| counterpart(c, &o.checks))
        .collect();
    for c in o
        .checks
        .iter()
        .filter(|c| !matched.iter().any(|m| std::ptr::eq(*m, *c)))
    {
        out.push(Change {
            moved: Moved::Removed,
            experiment: n.id.clone(),
            what: c.what.clone(),
            old: Some(c.value),
            new: None,
            unit: c.unit.clone(),
            met: (Some(c.met), None),
        });
    }
    let key = |r: &Row| format!("{}: {}", r.group, r.name);
    let old_ratios: BTreeMap<String, f64> = o
        .rows
        .iter()
        .filter_map(|r| r.ratio.as_ref().map(|(_, x)| (key(r), *x)))
        .collect();
    for r in &n.rows {
        let (Some((base, x)), Some(&p)) = (&r.ratio, old_ratios.get(&key(r))) else {
            continue;
        };
        if moved_by(p, *x, threshold) {
            out.push(Change {
                moved: Moved::Ratio,
                experiment: n.id.clone(),
                what: key(r),
                old: Some(p),
                new: Some(*x),
                unit: format!("× {base}"),
                met: (None, None),
            });
        }
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "",
    }
}

fn value(v: Option<f64>) -> String {
    v.map_or("—".into(), fmt_num)
}

fn moved_name(m: Moved) -> &'static str {
    match m {
        Moved::Verdict => "verdict changed",
        Moved::Value => "value moved",
        Moved::Ratio => "ratio moved",
        Moved::Added => "new",
        Moved::Removed => "gone",
    }
}

/// The comparison for a terminal.
pub fn compare_text(old: &Folder, new: &Folder, changes: &[Change], threshold: f64) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{} → {}: {} results moved (verdicts, and values or ratios by more than {:.0}%)",
        old.dir.display(),
        new.dir.display(),
        changes.len(),
        threshold * 100.0
    );
    for (f, (name, why)) in [old, new]
        .iter()
        .flat_map(|f| f.unreadable.iter().map(move |u| (f, u)))
    {
        let _ = writeln!(t, "  not read: {}/{name}: {why}", f.dir.display());
    }
    for c in changes {
        let _ = writeln!(
            t,
            "  {:<16} {:<15} {}: {} → {} {}{}",
            c.experiment,
            moved_name(c.moved),
            c.what,
            value(c.old),
            value(c.new),
            c.unit,
            match c.met {
                (Some(a), Some(b)) if a != b =>
                    format!(" ({} → {})", verdict(Some(a)), verdict(Some(b))),
                _ => String::new(),
            }
        );
    }
    t
}

/// The comparison as a page.
pub fn compare_html(old: &Folder, new: &Folder, changes: &[Change], threshold: f64) -> String {
    let mut html = String::new();
    let _ = writeln!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>pvio: what moved</title><style>{STYLE}</style></head><body><header>\
         <h1>What moved between two runs</h1>"
    );
    for (label, f) in [("Before", old), ("After", new)] {
        let env = f
            .newest_env()
            .map_or("no records".into(), |e| env_line(e, None));
        let _ = writeln!(
            html,
            "<p class=\"env\">{label}: <code>{}</code>, {env}</p>",
            esc(&f.dir.display().to_string())
        );
    }
    let _ = writeln!(
        html,
        "<p>{} results moved: every verdict that changed, and every value or same-run ratio \
         that moved by more than {:.0}%.</p></header><main><div class=\"wrap\"><table>\
         <tr><th>experiment</th><th>how</th><th>what</th><th>before</th><th>after</th>\
         <th>change</th><th>unit</th><th>verdict</th></tr>",
        changes.len(),
        threshold * 100.0
    );
    for c in changes {
        let rel = c.relative().map_or(String::new(), |r| {
            let class = if r >= 0.0 { "moved-up" } else { "moved-down" };
            format!("<span class=\"{class}\">{:+.1}%</span>", r * 100.0)
        });
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{rel}</td><td>{}</td><td>{} → {}</td></tr>",
            esc(&c.experiment),
            moved_name(c.moved),
            esc(&c.what),
            value(c.old),
            value(c.new),
            esc(&c.unit),
            verdict(c.met.0),
            verdict(c.met.1),
        );
    }
    let _ = writeln!(html, "</table></div></main></body></html>");
    html
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str, paper: &str, value: f64, met: bool, ratio: f64) -> Report {
        let mut r = Report::new(id, &format!("title of {id}"), paper);
        r.setup = "what runs where <with markup>".into();
        r.row("g", "rate", "Mpps", &[1.0, 2.0, 3.0]).ratio = Some(("base".into(), ratio));
        r.check("rate ≥ 2", value, "Mpps", "≥ 2", met);
        r.setup_check("the sender kept up", 1.0, "", "= 1", true);
        r.notes.push("a note & its reason".into());
        r
    }

    fn folder(dir: &Path, reports: &[Report], revision: &str) -> Folder {
        std::fs::create_dir_all(dir).expect("dir");
        let mut env = RunEnv::capture(&crate::Context::new(
            crate::Mode::Quick,
            crate::IdlePolicy::Poll,
        ));
        env.revision = revision.into();
        for r in reports {
            r.write(dir, &env).expect("write");
        }
        Folder::read(dir).expect("read")
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pvio-site-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A folder's records come back whole and in `reproduce`'s order, files that are
    /// not records are listed rather than dropped silently, and the page has a section
    /// per experiment under its paper, its checks' verdicts, and its text escaped.
    #[test]
    fn the_page_has_every_record_under_its_paper_with_its_checks() {
        let dir = scratch("index");
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("stray.json"), "{\"not\": \"a record\"}").expect("stray");
        let f = folder(
            &dir,
            &[
                report(
                    "santos08-fig8",
                    "000 Santos et al. 2008, Fig. 8",
                    1.0,
                    false,
                    0.5,
                ),
                {
                    let mut core = report("core", "issue 2", 3.0, true, 1.0);
                    core.check("not measured", f64::NAN, "×", "≤ 1", false);
                    core
                },
            ],
            "abc123",
        );
        let ids: Vec<&str> = f.records.iter().map(|r| r.experiment.id.as_str()).collect();
        // A NaN check value (written as null) reads back as NaN, not as an unreadable file.
        let nan = f.records[0]
            .experiment
            .checks
            .iter()
            .find(|c| c.what == "not measured");
        assert!(nan.is_some_and(|c| c.value.is_nan()));
        assert_eq!(ids, ["core", "santos08-fig8"], "the registry's order");
        assert_eq!(f.unreadable.len(), 1);
        assert_eq!(f.records[1].experiment.checks[0].kind, CheckKind::Target);
        let html = index_html(&f);
        for needle in [
            "id=\"exp-core\"",
            "id=\"exp-santos08-fig8\"",
            "id=\"paper-000\"",
            "id=\"paper-pvio\"",
            "<li class=\"missed\">",
            "<li class=\"met\">",
            "what runs where &lt;with markup&gt;",
            "a note &amp; its reason",
            "<code>abc123</code>",
            "stray.json",
            "href=\"core.json\"",
        ] {
            assert!(html.contains(needle), "{needle} missing");
        }
        let paper = html.find("id=\"paper-000\"").expect("000");
        let own = html.find("id=\"paper-pvio\"").expect("own");
        assert!(paper < own, "the papers first, pvio's own after");
        assert!(html.find("id=\"exp-santos08-fig8\"").expect("fig8") > paper);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Between two runs: a verdict that flipped, a value and a ratio that moved past
    /// the threshold, and checks and experiments in one run only are each listed once;
    /// what moved less than the threshold is not.
    #[test]
    fn a_comparison_lists_what_moved_and_nothing_that_did_not() {
        let (a, b) = (scratch("old"), scratch("new"));
        let mut gone = report("iosup", "004 Fig. 5", 1.0, true, 1.0);
        gone.check("only before", 1.0, "", "= 1", true);
        // The same claim, its measured part different: matched, not new and gone.
        gone.check("steady (in 4 of 5 rounds)", 1.0, "", "= 1", true);
        let mut same = report("iosup", "004 Fig. 5", 1.0, true, 1.0);
        same.check("steady (in 5 of 5 rounds)", 1.0, "", "= 1", true);
        let old = folder(
            &a,
            &[
                report("core", "issue 2", 3.0, true, 1.0),
                gone.clone(),
                report("santos08-fig8", "000", 2.0, true, 1.0),
                report("soak", "issue 15", 1.0, true, 1.0),
            ],
            "old",
        );
        let mut added = report("up", "issue 16", 1.0, true, 1.0);
        added.rows.clear();
        let new = folder(
            &b,
            &[
                // Verdict flipped.
                report("core", "issue 2", 1.5, false, 1.0),
                // Its extra check gone; nothing else moved.
                same,
                // Value up 50% and ratio down 40%, verdict the same.
                report("santos08-fig8", "000", 3.0, true, 0.6),
                // Moved 5%: under a 10% threshold.
                report("soak", "issue 15", 1.05, true, 1.04),
                added,
            ],
            "new",
        );
        assert_eq!(
            claim("1500 B: pv cheaper (in 4 of 5 rounds, p = 0.031) on (poll), median"),
            "1500 B: pv cheaper on (poll), median"
        );
        let got = compare(&old, &new, 0.1);
        let seen: Vec<(Moved, &str, &str)> = got
            .iter()
            .map(|c| (c.moved, c.experiment.as_str(), c.what.as_str()))
            .collect();
        assert_eq!(
            seen,
            [
                (Moved::Verdict, "core", "rate ≥ 2"),
                (Moved::Value, "santos08-fig8", "rate ≥ 2"),
                (Moved::Ratio, "santos08-fig8", "g: rate"),
                (Moved::Added, "up", "the whole experiment"),
                (Moved::Removed, "iosup", "only before"),
            ]
        );
        assert_eq!(got[0].met, (Some(true), Some(false)));
        assert!((got[2].relative().expect("rel") + 0.4).abs() < 1e-9);
        let text = compare_text(&old, &new, &got, 0.1);
        assert!(text.contains("met → missed"), "{text}");
        let html = compare_html(&old, &new, &got, 0.1);
        assert_eq!(html.matches("<tr><td>").count(), got.len());
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }
}
