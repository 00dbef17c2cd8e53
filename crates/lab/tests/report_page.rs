//! The report page in a real browser: Debian's Chromium, headless, opens
//! `index.html` from the disk (no server, no network), runs it, and hands back the DOM
//! it built. Every registered experiment's section must be there and every chart must
//! have loaded as an image.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lab::chart::{Bar, Lines, Series, StackedBars};
use lab::{site, Report, RunEnv};
use rig::tools;

/// A record for experiment `e` with one chart of each kind.
fn record(e: &lab::Experiment, k: usize) -> Report {
    let mut r = Report::new(e.id, e.title, e.paper);
    r.setup = format!("the set-up of {}", e.id);
    r.row("rates", "a rate", "Mpps", &[1.0, 2.0, 3.0 + k as f64]);
    r.check("a target", 2.0, "Mpps", "≥ 1", k.is_multiple_of(2));
    r.charts.push(StackedBars {
        name: "bars".into(),
        title: format!("{}: where the time goes", e.id),
        unit: "µs".into(),
        bars: vec![Bar {
            label: "a".into(),
            segments: vec![("copy".into(), 1.0), ("ring".into(), 2.0)],
        }],
    });
    r.lines.push(Lines {
        name: "lines".into(),
        title: format!("{}: against a setting", e.id),
        x_unit: "KiB".into(),
        unit: "µs".into(),
        series: vec![Series {
            label: "cost".into(),
            points: vec![(1.0, 2.0), (2.0, 3.0), (4.0, 3.5)],
        }],
    });
    r
}

/// Runs headless Chromium on `page` and returns the DOM it serialised once the page's
/// loads were done (its virtual time lets them finish before it dumps).
fn dump_dom(page: &Path, profile: &Path) -> String {
    let chromium = tools::which(tools::CHROMIUM.program).expect("chromium installed");
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=10000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromium starts");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish in 180 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("output");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The number in `attr="N"` on the body.
fn body_number(dom: &str, attr: &str) -> Option<usize> {
    let at = dom.find(&format!("{attr}=\""))? + attr.len() + 2;
    dom[at..].split('"').next()?.parse().ok()
}

#[test]
fn the_report_page_shows_every_experiment_and_its_charts_in_a_real_browser() {
    tools::ensure(&[tools::CHROMIUM, tools::FONTS]).expect("chromium and the font installed");
    let dir = std::env::temp_dir().join(format!("pvio-page-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let env = RunEnv::capture(&lab::Context::new(lab::Mode::Quick, lab::IdlePolicy::Poll));
    let experiments = lab::registry();
    for (k, e) in experiments.iter().enumerate() {
        let w = record(e, k).write(&dir, &env).expect("written");
        assert!(w.chart_errors.is_empty(), "{:?}", w.chart_errors);
    }
    let page = site::write_index(&dir).expect("index written");
    let dom = dump_dom(&page, &dir.join("profile"));
    assert!(
        dom.contains("</html>"),
        "the browser gave back a page: {dom:.300}"
    );
    for e in &experiments {
        assert!(
            dom.contains(&format!("id=\"exp-{}\"", e.id)),
            "{}'s section is on the page",
            e.id
        );
    }
    let n = experiments.len();
    assert_eq!(body_number(&dom, "data-experiments"), Some(n));
    // The page's own script counts the images once each has loaded or failed.
    assert_eq!(
        body_number(&dom, "data-charts-failed"),
        Some(0),
        "no chart failed"
    );
    assert_eq!(
        body_number(&dom, "data-charts-loaded"),
        Some(2 * n),
        "every chart loaded"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
