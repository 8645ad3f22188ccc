#!/usr/bin/env python3
"""Writes rules_test.yaml (input for `promtool test rules`) from the cases below.

promtool compares annotations exactly, so the expected summary/description of every firing
alert is rendered here from deploy/prometheus-rules.yaml with the labels and value each case
expects (only the template forms the rules use: $labels.X, $value, $value | printf "%.0f").
Run it after changing a rule or a case:  python3 tests/prometheus/gen_rules_test.py
"""

import pathlib
import re

import yaml

HERE = pathlib.Path(__file__).resolve().parent
RULES = HERE.parent.parent / "deploy" / "prometheus-rules.yaml"

A = 'instance="gpu-a:9464",job="fabricgate"'
B = 'instance="gpu-b:9464",job="fabricgate"'
LA = {"instance": "gpu-a:9464", "job": "fabricgate"}
LB = {"instance": "gpu-b:9464", "job": "fabricgate"}


def port(labels, device, p, **extra):
    return {**labels, "device": device, "port": str(p), **extra}


def inst(n):
    return {"instance": f"gpu-{n}:9464", "job": "fabricgate"}


def peer_rtt(n, p, stat="median"):
    return (
        f'fabricgate_peer_rtt_seconds{{instance="gpu-{n}:9464",job="fabricgate",'
        f'device="mlx5_0",port="1",peer="10.0.0.{p}",stat="{stat}"}}'
    )


def peer_errors(n, p, kind):
    return (
        f'fabricgate_peer_errors_total{{instance="gpu-{n}:9464",job="fabricgate",'
        f'device="mlx5_0",port="1",peer="10.0.0.{p}",kind="{kind}"}}'
    )


