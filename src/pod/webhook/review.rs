//! One `AdmissionReview` in, one out.

use super::{ADMISSION_API_VERSION, MutationConfig, mutate};
use crate::error::{Error, Result};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::Value;

/// Answer one `AdmissionReview` (the request body) with the review to send back.
///
/// # Errors
/// [`Error::Usage`] when the body is not an `AdmissionReview` of
/// [`ADMISSION_API_VERSION`] with a request; the server answers 400 with the message, which
/// the API server counts as a failed call (`failurePolicy: Fail`: the pod is refused).
pub fn review(body: &[u8], cfg: &MutationConfig) -> Result<Value> {
    let review = answer(body, cfg)?;
    let mut out = serde_json::to_value(&review).map_err(|e| Error::Internal {
        message: format!("cannot serialize the AdmissionReview: {e}"),
    })?;
    // kube-core serializes the patch bytes as a number array; the API's own (Go) encoding
    // of []byte is a base64 string, which is what every client expects.
    if let Some(bytes) = review.response.as_ref().and_then(|r| r.patch.clone()) {
        out["response"]["patch"] =
            serde_json::to_value(k8s_openapi::ByteString(bytes)).map_err(|e| Error::Internal {
                message: format!("cannot encode the patch: {e}"),
            })?;
    }
    Ok(out)
}

fn answer(body: &[u8], cfg: &MutationConfig) -> Result<AdmissionReview<DynamicObject>> {
    let bad = |message: String| Error::Usage {
        flag: "request body".into(),
        message,
    };
    let raw: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not an AdmissionReview (JSON): {e}")))?;
    let (version, kind) = (raw["apiVersion"].as_str(), raw["kind"].as_str());
    if kind != Some("AdmissionReview") || version != Some(ADMISSION_API_VERSION) {
        return Err(bad(format!(
            "not an AdmissionReview of {ADMISSION_API_VERSION} (kind {kind:?}, apiVersion \
             {version:?}); register the webhook with admissionReviewVersions: [v1]"
        )));
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(raw).map_err(|e| bad(format!("not an AdmissionReview: {e}")))?;
    let request: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| bad("the AdmissionReview has no request".into()))?;
    let mut response = AdmissionResponse::from(&request);
    let is_pod = request.kind.kind == "Pod" && request.kind.group.is_empty();
    if !is_pod || request.operation != Operation::Create || request.sub_resource.is_some() {
        return Ok(response.into_review());
    }
    let Some(object) = &request.object else {
        return Ok(response.into_review());
    };
    let pod = serde_json::to_value(object).map_err(|e| Error::Internal {
        message: format!("cannot serialize the pod: {e}"),
    })?;
    let mutation = mutate(&pod, cfg);
    if let Some(refusal) = mutation.refusal {
        return Ok(response.deny(refusal).into_review());
    }
    if !mutation.warnings.is_empty() {
        response.warnings = Some(mutation.warnings.clone());
    }
    if !mutation.patch.is_empty() {
        response = response
            .with_patch(mutation.json_patch()?)
            .map_err(|e| Error::Internal {
                message: format!("cannot serialize the patch: {e}"),
            })?;
    }
    Ok(response.into_review())
}
