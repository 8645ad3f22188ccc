//! The long-running subcommands, each on the shared [`crate::harness`]: `run` (the agent),
//! `guard`, `admission-check` and `webhook`.

use crate::EXIT_VALIDATED;
use crate::agent::daemon;
use crate::cli::{AdmissionCheckArgs, GuardArgs, RunArgs, WebhookArgs};
use crate::cluster::guard;
use crate::config::{Config, FeatureSection};
use crate::error::Result;
use crate::gang::admission_check;
use crate::gang::settings::GangSettings;
use crate::harness::{self, Harness, Threads};
use crate::observe::server::{DEFAULT_MAX_CONNECTIONS, Limits};
use crate::transport::settings::RuntimeSettings;
use std::sync::Arc;

pub(super) fn agent(args: &RunArgs) -> Result<u8> {
    let harness = Harness::start(args.log_format, Threads::One)?;
    let nofile = harness.nofile;
    harness.run(|shutdown| async move {
        let agent = daemon::Agent::from_args(args, &nofile).await?;
        daemon::run(agent, shutdown.signalled()).await
    })?;
    Ok(EXIT_VALIDATED)
}

pub(super) fn guard(args: GuardArgs) -> Result<u8> {
    let harness = Harness::start(args.log_format, Threads::Two)?;
    let config = crate::cli::load_config_file(&args.config)?;
    let transport = RuntimeSettings::of(&config)?;
    let limits = Limits::for_nofile(DEFAULT_MAX_CONNECTIONS, harness.nofile.soft);
    let settings = guard::GuardSettings {
        config,
        transport,
        namespace: args.namespace,
        pod_selector: args.pod_selector,
        stale_after: args.stale_after,
        poll_interval: args.poll_interval,
        prove_every: args.prove_every,
        lease_name: args.lease_name,
        lease_duration: args.lease_duration,
        identity: harness::identity(args.identity, "fabricgate-guard"),
    };
    harness.run(|shutdown| async move {
        let listener = harness::bind(args.metrics_addr, "--metrics-addr").await?;
        let addr = listener.local_addr().unwrap_or(args.metrics_addr);
        let metrics = Arc::new(guard::GuardMetrics::new());
        let router = Arc::clone(&metrics).router();
        tracing::info!(%addr, "guard metrics serving");
        harness::serve_controller(listener, router, limits, shutdown, |c, shutdown| {
            guard::run(c.requests, c.watch, settings, metrics, shutdown.signalled())
        })
        .await
    })?;
    Ok(EXIT_VALIDATED)
}

pub(super) fn admission_check(args: AdmissionCheckArgs) -> Result<u8> {
    let harness = Harness::start(args.log_format, Threads::Two)?;
    let config = match &args.config {
        Some(path) => crate::cli::load_config_file(path)?,
        None => Config::default(),
    };
    let limits = Limits::for_nofile(DEFAULT_MAX_CONNECTIONS, harness.nofile.soft);
    let gang = GangSettings::of(&config)?;
    let settings = admission_check::CheckSettings {
        config,
        gang,
        namespace: args.namespace,
        lease_name: args.lease_name,
        lease_duration: args.lease_duration,
        identity: harness::identity(args.identity, "fabricgate-admission-check"),
        poll_interval: args.poll_interval,
        workload_namespace: args.workload_namespace,
    };
    harness.run(|shutdown| async move {
        let listener = harness::bind(args.metrics_addr, "--metrics-addr").await?;
        let metrics = Arc::new(admission_check::CheckMetrics::new());
        let router = Arc::clone(&metrics).router();
        harness::serve_controller(listener, router, limits, shutdown, |c, shutdown| {
            admission_check::run(c.requests, c.watch, settings, metrics, shutdown.signalled())
        })
        .await
    })?;
    Ok(EXIT_VALIDATED)
}

pub(super) fn webhook(args: &WebhookArgs) -> Result<u8> {
    use crate::pod::webhook::{ServerConfig, serve};
    let harness = Harness::start(args.log_format, Threads::Two)?;
    let config = ServerConfig {
        mutation: args.mutation_config()?,
        cert_file: args.tls_cert_file.clone(),
        key_file: args.tls_key_file.clone(),
        reload_interval: args.cert_reload_interval,
        limits: ServerConfig::default_limits(args.max_connections, harness.nofile.soft),
    };
    harness.run(|shutdown| async move {
        let listener = harness::bind(args.listen, "--listen").await?;
        tracing::info!(addr = %args.listen, "admission webhook serving");
        serve(config, listener, shutdown.signalled()).await
    })?;
    Ok(EXIT_VALIDATED)
}
