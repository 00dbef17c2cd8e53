//! The `pvio` command: runs the lab's experiments and writes their reports.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lab::{Mode, RunEnv};

#[derive(Parser, Debug)]
#[command(
    name = "pvio",
    version,
    about = "A user-space paravirtualization platform and its lab"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs every registered experiment (or one) and writes its table, JSON and Markdown.
    Reproduce {
        /// Shorter runs: fewer iterations and operations.
        #[arg(long)]
        quick: bool,
        /// Only this experiment (see `pvio list`).
        #[arg(long, value_name = "ID")]
        only: Option<String>,
        /// Where to write `<id>.json` and `<id>.md`.
        #[arg(long, value_name = "DIR", default_value = "results")]
        out: PathBuf,
    },
    /// Runs one benchmark experiment (same as `reproduce --only ID`).
    Bench {
        /// Experiment id, e.g. `core`.
        id: String,
        /// Shorter runs.
        #[arg(long)]
        quick: bool,
        /// Output directory.
        #[arg(long, value_name = "DIR", default_value = "results")]
        out: PathBuf,
    },
    /// Lists the registered experiments.
    List,
}

fn reproduce(quick: bool, only: Option<&str>, out: &std::path::Path) -> ExitCode {
    let all = lab::registry();
    let chosen: Vec<_> = all
        .iter()
        .filter(|e| only.is_none_or(|id| e.id == id))
        .collect();
    if chosen.is_empty() {
        eprintln!(
            "no experiment named {:?}; `pvio list` shows them",
            only.unwrap_or_default()
        );
        return ExitCode::from(2);
    }
    let env = RunEnv::capture(quick);
    let mode = if quick { Mode::Quick } else { Mode::Full };
    let mut failed = 0;
    for e in chosen {
        eprintln!("running {} ({}) ...", e.id, e.paper);
        match (e.run)(mode) {
            Ok(report) => {
                println!("{}", report.table());
                match report.write(out, &env) {
                    Ok((j, m)) => println!("wrote {} and {}\n", j.display(), m.display()),
                    Err(err) => {
                        eprintln!("could not write the report of {}: {err}", e.id);
                        failed += 1;
                    }
                }
            }
            Err(err) => {
                eprintln!("experiment {} failed: {err}", e.id);
                failed += 1;
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Reproduce { quick, only, out } => reproduce(quick, only.as_deref(), &out),
        Command::Bench { id, quick, out } => reproduce(quick, Some(&id), &out),
        Command::List => {
            for e in lab::registry() {
                println!("{:<10} {}  [{}]", e.id, e.title, e.paper);
            }
            ExitCode::SUCCESS
        }
    }
}