# (alertname, description, input_series, [(eval_time, [(labels, value)])]).
# Every alert has at least one time where it fires and one where it does not.
CASES = [
    (
        "FabricgateNodeNotValidated",
        "gpu-a turns unvalidated at 6m and fires after 10m; gpu-b stays ready",
        [
            (f"fabricgate_node_ready{{{A}}}", "1x5 0x30"),
            (f"fabricgate_node_ready{{{B}}}", "1x35"),
        ],
        [("10m", []), ("20m", [(LA, 0)])],
    ),
    (
        "FabricgateRDMAPortDown",
        "mlx5_1 port 1 goes down; a short blip on mlx5_0 does not fire",
        [
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_0",port="1"}}', "1 0 0 1x20"),
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_1",port="1"}}', "1x2 0x20"),
        ],
        [("4m", []), ("12m", [(port(LA, "mlx5_1", 1), 0)])],
    ),
    (
        "FabricgateRDMALinkRateDegraded",
        "mlx5_1 retrains from 400 to 200 Gb/s (below its own past and its IB peers); the RoCE "
        "port at 200 Gb/s is not compared with the IB ports; a down port is PortDown's business",
        [
            (f'fabricgate_rdma_port_rate_gbps{{{A},device="mlx5_0",port="1"}}', "400x40"),
            (f'fabricgate_rdma_port_rate_gbps{{{A},device="mlx5_1",port="1"}}', "400x10 200x30"),
            (f'fabricgate_rdma_port_rate_gbps{{{A},device="mlx5_2",port="1"}}', "200x40"),
            (f'fabricgate_rdma_port_rate_gbps{{{A},device="mlx5_3",port="1"}}', "100x40"),
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_0",port="1"}}', "1x40"),
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_1",port="1"}}', "1x40"),
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_2",port="1"}}', "1x40"),
            (f'fabricgate_rdma_port_up{{{A},device="mlx5_3",port="1"}}', "0x40"),
            (f'fabricgate_rdma_port_info{{{A},device="mlx5_0",port="1",link_layer="InfiniBand",netdev=""}}', "1x40"),
            (f'fabricgate_rdma_port_info{{{A},device="mlx5_1",port="1",link_layer="InfiniBand",netdev=""}}', "1x40"),
            (f'fabricgate_rdma_port_info{{{A},device="mlx5_2",port="1",link_layer="Ethernet",netdev="ens3"}}', "1x40"),
            (f'fabricgate_rdma_port_info{{{A},device="mlx5_3",port="1",link_layer="InfiniBand",netdev=""}}', "1x40"),
        ],
        [("8m", []), ("15m", []), ("25m", [(port(LA, "mlx5_1", 1), 200)])],
    ),
    (
        "FabricgateRDMAErrorsRising",
        "symbol errors climb 1/min on mlx5_0 and a link_downed step on mlx5_1 fire; a slow "
        "trickle of port_rcv_errors (5 in an hour) does not",
        [
            (f'fabricgate_rdma_port_errors_total{{{A},device="mlx5_0",port="1",counter="symbol_error"}}', "0+1x70"),
            (f'fabricgate_rdma_port_errors_total{{{A},device="mlx5_1",port="1",counter="link_downed"}}', "0x30 1x40"),
            (f'fabricgate_rdma_port_errors_total{{{A},device="mlx5_2",port="1",counter="port_rcv_errors"}}', "0+0.1x70"),
        ],
        [
            ("5m", []),
            (
                "60m",
                [
                    (port(LA, "mlx5_0", 1, counter="symbol_error"), 60),
                    (port(LA, "mlx5_1", 1, counter="link_downed"), 1),
                ],
            ),
        ],
    ),
    (
        "FabricgateRoCERetriesRising",
        "out_of_sequence climbs 10/min; congestion notifications (np_cnp_sent) never alert",
        [
            (f'fabricgate_rdma_port_hw_events_total{{{A},device="mlx5_2",port="1",counter="out_of_sequence"}}', "0+10x70"),
            (f'fabricgate_rdma_port_hw_events_total{{{A},device="mlx5_2",port="1",counter="np_cnp_sent"}}', "0+1000x70"),
        ],
        [("5m", []), ("60m", [(port(LA, "mlx5_2", 1, counter="out_of_sequence"), 600)])],
    ),
    (
        "FabricgateLustreMountHung",
        "/lustre/scratch hangs at 5m; /lustre/home stays healthy",
        [
            (f'fabricgate_mount_hung{{{A},mount="/lustre/scratch"}}', "0x4 1x20"),
            (f'fabricgate_mount_hung{{{A},mount="/lustre/home"}}', "0x25"),
            (f'fabricgate_mount_up{{{A},mount="/lustre/scratch"}}', "1x4 0x20"),
            (f'fabricgate_mount_up{{{A},mount="/lustre/home"}}', "1x25"),
        ],
        [("5m", []), ("10m", [({**LA, "mount": "/lustre/scratch"}, 1)])],
    ),
    (
        "FabricgateMountDown",
        "/data goes missing; a hung mount is reported by MountHung only",
        [
            (f'fabricgate_mount_up{{{A},mount="/data"}}', "1x2 0x20"),
            (f'fabricgate_mount_hung{{{A},mount="/data"}}', "0x22"),
            (f'fabricgate_mount_up{{{A},mount="/lustre/scratch"}}', "0x22"),
            (f'fabricgate_mount_hung{{{A},mount="/lustre/scratch"}}', "1x22"),
        ],
        [("5m", []), ("10m", [({**LA, "mount": "/data"}, 0)])],
    ),
    (
        "FabricgateSilentTCPFallback",
        "gpu-a is suspected from 10m and fires after 15m; gpu-b is not",
        [
            (f"fabricgate_fallback_suspected{{{A}}}", "0x9 1x40"),
            (f"fabricgate_fallback_suspected{{{B}}}", "0x50"),
        ],
        [("20m", []), ("30m", [(LA, 1)])],
    ),
    (
        "FabricgateJobOnSockets",
        "two pods of Job ml/llm on two nodes are on sockets and it fires once for the job; "
        "a job on rdma does not",
        [
            (f'fabricgate_pod_transport{{{A},namespace="ml",pod="w-0",transport="sockets"}}', "1x20"),
            (f'fabricgate_pod_transport{{{B},namespace="ml",pod="w-1",transport="sockets"}}', "1x20"),
            (f'fabricgate_pod_transport{{{B},namespace="ml",pod="ok-0",transport="sockets"}}', "0x20"),
            (f'fabricgate_pod_owner_info{{{A},namespace="ml",pod="w-0",owner_kind="Job",owner_name="llm"}}', "1x20"),
            (f'fabricgate_pod_owner_info{{{B},namespace="ml",pod="w-1",owner_kind="Job",owner_name="llm"}}', "1x20"),
            (f'fabricgate_pod_owner_info{{{B},namespace="ml",pod="ok-0",owner_kind="Job",owner_name="ok"}}', "1x20"),
        ],
        [("1m", []), ("5m", [({"namespace": "ml", "owner_kind": "Job", "owner_name": "llm"}, 2)])],
    ),
    (
        "FabricgateAgentDown",
        "gpu-a stops answering scrapes; gpu-b keeps answering",
        [
            (f'up{{{A}}}', "1x3 0x20"),
            (f'up{{{B}}}', "1x24"),
        ],
        [("5m", []), ("12m", [(LA, 0)])],
    ),
    (
        "FabricgateAgentStale",
        "gpu-a's last probe stops at t=300s while time moves on; gpu-b keeps probing",
        [
            (f"fabricgate_last_probe_timestamp_seconds{{{A}}}", "0+60x5 300x30"),
            (f"fabricgate_last_probe_timestamp_seconds{{{B}}}", "0+60x35"),
        ],
        # At 15m (900s): 900 - 300 = 600 > 300 since 10m + 5m for.
        [("9m", []), ("16m", [(LA, 660)])],
    ),
    (
        "FabricgatePeerRTTHigh",
        "from 5m gpu-a's round trips to all three of its peers are 10x the pool's; gpu-b and "
        "gpu-d, which each see gpu-a slow among three peers, do not fire",
        [
            (peer_rtt(n, p), "0.00001x4 " + ("0.0001x30" if slow else "0.00001x30"))
            for n, p, slow in [
                ("a", 2, True), ("a", 3, True), ("a", 4, True),
                ("b", 1, True), ("b", 3, False), ("b", 4, False),
                ("c", 4, False), ("c", 5, False), ("c", 6, False),
                ("d", 5, False), ("d", 6, False), ("d", 1, True),
                ("e", 6, False), ("e", 2, False), ("e", 3, False),
                ("f", 2, False), ("f", 3, False), ("f", 4, False),
            ]
        ],
        [("4m", []), ("12m", []), ("20m", [(inst("a"), 3)])],
    ),
    (
        "FabricgatePeerUnreachable",
        "from 5m neither gpu-a nor gpu-b reaches 10.0.0.3 (errors rise, round trips stop); "
        "10.0.0.4, which gpu-b still reaches, does not fire",
        [
            (peer_errors("a", 3, "timeout"), "0x5 1+1x20"),
            (peer_errors("b", 3, "connect"), "0x5 1+1x20"),
            (peer_rtt("a", 3), "0.00001x5 stale"),
            (peer_rtt("b", 3), "0.00001x5 stale"),
            (peer_errors("a", 4, "timeout"), "0x5 1+1x20"),
            (peer_rtt("a", 4), "0.00001x5 stale"),
            (peer_rtt("b", 4), "0.00001x26"),
        ],
        [("5m", []), ("8m", []), ("15m", [({"peer": "10.0.0.3"}, 20)])],
    ),
]


