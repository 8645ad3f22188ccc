//! The `fabricgate` binary: argument parsing and exit codes only.

#![forbid(unsafe_code)]

use clap::Parser;
use fabricgate::agent::{check, daemon};
use fabricgate::cli::{
    AdmissionCheckArgs, CheckArgs, CleanupArgs, Cli, Command, Format, GuardArgs, OnOff, PingArgs,
    PreflightArgs, RunArgs, SelftestArgs, WebhookArgs,
};
use fabricgate::transport::{self, check_peers};
use fabricgate::{EXIT_USAGE, EXIT_VALIDATED, policy};
use fabricgate_probes::Prober;
use fabricgate_probes::transport::sample::PodSampler;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => run_check(&args),
        Command::Run(args) => run_agent(&args),
        Command::Selftest(args) => run_selftest(&args),
        Command::Guard(args) => run_guard(args),
        Command::AdmissionCheck(args) => run_admission_check(args),
        Command::Ping(args) => run_ping(&args),
        Command::Preflight(args) => run_preflight(&args),
        Command::Webhook(args) => run_webhook(&args),
        Command::Cleanup(args) => run_cleanup(&args),
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
    let mut prober = Prober::new(roots.clone(), args.probe.probe_config(&config));
    let report = prober.probe();
    let verdict = policy::evaluate(&report, &config);
    // The pods section is for a person; the exit code stays the node's.
    let pods = (args.pods == OnOff::On).then(|| {
        let node = args
            .node_name
            .clone()
            .unwrap_or_else(|| check_peers::host_name(&roots));
        let mut sampler =
            PodSampler::new(roots).with_max_sockets(config.runtime.max_sockets_per_pod);
        let peers = check_peers::read(args.kubeconfig.as_deref(), &node, &config);
        transport::check::sample(
            &mut sampler,
            &config,
            args.pods_window,
            peers,
            &report,
            || prober.probe(),
        )
    });
    let text = match args.format {
        Format::Json => {
            let mut doc = check::to_json(&report, &verdict);
            if let Some(pods) = &pods {
                transport::check::insert_json(&mut doc, pods);
            }
            serde_json::to_string_pretty(&doc)? + "\n"
        }
        Format::Table => {
            let mut text = check::to_table(&report, &verdict);
            if let Some(pods) = &pods {
                text.push_str(&transport::check::to_table(pods));
            }
            text
        }
    };
    write_stdout(&text)?;
    Ok(policy::exit_code(&report, &verdict))
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
    let outcome = fabricgate::agent::selftest::run(&roots, &config, timeout);
    let text = match args.format {
        Format::Json => serde_json::to_string_pretty(&outcome.to_json())? + "\n",
        Format::Table => outcome.to_table(),
    };
    write_stdout(&text)?;
    Ok(outcome.exit_code())
}

fn run_ping(args: &PingArgs) -> anyhow::Result<u8> {
    let config = args.probe.load_config()?;
    let roots = args.probe.roots()?;
    let p = &config.peers;
    let plan = fabricgate_probes::rdma::peer::Plan {
        rtt_size: args.size.unwrap_or(p.rtt_message_size),
        rtt_count: args.count.unwrap_or(p.rtt_messages),
        bw_size: if args.bandwidth || p.bandwidth.enabled {
            args.bw_size.unwrap_or(p.bandwidth.message_size)
        } else {
            0
        },
        bw_duration: args.bw_duration.unwrap_or(p.bandwidth.duration),
    };
    plan.validate()
        .map_err(|message| fabricgate::Error::Usage {
            flag: "--count/--size/--bw-size/--bw-duration".into(),
            message,
        })?;
    let mut report = fabricgate_probes::rdma::sysfs::probe(&roots);
    fabricgate_probes::rdma::verbs::probe_into(&mut report);
    let identity = fabricgate_probes::rdma::peer::Identity {
        node_name: args.node_name.clone().unwrap_or_default(),
        group: String::new(),
    };
    let outcome = fabricgate::peers::ping(
        &args.peer,
        &report,
        &config,
        args.device.as_deref(),
        &identity,
        &plan,
        args.timeout.unwrap_or(p.timeout),
    )?;
    let text = match args.format {
        Format::Json => serde_json::to_string_pretty(&outcome.to_json())? + "\n",
        Format::Table => outcome.to_table(),
    };
    match std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
        _ => {}
    }
    Ok(outcome.exit_code())
}

