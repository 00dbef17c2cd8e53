//! Where a running experiment is: on a terminal, one line under `pvio reproduce` and
//! `pvio bench` naming the experiment, the configuration and round under way, the
//! steps done of those planned, and an estimate of the time left; nothing at all when
//! standard error is not a terminal (a log file, CI).
//!
//! An experiment is a plain `fn(&Context)`, so the line is the calling thread's: the
//! runner opens it with [`experiment`], the experiment says how many steps it will
//! take with [`plan`] and names each as it starts with [`step`]. An experiment run
//! with no line open (a test) reports into nothing.

use std::cell::RefCell;
use std::fmt::Display;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{HumanDuration, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// The open line of this thread and the steps begun on it.
struct Line {
    bar: ProgressBar,
    begun: u64,
}

thread_local! {
    static LINE: RefCell<Option<Line>> = const { RefCell::new(None) };
}

/// The open line; closed (and wiped from the terminal) when dropped.
#[derive(Debug)]
pub struct Open(());

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(l) = LINE.with(|l| l.borrow_mut().take()) {
            l.bar.finish_and_clear();
        }
    }
}

/// Where the line is drawn: standard error if it is a terminal, else nowhere.
pub fn target(stderr_is_terminal: bool) -> ProgressDrawTarget {
    if stderr_is_terminal {
        ProgressDrawTarget::stderr_with_hz(4)
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// Opens this thread's line for experiment `id`, the `index`-th (from 1) of `count`,
/// on standard error if it is a terminal.
pub fn experiment(id: &str, index: usize, count: usize) -> Open {
    experiment_to(target(std::io::stderr().is_terminal()), id, index, count)
}

/// Opens this thread's line on `to`.
pub fn experiment_to(to: ProgressDrawTarget, id: &str, index: usize, count: usize) -> Open {
    let bar = ProgressBar::with_draw_target(None, to);
    // The template is a constant; a bad one would be a bug caught by the tests.
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix} {elapsed:>4} [{bar:20}] {pos}/{len} · {msg} · {left}",
    ) {
        bar.set_style(style.progress_chars("=> ").with_key("left", left));
    }
    bar.set_message("starting");
    bar.set_prefix(format!("{id} ({index}/{count})"));
    bar.enable_steady_tick(Duration::from_millis(500));
    LINE.with(|l| *l.borrow_mut() = Some(Line { bar, begun: 0 }));
    Open(())
}

/// The time left, once a step is done to estimate it from.
fn left(state: &ProgressState, w: &mut dyn std::fmt::Write) {
    let _ = if state.pos() == 0 {
        w.write_str("time left not known yet")
    } else {
        write!(w, "about {} left", HumanDuration(state.eta()))
    };
}

/// The experiment will take `steps` steps (configurations × rounds, or whatever its
/// unit of work is); the count starts again at none done.
pub fn plan(steps: u64) {
    LINE.with(|l| {
        if let Some(l) = l.borrow_mut().as_mut() {
            l.bar.set_length(steps);
            l.bar.set_position(0);
            l.bar.reset_eta();
            l.begun = 0;
        }
    });
}

/// The next step starts, named `what` (`"round 2/5 · 1500 B · pv"`); the one before is
/// done.
pub fn step(what: impl Display) {
    LINE.with(|l| {
        if let Some(l) = l.borrow_mut().as_mut() {
            if l.begun > 0 {
                l.bar.inc(1);
            }
            l.begun += 1;
            l.bar.set_message(what.to_string());
        }
    });
}

/// `"round r/n"`, counted from 1, for step names.
pub fn round(r: usize, n: usize) -> String {
    format!("round {}/{n}", r + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::InMemoryTerm;

    fn tick() {
        LINE.with(|l| {
            if let Some(l) = l.borrow().as_ref() {
                l.bar.tick();
            }
        });
    }

    #[test]
    fn the_line_names_the_experiment_the_step_and_the_steps_done() {
        let term = InMemoryTerm::new(4, 160);
        let open = experiment_to(
            ProgressDrawTarget::term_like(Box::new(term.clone())),
            "santos08-fig2",
            2,
            9,
        );
        plan(30);
        step(format!("{} · 1500 B · native", round(0, 10)));
        tick();
        assert!(
            term.contents().contains("time left not known yet"),
            "{}",
            term.contents()
        );
        step(format!("{} · 1500 B · pv", round(0, 10)));
        tick();
        let shown = term.contents();
        assert!(shown.contains("santos08-fig2 (2/9)"), "{shown}");
        assert!(shown.contains("round 1/10 · 1500 B · pv"), "{shown}");
        assert!(shown.contains("1/30"), "{shown}");
        assert!(
            shown.contains("left"),
            "an estimate once a step is done: {shown}"
        );
        drop(open);
        assert!(
            term.contents().trim().is_empty(),
            "the line is wiped when the experiment ends: {:?}",
            term.contents()
        );
    }

    #[test]
    fn nothing_is_drawn_off_a_terminal_and_steps_without_a_line_are_ignored() {
        assert!(target(false).is_hidden());
        // No line open on this thread: nothing to report into, nothing fails.
        plan(3);
        step("alone");
        LINE.with(|l| assert!(l.borrow().is_none()));
    }
}
