//! Each subcommand from its parsed flags to an exit code: the one-shot ones here
//! ([`oneshot`]), the long-running ones on the shared [`crate::harness`] ([`serve`]).
//! `main.rs` only parses and dispatches.

mod oneshot;
mod serve;

use crate::cli::Command;
use crate::error::Result;

/// Run `command`; `Ok` carries the exit code (a verdict's, or 0 for a service that stopped
/// cleanly), `Err` an error whose [`crate::Error::exit_code`] the process exits with.
///
/// # Errors
/// Whatever the subcommand cannot do: bad flags or config, no cluster, an unbindable address.
pub fn run(command: Command) -> Result<u8> {
    match command {
        Command::Check(args) => oneshot::check(&args),
        Command::Selftest(args) => oneshot::selftest(&args),
        Command::Ping(args) => oneshot::ping(&args),
        Command::Preflight(args) => oneshot::preflight(&args),
        Command::Cleanup(args) => oneshot::cleanup(&args),
        Command::Run(args) => serve::agent(&args),
        Command::Guard(args) => serve::guard(args),
        Command::AdmissionCheck(args) => serve::admission_check(args),
        Command::Webhook(args) => serve::webhook(&args),
    }
}
