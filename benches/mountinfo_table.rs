//! The 2,000-line mount table of a busy Kubernetes node, shared by `benches/storage.rs` and
//! `examples/mountinfo_parse.rs` (included with `#[path]`): overlay roots, secrets and
//! projected volumes with escaped names, a few network file systems.

/// The root mount and `lines` more (mount ids from 100).
pub fn busy_node_mountinfo(lines: usize) -> String {
    let mut s = String::from(
        "28 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro\n",
    );
    for id in 100..100 + lines {
        let pod = format!("{:08x}-1b2c-4d5e-8f90-{:012x}", id * 7919, id * 104_729);
        let line = match id % 4 {
            0 => format!(
                "{id} 28 0:{id} / /run/containerd/io.containerd.runtime.v2.task/k8s.io/{pod}/rootfs rw,relatime - overlay overlay rw,lowerdir=/var/lib/containerd/snapshots/{id}/fs,upperdir=/var/lib/containerd/snapshots/{}/fs,workdir=/var/lib/containerd/snapshots/{}/work\n",
                id + 1,
                id + 1
            ),
            1 => format!(
                "{id} 28 0:{id} / /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~projected/kube-api-access-{id:x} rw,relatime shared:{id} - tmpfs tmpfs rw,size=1048576k,inode64\n"
            ),
            2 => format!(
                "{id} 28 0:{id} / /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~secret/my\\040secret\\011{id} rw,relatime - tmpfs tmpfs rw,size=65536k\n"
            ),
            _ => format!(
                "{id} 28 0:{id} /exports/{id} /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~nfs/data rw,relatime shared:{id} - nfs4 nfs1:/exports/{id} rw,vers=4.2,rsize=1048576,wsize=1048576,hard,proto=tcp,timeo=600\n"
            ),
        };
        s.push_str(&line);
    }
    s
}
