//! The binary's subcommands run as a user runs them, each module one subcommand's
//! output and exit codes: `check` (and its pods section), `gpudirect`, `peers`, `preflight`, `selftest`, the
//! storage side of `check`, and what the long-running subcommands share (`serve_cli`).

mod common;

#[path = "cli/check_cli.rs"]
mod check_cli;
#[path = "cli/check_pods_cli.rs"]
mod check_pods_cli;
#[path = "cli/gpudirect_cli.rs"]
mod gpudirect_cli;
#[path = "cli/peers_cli.rs"]
mod peers_cli;
#[path = "cli/peers_redteam.rs"]
mod peers_redteam;
#[path = "cli/preflight_cli.rs"]
mod preflight_cli;
#[path = "cli/selftest_cli.rs"]
mod selftest_cli;
#[path = "cli/serve_cli.rs"]
mod serve_cli;
#[path = "cli/storage_cli.rs"]
mod storage_cli;