GA = 'instance="guard-a:9466",job="fabricgate-guard"'
GB = 'instance="guard-b:9466",job="fabricgate-guard"'
GUARD = {"job": "fabricgate-guard"}

CASES.append(
    (
        "FabricgateGuardCannotAct",
        "the leader's writes are refused from 5m to 15m (its admission policy's pool and "
        "node.pool_selector disagree), no replica leads from 30m to 40m, its taints fail from "
        "45m; in between it can act",
        [
            (f"fabricgate_guard_blocked{{{GA}}}", "0x4 1x10 0x50"),
            (f"fabricgate_guard_blocked{{{GB}}}", "0x65"),
            (f"fabricgate_guard_leader{{{GA}}}", "1x29 0x10 1x25"),
            (f"fabricgate_guard_leader{{{GB}}}", "0x65"),
            (
                f'fabricgate_guard_writes_total{{{GA},kind="taint",result="failed"}}',
                "0x44 1+1x20",
            ),
            (
                f'fabricgate_guard_writes_total{{{GA},kind="dry_run",result="failed"}}',
                "0+1x65",
            ),
        ],
        [
            ("4m", []),
            ("12m", [(GUARD, 1)]),
            ("20m", []),
            ("38m", [(GUARD, 0)]),
            ("44m", []),
            ("55m", [(GUARD, 1)]),
        ],
    )
)

CASES.append(
    (
        "FabricgateGuardNotConfined",
        "the leader's dry run outside the pool is admitted from 10m to 20m (the requirements "
        "ConfigMap deleted), refused before and after; the follower proves nothing (-1)",
        [
            (f"fabricgate_guard_confined{{{GA}}}", "1x9 0x10 1x20"),
            (f"fabricgate_guard_confined{{{GB}}}", "-1x40"),
        ],
        [
            ("9m", []),
            ("15m", [(GUARD, 0)]),
            ("25m", []),
        ],
    )
)


def render(template, labels, value):
    def sub(m):
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            return labels[expr[len("$labels."):]]
        if expr == "$value":
            return f"{value:g}"
        if re.fullmatch(r'\$value \| printf "%\.0f"', expr):
            return f"{value:.0f}"
        raise ValueError(f"template form not handled here: {expr}")

    return re.sub(r"\{\{(.*?)\}\}", sub, template)


def main():
    rules = yaml.safe_load(RULES.read_text())
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    missing = set(by_name) - {c[0] for c in CASES}
    if missing:
        raise SystemExit(f"alerts without a test case: {sorted(missing)}")
    tests = []
    for name, desc, series, evals in CASES:
        rule = by_name[name]
        checks = []
        for t, alerts in evals:
            exp = []
            for labels, value in alerts:
                exp.append(
                    {
                        "exp_labels": {**labels, **rule.get("labels", {})},
                        "exp_annotations": {
                            k: render(v, labels, value)
                            for k, v in rule["annotations"].items()
                        },
                    }
                )
            checks.append({"eval_time": t, "alertname": name, "exp_alerts": exp})
        tests.append(
            {
                "name": f"{name}: {desc}",
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": checks,
            }
        )
    doc = {
        "rule_files": ["../../deploy/prometheus-rules.yaml"],
        "evaluation_interval": "1m",
        "tests": tests,
    }
    header = "# Generated by gen_rules_test.py from its cases; edit those and rerun.\n"
    out = HERE / "rules_test.yaml"
    out.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=100))


if __name__ == "__main__":
    main()