fn run_agent(args: &RunArgs) -> anyhow::Result<u8> {
    daemon::init_logging(args.log_format);
    daemon::exit_on_panic();
    // One thread for all the agent's async work: the probe, the event listener and the peers
    // run on their own threads, and what is left (timers, the Node writer, the metrics server)
    // is waiting. A multi-threaded runtime handed every tick between its threads: ~6 context
    // switches per probe, a tenth of the agent's CPU at `--interval 1s`.
    let runtime = tokio::runtime::Builder::new_current_thread()
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

fn run_preflight(args: &PreflightArgs) -> anyhow::Result<u8> {
    use fabricgate::pod::preflight;
    // A usage error must reach `kubectl describe pod` too.
    let fail = |e: fabricgate::Error| -> anyhow::Result<u8> {
        let _ = preflight::write_termination_log(&args.termination_log, &e.to_string());
        Err(e.into())
    };
    let config = match args.load_config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let roots = match args.probe.roots() {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let opts = preflight::Options {
        selftest: args.selftest,
        min_memlock: args.min_memlock,
        min_active_ports: args.min_active_ports,
        nccl_net: args.nccl_net.clone(),
    };
    let outcome = preflight::run(&roots, args.probe.probe_config(&config), &config, &opts);
    if outcome.ok() {
        match preflight::write_nccl_files(&args.nccl_dir, &outcome.ports, &opts.nccl_net) {
            Ok((conf, env)) => println!(
                "fabricgate preflight: validated {} in {:.2}s; NCCL_IB_HCA={} NCCL_NET={} \
                 written to {} and {}",
                outcome.ib_hca().trim_start_matches('='),
                outcome.elapsed_seconds,
                outcome.ib_hca(),
                opts.nccl_net,
                conf.display(),
                env.display()
            ),
            Err(e) => return fail(e),
        }
    } else {
        let _ = preflight::remove_nccl_files(&args.nccl_dir);
        eprintln!(
            "fabricgate preflight: NOT VALIDATED after {:.2}s:",
            outcome.elapsed_seconds
        );
        for p in &outcome.problems {
            eprintln!("{p}");
        }
    }
    for note in &outcome.notes {
        eprintln!("note: {note}");
    }
    let t = &outcome.timings;
    eprintln!(
        "timings: rdma sysfs {:.3}s, verbs and self-test {:.3}s, storage {:.3}s, total {:.3}s",
        t.rdma_sysfs_seconds, t.rdma_verbs_seconds, t.storage_seconds, outcome.elapsed_seconds
    );
    // The termination log is for `kubectl describe pod` only: a missing or unwritable one is
    // said on stderr and never changes the verdict's exit code.
    if let Err(e) =
        preflight::write_termination_log(&args.termination_log, &outcome.termination_message())
    {
        eprintln!(
            "fabricgate preflight: cannot write {}: {e} (the verdict stands)",
            args.termination_log.display()
        );
    }
    Ok(outcome.exit_code)
}

fn run_webhook(args: &WebhookArgs) -> anyhow::Result<u8> {
    daemon::init_logging(args.log_format);
    let nofile = fabricgate::observe::server::raise_nofile();
    let config = fabricgate::pod::webhook::ServerConfig {
        mutation: args.mutation_config()?,
        cert_file: args.tls_cert_file.clone(),
        key_file: args.tls_key_file.clone(),
        reload_interval: args.cert_reload_interval,
        limits: fabricgate::pod::webhook::ServerConfig::default_limits(
            args.max_connections,
            nofile.soft,
        ),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
        tracing::info!(addr = %args.listen, "admission webhook serving");
        let shutdown = async {
            if let Err(e) = daemon::shutdown_signal().await {
                tracing::error!("cannot install signal handlers ({e}); stopping");
            }
        };
        fabricgate::pod::webhook::serve(config, listener, shutdown).await?;
        anyhow::Ok(())
    })?;
    Ok(EXIT_VALIDATED)
}

fn run_cleanup(args: &CleanupArgs) -> anyhow::Result<u8> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let clients = fabricgate::node::client(fabricgate::node::RetryAfter::default()).await?;
        let client = &clients.requests;
        fabricgate::cluster::cleanup::wait_pods_gone(
            client,
            &args.namespace,
            &args.wait_for_pods,
            args.timeout,
        )
        .await?;
        let cleaned =
            fabricgate::cluster::cleanup::cleanup(client, &args.label_prefix, &args.nodes).await?;
        for n in &cleaned.nodes {
            let mut removed: Vec<String> = n.labels.iter().map(|k| format!("label {k}")).collect();
            removed.extend(n.annotations.iter().map(|k| format!("annotation {k}")));
            removed.extend(n.taints.iter().map(|k| format!("taint {k}")));
            removed.extend(n.conditions.iter().map(|k| format!("condition {k}")));
            println!("Node {}: removed {}", n.node, removed.join(", "));
        }
        for r in &cleaned.rules {
            println!("DeviceTaintRule {r}: deleted");
        }
        println!(
            "fabricgate cleanup: {} of {} Nodes had fabricgate marks, all removed; {} DeviceTaintRules deleted",
            cleaned.nodes.len(),
            cleaned.nodes_seen,
            cleaned.rules.len()
        );
        Ok(0)
    })
}

