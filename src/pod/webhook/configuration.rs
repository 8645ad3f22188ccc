//! The `MutatingWebhookConfiguration` that registers the webhook (deploy/webhook.yaml holds
//! the same object).

use super::MUTATE_PATH;
use serde_json::{Value, json};

/// Where the API server reaches the webhook.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// `url: https://127.0.0.1:PORT/mutate` (tests, or a webhook outside the cluster).
    Url(String),
    /// A Service in the cluster (the deploy/ manifest).
    Service {
        namespace: String,
        name: String,
        port: u16,
    },
}

/// The `MutatingWebhookConfiguration` (admissionregistration.k8s.io/v1), as JSON. Two
/// webhooks, both `failurePolicy: Fail` (a webhook that is down, hung or unreachable never
/// lets an opted-in pod start without preflight): namespaces labelled
/// `<prefix>preflight: "true"` (every pod there that requests RDMA), and pods labelled so in
/// other namespaces. Pods that opted in neither way never reach the webhook, so an outage
/// does not block them.
/// `ca_bundle_pem` is the CA that signed the serving certificate (PEM).
pub fn webhook_configuration(
    name: &str,
    endpoint: &Endpoint,
    ca_bundle_pem: &[u8],
    label_prefix: &str,
    exempt_namespaces: &[&str],
) -> Value {
    // ByteString serializes as base64, as the API wants `caBundle`.
    let ca = serde_json::to_value(k8s_openapi::ByteString(ca_bundle_pem.to_vec()))
        .unwrap_or(Value::Null);
    let mut client = match endpoint {
        Endpoint::Url(url) => json!({"url": format!("{}{MUTATE_PATH}", url.trim_end_matches('/'))}),
        Endpoint::Service {
            namespace,
            name,
            port,
        } => json!({"service": {"namespace": namespace, "name": name, "port": port,
            "path": MUTATE_PATH}}),
    };
    client["caBundle"] = ca;
    let label = format!("{label_prefix}preflight");
    let rules = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
        "resources": ["pods"], "scope": "Namespaced"}]);
    let not_exempt = json!({"key": "kubernetes.io/metadata.name", "operator": "NotIn",
        "values": exempt_namespaces});
    let common = |hook: &str, failure: &str, ns: Value, obj: Value| {
        json!({
            "name": hook,
            "admissionReviewVersions": ["v1"],
            "clientConfig": client,
            "rules": rules,
            "failurePolicy": failure,
            "matchPolicy": "Equivalent",
            "namespaceSelector": ns,
            "objectSelector": obj,
            "sideEffects": "None",
            "timeoutSeconds": 5,
            "reinvocationPolicy": "IfNeeded",
        })
    };
    let domain = label_prefix.trim_end_matches('/');
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            common(
                &format!("namespaces.preflight.{domain}"),
                "Fail",
                json!({"matchExpressions": [
                    {"key": label, "operator": "In", "values": ["true"]}, not_exempt]}),
                json!({"matchExpressions": [
                    {"key": label, "operator": "NotIn", "values": ["false"]}]}),
            ),
            common(
                &format!("pods.preflight.{domain}"),
                "Fail",
                json!({"matchExpressions": [
                    {"key": label, "operator": "NotIn", "values": ["true"]}, not_exempt]}),
                json!({"matchLabels": {label.clone(): "true"}}),
            ),
        ],
    })
}
