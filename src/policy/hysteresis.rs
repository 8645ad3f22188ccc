//! Fail fast, recover slowly: the only memory a verdict has.

use super::*;

/// `reason` of the `FabricReady` condition while a node that has never been validated by this
/// agent collects its first good probes.
pub const AWAITING_VALIDATION: &str = "AwaitingValidation";

/// Fail fast, recover slowly: a bad probe makes the node not ready at once; it is ready again
/// only after `recover_after` consecutive good probes.
///
/// While recovering, the last not-ready verdict is repeated unchanged, so a flapping port
/// produces no label, condition or taint churn on the Node. Pure: no I/O, no clock.
#[derive(Debug, Clone)]
pub struct Hysteresis {
    recover_after: u32,
    ready_label: String,
    taint: Taint,
    good_streak: u32,
    validated: bool,
    /// The last not-ready verdict handed out, repeated while recovering.
    held: Option<Verdict>,
}

impl Hysteresis {
    /// A node starts not validated: it needs `node.recover_after` good probes first.
    pub fn new(config: &Config) -> Self {
        Self {
            recover_after: config.node.recover_after.max(1),
            ready_label: format!("{}ready", config.node.label_prefix),
            taint: unvalidated_taint(config),
            good_streak: 0,
            validated: false,
            held: None,
        }
    }

    /// Continue a validation a previous agent run recorded on the Node (`FabricReady=True`, no
    /// taint): an agent restart then does not re-taint a healthy node. The next bad probe still
    /// fails it at once.
    pub fn resume_validated(&mut self) {
        self.validated = true;
        self.good_streak = self.recover_after;
        self.held = None;
    }

    /// Consecutive good probes seen so far (0 after a bad one).
    pub fn good_streak(&self) -> u32 {
        self.good_streak
    }

    /// Whether the node is currently validated (the last verdict handed out was ready).
    pub fn validated(&self) -> bool {
        self.validated
    }

    /// The verdict to act on, given the verdict of the probe just taken.
    pub fn apply(&mut self, instant: Verdict) -> Verdict {
        if !instant.ready {
            self.good_streak = 0;
            self.validated = false;
            self.held = Some(instant.clone());
            return instant;
        }
        self.good_streak = self.good_streak.saturating_add(1);
        if self.validated || self.good_streak >= self.recover_after {
            self.validated = true;
            self.held = None;
            return instant;
        }
        match &self.held {
            Some(held) => held.clone(),
            None => self.awaiting(instant),
        }
    }

    /// A good probe on a node not yet validated since the agent started: everything the probe
    /// found is reported, but the node stays tainted and `FabricReady` stays `False`. The
    /// message does not count probes, so it does not change (and cause a write) on each one.
    fn awaiting(&self, mut v: Verdict) -> Verdict {
        v.ready = false;
        v.labels
            .insert(self.ready_label.clone(), "false".to_owned());
        v.taints = vec![self.taint.clone()];
        for c in v.conditions.iter_mut().filter(|c| c.type_ == "FabricReady") {
            c.status = "False".to_owned();
            c.reason = AWAITING_VALIDATION.to_owned();
            c.message = format!(
                "all fabricgate checks pass; the node is validated after {} consecutive good probes",
                self.recover_after
            );
        }
        v
    }
}

