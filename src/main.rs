//! The `fabricgate` binary: argument parsing and exit codes only.

#![forbid(unsafe_code)]

use clap::Parser;
use fabricgate::cli::{CheckArgs, Cli, Command, Format, RunArgs, SelftestArgs};
use fabricgate::{EXIT_USAGE, EXIT_VALIDATED, check, daemon, policy};
use fabricgate_probes::Prober;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => run_check(&args),
        Command::Run(args) => run_agent(&args),
        Command::Selftest(args) => run_selftest(&args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("fabricgate: {e:#}");
            let code = e
                .downcast_ref::<fabricgate::Error>()
                .map_or(EXIT_USAGE, fabricgate::Error::exit_code);
            ExitCode::from(code)
        }
    }
}

fn run_check(args: &CheckArgs) -> anyhow::Result<u8> {
    let config = args.probe.load_config()?;
    let roots = args.probe.roots()?;
    let mut prober = Prober::new(roots, args.probe.probe_config(&config));
    let report = prober.probe();
    let verdict = policy::evaluate(&report, &config);
    let text = match args.format {
        Format::Json => serde_json::to_string_pretty(&check::to_json(&report, &verdict))? + "\n",
        Format::Table => check::to_table(&report, &verdict),
    };
    write_stdout(&text)?;
    Ok(check::exit_code(&report, &verdict))
}

/// Write the whole output; a reader that went away (`| head -c1`) is not an error: the exit
/// code still tells the verdict.
fn write_stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e),
        _ => Ok(()),
    }
}

fn run_selftest(args: &SelftestArgs) -> anyhow::Result<u8> {
    let config = args.probe.load_config()?;
    let roots = args.probe.roots()?;
    let timeout = args
        .timeout
        .unwrap_or_else(|| config.rdma.selftest_timeout());
    let outcome = fabricgate::selftest::run(&roots, &config, timeout);
    let text = match args.format {
        Format::Json => serde_json::to_string_pretty(&outcome.to_json())? + "\n",
        Format::Table => outcome.to_table(),
    };
    write_stdout(&text)?;
    Ok(outcome.exit_code())
}

fn run_agent(args: &RunArgs) -> anyhow::Result<u8> {
    daemon::init_logging(args.log_format);
    daemon::exit_on_panic();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let agent = daemon::Agent::from_args(args).await?;
        let shutdown = async {
            if let Err(e) = daemon::shutdown_signal().await {
                tracing::error!("cannot install signal handlers ({e}); stopping");
            }
        };
        daemon::run(agent, shutdown).await
    });
    // Do not wait on blocking tasks (DNS lookups) of an unreachable API server.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    result?;
    Ok(EXIT_VALIDATED)
}
