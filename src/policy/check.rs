//! A registered subsystem's part of the node's verdict. Each subsystem judges its own fact
//! ([`NodeCheck::judge`]); the fold into the verdict (readiness, its Node condition, its
//! labels, `FabricReady`) is [`super::evaluate_checked`]'s, so the Judge stays the one place
//! that decides.

use super::agent_fault;
use super::{Finding, PartVerdict, Scope};
use crate::config::Config;
use fabricgate_probes::ProbeReport;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The policy side of one subsystem. Pure: no I/O, no clock.
pub trait NodeCheck: Send + Sync {
    /// Its key in the verdict's JSON, the `scope` of its findings and its label
    /// `<prefix><name>.ready` (usually its collector's name too).
    fn name(&self) -> &'static str;

    /// The key of the fact its part is shown with in `check`'s JSON (the storage probe's,
    /// `storage`, under `lustre`): its name unless said.
    fn fact(&self) -> &'static str {
        self.name()
    }

    /// Its Node condition's type (`HugepagesReady`) and reason while it passes.
    fn condition(&self) -> (&'static str, &'static str);

    /// Judge this probe: its own fact (`report.facts`, `None` when its collector did not run)
    /// and whatever else of the report it needs.
    fn judge(&self, report: &ProbeReport, config: &Config) -> Contribution;
}

/// What one subsystem says of this probe.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Contribution {
    /// Whether its findings make the node not ready; when not, they are shown as warnings.
    pub required: bool,
    /// Why it does not pass (empty when it does); see [`finding`].
    pub findings: Vec<Finding>,
    /// Problems that do not block readiness.
    pub warnings: Vec<Finding>,
    /// Nothing to say about this node (no GPUs where they are not required): no Node
    /// condition and no `<name>.ready` label; its part still shows in `check`.
    pub silent: bool,
    /// More labels, as `(<key after the prefix>, value)` (`gpudirect.relation`); a value that
    /// is not a valid label value is left out.
    pub labels: Vec<(String, String)>,
    /// More of `check`'s JSON under its name (`relation`, `rails`).
    pub details: serde_json::Map<String, serde_json::Value>,
    /// The agent's own trouble (what it cannot see, not what the node lacks): an agent error
    /// instead of any verdict, like a missing mount of its own.
    pub agent_problems: Vec<String>,
}

/// A finding of subsystem `check`, with its condition reason `code` (CamelCase, stable).
pub fn finding(check: &'static str, code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Check(check),
        code,
        message,
    }
}

/// One subsystem's part of the verdict, in `check`'s JSON under its name.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckVerdict {
    #[serde(flatten)]
    pub part: PartVerdict,
    pub required: bool,
    /// [`Contribution::details`].
    #[serde(flatten)]
    pub details: serde_json::Map<String, serde_json::Value>,
    /// [`Contribution::silent`].
    #[serde(skip)]
    pub silent: bool,
    /// Its Node condition's type ([`NodeCheck::condition`]), for the agent fault that speaks
    /// for it.
    #[serde(skip)]
    pub condition: &'static str,
    /// [`NodeCheck::fact`].
    #[serde(skip)]
    pub fact: &'static str,
    /// [`Contribution::agent_problems`]: the Judge turns them into an agent error.
    #[serde(skip)]
    pub agent_problems: Vec<String>,
}

impl CheckVerdict {
    /// `check`'s part from what it contributed: one that is not required passes, whatever it
    /// found; one the agent cannot see says `AgentError` instead of anything about the node.
    pub fn of(check: &dyn NodeCheck, c: &Contribution) -> Self {
        let unreadable = !c.agent_problems.is_empty();
        let part = if unreadable {
            let findings = c
                .agent_problems
                .iter()
                .map(|p| {
                    let message = format!("fabricgate agent error: {p}");
                    finding(check.name(), agent_fault::REASON, message)
                })
                .collect();
            PartVerdict {
                ready: false,
                findings,
                warnings: Vec::new(),
            }
        } else {
            let (findings, mut warnings) = if c.required {
                (c.findings.clone(), Vec::new())
            } else {
                (Vec::new(), c.findings.clone())
            };
            warnings.extend(c.warnings.iter().cloned());
            PartVerdict {
                ready: findings.is_empty(),
                findings,
                warnings,
            }
        };
        Self {
            part,
            required: c.required,
            details: c.details.clone(),
            silent: c.silent && !unreadable,
            condition: check.condition().0,
            fact: check.fact(),
            agent_problems: c.agent_problems.clone(),
        }
    }
}

/// The registered subsystems' parts of a verdict, in registration order (the order of their
/// conditions and of the verdict's reasons); in JSON, an object by name.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parts(Vec<(&'static str, CheckVerdict)>);

impl Parts {
    pub fn get(&self, name: &str) -> Option<&CheckVerdict> {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut CheckVerdict> {
        self.0.iter_mut().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &CheckVerdict)> {
        self.0.iter().map(|(n, v)| (*n, v))
    }

    pub fn values(&self) -> impl Iterator<Item = &CheckVerdict> {
        self.0.iter().map(|(_, v)| v)
    }
}

impl FromIterator<(&'static str, CheckVerdict)> for Parts {
    fn from_iter<I: IntoIterator<Item = (&'static str, CheckVerdict)>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

impl Serialize for Parts {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, part) in &self.0 {
            map.serialize_entry(name, part)?;
        }
        map.end()
    }
}

/// One subsystem's judgment of one probe, before the fold into the verdict.
#[derive(Debug)]
pub(super) struct Judged {
    pub(super) name: &'static str,
    /// Its condition's reason while it passes (the type is the verdict's).
    ok_reason: &'static str,
    pub(super) verdict: CheckVerdict,
    labels: Vec<(String, String)>,
}

impl Judged {
    /// Its Node condition, unless it has nothing to say about this node.
    pub(super) fn condition(&self) -> Option<super::Condition> {
        let v = &self.verdict;
        (!v.silent).then(|| super::condition(v.condition, v.part.ready, self.ok_reason, &[&v.part]))
    }
}

/// Each registered subsystem's judgment of `report`.
pub(super) fn judge_all(checks: &Checks, report: &ProbeReport, config: &Config) -> Vec<Judged> {
    checks
        .iter()
        .map(|c| {
            let contribution = c.judge(report, config);
            Judged {
                name: c.name(),
                ok_reason: c.condition().1,
                verdict: CheckVerdict::of(c, &contribution),
                labels: contribution.labels,
            }
        })
        .collect()
}

/// `<prefix><name>.ready` (unless it has nothing to say) and each subsystem's own labels.
pub(super) fn put_labels(labels: &mut BTreeMap<String, String>, prefix: &str, judged: &[Judged]) {
    for j in judged {
        let name = j.name;
        if !j.verdict.silent {
            let ready = if j.verdict.part.ready {
                "true"
            } else {
                "false"
            };
            super::put_label(labels, format!("{prefix}{name}.ready"), ready);
        }
        for (key, value) in &j.labels {
            super::put_label(labels, format!("{prefix}{key}"), value);
        }
    }
}

/// The registered subsystems' policy sides, in registration order.
#[derive(Clone, Default)]
pub struct Checks(Arc<[Arc<dyn NodeCheck>]>);

impl Checks {
    pub fn new(checks: Vec<Arc<dyn NodeCheck>>) -> Self {
        Self(checks.into())
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn NodeCheck> {
        self.0.iter().map(|c| &**c)
    }
}

impl std::fmt::Debug for Checks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|c| c.name()))
            .finish()
    }
}