/// Hysteresis tests with hand-built verdicts.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rdma::rdma_finding;

    fn verdict(ready: bool, port: &str) -> Verdict {
        let config = Config::default();
        let part = PartVerdict {
            ready,
            findings: if ready {
                Vec::new()
            } else {
                vec![rdma_finding("PortDown", format!("{port} is down"))]
            },
            warnings: Vec::new(),
        };
        let rdma = RdmaVerdict {
            part: part.clone(),
            usable_ports: u32::from(ready),
            required_ports: 1,
            min_rate_gbps: ready.then_some(400.0),
            link_layer: ready.then(|| "InfiniBand".to_owned()),
        };
        let mut labels = BTreeMap::new();
        labels.insert("fabricgate.io/ready".to_owned(), ready.to_string());
        Verdict {
            ready,
            rdma,
            placement: PartVerdict::ok(),
            labels,
            taints: if ready {
                Vec::new()
            } else {
                vec![unvalidated_taint(&config)]
            },
            conditions: vec![condition("FabricReady", ready, "FabricValidated", &[&part])],
            keep_taint: false,
            device_taints: Vec::new(),
            checks: Default::default(),
        }
    }

    #[test]
    fn missing_placement_labels_taint_a_ready_node_and_name_the_keys() {
        let config = Config::parse(
            "placement:\n  required_labels: [cloud.example.com/block, cloud.example.com/rack]\n",
        )
        .unwrap();
        let ready = verdict(true, "mlx5_0");
        let required = &config.placement.required_labels;
        let mut labels = BTreeMap::new();
        labels.insert("cloud.example.com/block".to_owned(), "b1".to_owned());
        let v = apply_placement(&ready, &labels, required, &config.node);
        assert!(!v.ready);
        assert!(!v.placement.ready);
        assert_eq!(v.labels["fabricgate.io/ready"], "false");
        assert_eq!(v.taints.len(), 1);
        assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
        let fabric = &v.conditions[0];
        assert_eq!(
            (fabric.status.as_str(), fabric.reason.as_str()),
            ("False", "PlacementLabelsMissing")
        );
        assert!(fabric.message.contains("cloud.example.com/rack"));
        assert!(!fabric.message.contains("cloud.example.com/block,"));
        assert_eq!(v.reasons().len(), 1);
        // Every key present: the verdict is unchanged.
        labels.insert("cloud.example.com/rack".to_owned(), "r7".to_owned());
        assert_eq!(
            apply_placement(&ready, &labels, required, &config.node),
            ready
        );
        // Nothing required: unchanged even without labels.
        assert_eq!(
            apply_placement(&ready, &BTreeMap::new(), &[], &config.node),
            ready
        );
    }

    fn hysteresis(n: u32) -> Hysteresis {
        let mut config = Config::default();
        config.node.recover_after = n;
        Hysteresis::new(&config)
    }

    #[test]
    fn a_new_node_is_validated_only_after_recover_after_good_probes() {
        let mut h = hysteresis(3);
        for i in 1..3 {
            let v = h.apply(verdict(true, "p"));
            assert!(!v.ready, "probe {i}");
            assert_eq!(v.labels["fabricgate.io/ready"], "false");
            assert_eq!(v.taints.len(), 1);
            assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
            assert_eq!(v.conditions[0].status, "False");
            assert_eq!(v.conditions[0].reason, AWAITING_VALIDATION);
        }
        let v = h.apply(verdict(true, "p"));
        assert!(v.ready);
        assert!(v.taints.is_empty());
        assert_eq!(v.conditions[0].status, "True");
        assert!(h.validated());
    }

    #[test]
    fn one_bad_probe_fails_at_once() {
        let mut h = hysteresis(3);
        for _ in 0..3 {
            h.apply(verdict(true, "p"));
        }
        let v = h.apply(verdict(false, "mlx5_0 port 1"));
        assert!(!v.ready);
        assert_eq!(v.conditions[0].reason, "PortDown");
        assert_eq!(h.good_streak(), 0);
    }

    #[test]
    fn recovery_repeats_the_last_failure_unchanged_then_validates() {
        let mut h = hysteresis(3);
        for _ in 0..3 {
            h.apply(verdict(true, "p"));
        }
        let bad = h.apply(verdict(false, "mlx5_0 port 1"));
        assert_eq!(h.apply(verdict(true, "p")), bad);
        assert_eq!(h.apply(verdict(true, "p")), bad);
        assert!(h.apply(verdict(true, "p")).ready);
    }

    #[test]
    fn a_flapping_port_yields_one_unchanging_not_ready_verdict() {
        let mut h = hysteresis(3);
        let first = h.apply(verdict(false, "mlx5_0 port 1"));
        for i in 0..50 {
            let v = h.apply(verdict(i % 2 == 0, "mlx5_0 port 1"));
            assert_eq!(v, first, "probe {i}");
        }
    }

    #[test]
    fn a_resumed_validation_stays_ready_on_a_good_probe_and_fails_on_a_bad_one() {
        let mut h = hysteresis(3);
        h.resume_validated();
        assert!(h.apply(verdict(true, "p")).ready);
        assert!(!h.apply(verdict(false, "p")).ready);
        assert!(!h.apply(verdict(true, "p")).ready, "recovery needs 3 again");
    }

    #[test]
    fn recover_after_one_validates_on_the_first_good_probe() {
        let mut h = hysteresis(1);
        h.apply(verdict(false, "p"));
        assert!(h.apply(verdict(true, "p")).ready);
    }
}
