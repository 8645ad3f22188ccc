//! A temporary procfs laid out as a Kubernetes node's for the runtime benches: pod processes
//! in kubepods cgroups (systemd driver, containerd scopes) and other processes beside them.
// Each bench includes this file as its own module and uses a part of it.
#![allow(dead_code)]

use std::path::Path;

pub fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("dir");
    std::fs::write(path, text).expect("write");
}

/// The UID of the bench's pod number `pod`.
pub fn pod_uid(pod: u32) -> String {
    format!("5f1d3c2e-8a4b-4f6e-9c1d-{pod:012x}")
}

/// The PID of process `i` of the bench's pod number `pod` (10 per pod, from 5000 on).
pub fn pod_pid(pod: u32, i: u32) -> u32 {
    5000 + pod * 10 + i
}

/// `<proc>/<pid>/cgroup` of a container process of the pod `uid`.
pub fn pod_process(proc: &Path, uid: &str, pid: u32) {
    let uid = uid.replace('-', "_");
    write(
        &proc.join(format!("{pid}/cgroup")),
        &format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/\
             cri-containerd-{pid:064x}.scope\n"
        ),
    );
}

/// `count` processes of the node's own services, from PID 100 on.
pub fn other_processes(proc: &Path, count: u32) {
    for other in 0..count {
        write(
            &proc.join(format!("{}/cgroup", 100 + other)),
            "0::/system.slice/containerd.service\n",
        );
    }
}
