use super::*;

/// A procfs without `kthreadd` at PID 2 is not the host's: every requested pod is unknown
/// (from its second sample, as the contract says) with what to add; `check` gets a note.
#[test]
fn without_the_host_pid_namespace_pods_are_unknown_with_what_to_add() {
    let dir = tempfile::tempdir().unwrap();
    let roots = Roots::new(dir.path().join("sys"), dir.path().join("proc"));
    let mut sampler = PodSampler::new(roots);
    let request = SampleRequest {
        pod_uids: Some(["a".to_owned()].into()),
        host_network: BTreeSet::new(),
        remote: RemoteScope::NotLocal,
    };
    assert!(sampler.sample(&request).is_empty());
    let facts = sampler.sample(&request);
    assert_eq!(facts.len(), 1);
    assert!(
        matches!(&facts[0].qps, Observed::Unseen { reason } if reason.contains("hostPID: true"))
    );
    assert_eq!(sampler.notes(), [NO_HOST_PID]);
}

#[test]
fn remote_scopes() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let local: BTreeSet<IpAddr> = [ip("10.0.0.5")].into();
    assert!(RemoteScope::NotLocal.is_remote(ip("10.0.0.6"), &local));
    assert!(!RemoteScope::NotLocal.is_remote(ip("10.0.0.5"), &local));
    assert!(!RemoteScope::NotLocal.is_remote(ip("127.0.0.1"), &local));
    let nodes = RemoteScope::Nodes {
        addresses: [ip("10.0.0.6")].into(),
        pod_cidrs: vec![(ip("10.244.1.0"), 24)],
    };
    assert!(nodes.is_remote(ip("10.244.1.9"), &local));
    assert!(!nodes.is_remote(ip("8.8.8.8"), &local));
}
