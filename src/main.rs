//! The `fabricgate` binary: argument parsing and dispatch only (`fabricgate::command`).

#![forbid(unsafe_code)]

use clap::Parser;
use fabricgate::cli::Cli;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match fabricgate::command::run(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("fabricgate: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
