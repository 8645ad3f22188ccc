//! RDMA resource tracking on a real RDMA device: the Soft-RoCE VM runs
//! tests/vm/capture-restrack.sh (two RC and two UD pingpongs, the RC server in a kubepods
//! cgroup) and the probes' parsers read its fresh netlink replies: the same QPs, types,
//! states and owners as `rdma -j res show qp` printed, and the RC server attributed to its
//! pod. (The committed fixtures, probes/tests/fixtures/restrack/, came from this script.)
//!
//! Outside CI the test skips, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;

use fabricgate_probes::transport::cgroup::{CgroupOwner, parse_proc_cgroup};
use fabricgate_probes::transport::restrack::{
    QpOwner, QpState, QpType, parse_device_dump, parse_qp_dump,
};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn boot() -> &'static Result<PathBuf, String> {
    static BOOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        common::run_vm_once(
            "run.sh",
            240,
            "restrack-vm",
            "capture-restrack.sh",
            &[],
            "console.log and stderr",
        )
    })
}

/// The datagrams `capture_rdma_restrack.py` wrote as `<prefix>-NN.bin`, in order.
fn datagrams(dir: &Path, prefix: &str) -> Vec<Vec<u8>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{prefix}-")) && n.ends_with(".bin"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| std::fs::read(dir.join(n)).unwrap())
        .collect()
}

fn type_name(t: QpType) -> String {
    format!("{t:?}").to_uppercase()
}

#[test]
fn a_live_qp_dump_parses_to_what_rdma_res_show_qp_prints() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let dir = out.join("capture");
    let devices = parse_device_dump(&datagrams(&dir, "devices")).unwrap();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0].name, "rxe0");
    let qps = parse_qp_dump(&datagrams(&dir, &format!("qp-{}", devices[0].index))).unwrap();
    let rdma: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rdma-res-show-qp.json")).unwrap())
            .unwrap();
    let listed = rdma.as_array().unwrap();
    assert_eq!(qps.len(), listed.len(), "{qps:#?}\n{rdma:#}");
    for (qp, l) in qps.iter().zip(listed) {
        assert_eq!(u64::from(qp.lqpn), l["lqpn"].as_u64().unwrap(), "{l}");
        assert_eq!(l["ifname"], "rxe0");
        assert_eq!(Some(u64::from(qp.port.unwrap())), l["port"].as_u64());
        assert_eq!(type_name(qp.qp_type), l["type"].as_str().unwrap(), "{l}");
        assert_eq!(qp.state, QpState::Rts, "{l}");
        match &qp.owner {
            QpOwner::Pid(pid) => assert_eq!(Some(u64::from(*pid)), l["pid"].as_u64(), "{l}"),
            QpOwner::Kernel(name) => assert_eq!(l["comm"], name.as_str(), "{l}"),
            QpOwner::Hidden => panic!("the capture runs in the owners' PID namespace: {l}"),
        }
    }
    let rc: Vec<_> = qps.iter().filter(|q| q.qp_type == QpType::Rc).collect();
    assert_eq!(rc.len(), 2);
    assert_eq!(rc[0].rqpn, Some(rc[1].lqpn), "the two RC QPs are connected");

    // The RC server was moved into a kubepods cgroup; its QP is the pod's.
    let QpOwner::Pid(server) = rc[0].owner else {
        panic!("{:?}", rc[0]);
    };
    let cgroup = std::fs::read_to_string(dir.join(format!("cgroup-{server}"))).unwrap();
    let CgroupOwner::Pod(pod) = parse_proc_cgroup(&cgroup) else {
        panic!("{cgroup}");
    };
    assert_eq!(pod.pod_uid, "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f");

    // A QP dump without a device index is refused, and the parser says so.
    let err = parse_qp_dump(&datagrams(&dir, "qp-noindex")).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
}