fn run_guard(args: GuardArgs) -> anyhow::Result<u8> {
    daemon::init_logging(args.log_format);
    let nofile = fabricgate::observe::server::raise_nofile();
    let config = fabricgate::config::Config::load(&args.config)?;
    let identity = args
        .identity
        .filter(|i| !i.trim().is_empty())
        .unwrap_or_else(|| format!("fabricgate-guard-{}", std::process::id()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.metrics_addr)
            .await
            .map_err(|e| fabricgate::Error::Usage {
                flag: "--metrics-addr".into(),
                message: format!("cannot listen on {}: {e}", args.metrics_addr),
            })?;
        let addr = listener.local_addr().unwrap_or(args.metrics_addr);
        let clients = fabricgate::node::client(fabricgate::node::RetryAfter::default()).await?;
        let metrics = std::sync::Arc::new(fabricgate::cluster::guard::GuardMetrics::new());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = {
            let router = std::sync::Arc::clone(&metrics).router();
            let mut rx = stop_rx.clone();
            tokio::spawn(fabricgate::observe::server::serve(
                listener,
                router,
                fabricgate::observe::server::Limits::for_nofile(
                    fabricgate::observe::server::DEFAULT_MAX_CONNECTIONS,
                    nofile.soft,
                ),
                std::sync::Arc::new(()),
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                },
            ))
        };
        tracing::info!(%addr, "guard metrics serving");
        let settings = fabricgate::cluster::guard::GuardSettings {
            config,
            namespace: args.namespace,
            pod_selector: args.pod_selector,
            stale_after: args.stale_after,
            poll_interval: args.poll_interval,
            prove_every: args.prove_every,
            lease_name: args.lease_name,
            lease_duration: args.lease_duration,
            identity,
        };
        let shutdown = async {
            if let Err(e) = daemon::shutdown_signal().await {
                tracing::error!("cannot install signal handlers ({e}); stopping");
            }
        };
        let watch = clients.watch.unwrap_or_else(|| clients.requests.clone());
        let r =
            fabricgate::cluster::guard::run(clients.requests, watch, settings, metrics, shutdown)
                .await;
        let _ = stop_tx.send(true);
        let _ = server.await;
        r
    });
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    result?;
    Ok(EXIT_VALIDATED)
}

fn run_admission_check(args: AdmissionCheckArgs) -> anyhow::Result<u8> {
    daemon::init_logging(args.log_format);
    let config = match &args.config {
        Some(path) => fabricgate::config::Config::load(path)?,
        None => fabricgate::config::Config::default(),
    };
    let identity = args
        .identity
        .filter(|i| !i.trim().is_empty())
        .unwrap_or_else(|| format!("fabricgate-admission-check-{}", std::process::id()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.metrics_addr)
            .await
            .map_err(|e| fabricgate::Error::Usage {
                flag: "--metrics-listen".into(),
                message: format!("cannot listen on {}: {e}", args.metrics_addr),
            })?;
        let clients = fabricgate::node::client(fabricgate::node::RetryAfter::default()).await?;
        let metrics =
            std::sync::Arc::new(fabricgate::cluster::admission_check::CheckMetrics::new());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = {
            let router = std::sync::Arc::clone(&metrics).router();
            let mut rx = stop_rx.clone();
            tokio::spawn(fabricgate::observe::server::serve(
                listener,
                router,
                fabricgate::observe::server::Limits::default(),
                std::sync::Arc::new(()),
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                },
            ))
        };
        let settings = fabricgate::cluster::admission_check::CheckSettings {
            config,
            namespace: args.namespace,
            lease_name: args.lease_name,
            lease_duration: args.lease_duration,
            identity,
            poll_interval: args.poll_interval,
            workload_namespace: args.workload_namespace,
        };
        let shutdown = async {
            if let Err(e) = daemon::shutdown_signal().await {
                tracing::error!("cannot install signal handlers ({e}); stopping");
            }
        };
        let watch = clients.watch.unwrap_or_else(|| clients.requests.clone());
        let r = fabricgate::cluster::admission_check::run(
            clients.requests,
            watch,
            settings,
            metrics,
            shutdown,
        )
        .await;
        let _ = stop_tx.send(true);
        let _ = server.await;
        r
    });
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    result?;
    Ok(EXIT_VALIDATED)
}
