//! The one-shot subcommands: `check`, `selftest`, `ping`, `preflight` and `cleanup`.

use crate::agent::check;
use crate::cli::{CheckArgs, CleanupArgs, Format, OnOff, PingArgs, PreflightArgs, SelftestArgs};
use crate::config::FeatureSection;
use crate::error::{Error, Result};
use crate::policy;
use crate::transport::check as pods_check;
use crate::transport::check_peers;
use crate::transport::settings::RuntimeSettings;
use fabricgate_probes::Prober;
use fabricgate_probes::transport::sample::PodSampler;

pub(super) fn check(args: &CheckArgs) -> Result<u8> {
    let config = args.probe.load_config()?;
    let transport = RuntimeSettings::of(&config)?;
    let roots = args.probe.roots()?;
    let mut prober = Prober::new(roots.clone(), args.probe.probe_config(&config));
    let report = prober.probe();
    let verdict = policy::evaluate_checked(&report, &config, &crate::checks::registered().checks());
    // The pods section is for a person; the exit code stays the node's.
    let pods = (args.pods == OnOff::On).then(|| {
        let node = args
            .node_name
            .clone()
            .unwrap_or_else(|| check_peers::host_name(&roots));
        let mut sampler = PodSampler::new(roots).with_max_sockets(transport.max_sockets_per_pod);
        let peers = check_peers::read(args.kubeconfig.as_deref(), &node, &transport.job_labels);
        pods_check::sample(
            &mut sampler,
            &config,
            &transport,
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
                pods_check::insert_json(&mut doc, pods);
            }
            json(&doc)?
        }
        Format::Table => {
            let mut text = check::to_table(&report, &verdict);
            if let Some(pods) = &pods {
                text.push_str(&pods_check::to_table(pods));
            }
            text
        }
    };
    write_stdout(&text)?;
    Ok(policy::exit_code(&report, &verdict))
}

fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::Io {
            what: "write to standard output".into(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// A JSON document as `check --format json` and friends print it.
fn json(doc: &serde_json::Value) -> Result<String> {
    serde_json::to_string_pretty(doc)
        .map(|t| t + "\n")
        .map_err(|e| Error::Internal {
            message: format!("cannot render the JSON output: {e}"),
        })
}

pub(super) fn selftest(args: &SelftestArgs) -> Result<u8> {
    let config = args.probe.load_config()?;
    let roots = args.probe.roots()?;
    let timeout = args
        .timeout
        .unwrap_or_else(|| config.rdma.selftest_timeout());
    let outcome = crate::agent::selftest::run(&roots, &config, timeout);
    let text = match args.format {
        Format::Json => json(&outcome.to_json())?,
        Format::Table => outcome.to_table(),
    };
    write_stdout(&text)?;
    Ok(outcome.exit_code())
}

pub(super) fn ping(args: &PingArgs) -> Result<u8> {
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
    plan.validate().map_err(|message| crate::Error::Usage {
        flag: "--count/--size/--bw-size/--bw-duration".into(),
        message,
    })?;
    let mut report = fabricgate_probes::rdma::sysfs::probe(&roots);
    fabricgate_probes::rdma::verbs::probe_into(&mut report);
    let identity = fabricgate_probes::rdma::peer::Identity {
        node_name: args.node_name.clone().unwrap_or_default(),
        group: String::new(),
    };
    let outcome = crate::peers::ping(
        &args.peer,
        &report,
        &config,
        args.device.as_deref(),
        &identity,
        &plan,
        args.timeout.unwrap_or(p.timeout),
    )?;
    let text = match args.format {
        Format::Json => json(&outcome.to_json())?,
        Format::Table => outcome.to_table(),
    };
    write_stdout(&text)?;
    Ok(outcome.exit_code())
}

pub(super) fn preflight(args: &PreflightArgs) -> Result<u8> {
    use crate::pod::preflight;
    // A usage error must reach `kubectl describe pod` too.
    let fail = |e: crate::Error| -> Result<u8> {
        let _ = preflight::write_termination_log(&args.termination_log, &e.to_string());
        Err(e)
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
    let probe = args.probe.probe_config(&config);
    let checks = crate::checks::registered().checks();
    let outcome = preflight::run(&roots, probe, &config, &checks, &opts);
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
    let storage = t
        .collected(fabricgate_probes::storage::NAME)
        .map_or("-".to_owned(), |s| format!("{s:.3}s"));
    eprintln!(
        "timings: rdma sysfs {:.3}s, verbs and self-test {:.3}s, storage {storage}, total {:.3}s",
        t.rdma_sysfs_seconds, t.rdma_verbs_seconds, outcome.elapsed_seconds
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

pub(super) fn cleanup(args: &CleanupArgs) -> Result<u8> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            what: "start the async runtime".into(),
            source,
        })?;
    runtime.block_on(async {
        let clients = crate::node::client(crate::node::RetryAfter::default()).await?;
        let client = &clients.requests;
        crate::cluster::cleanup::wait_pods_gone(
            client,
            &args.namespace,
            &args.wait_for_pods,
            args.timeout,
        )
        .await?;
        let cleaned =
            crate::cluster::cleanup::cleanup(client, &args.label_prefix, &args.nodes).await?;
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
