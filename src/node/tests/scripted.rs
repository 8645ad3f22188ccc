//! A scripted API server (`tower-test`) for the unit tests of the writers (the Node's, the
//! breaker's, the admission check's): each test answers the requests one by one and checks the
//! method, URL, query and body of each.

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use tower_test::mock::{self, Handle};

/// A client whose every request the returned [`Server`] answers.
pub(crate) fn client() -> (kube::Client, Server) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, "default"), Server(handle))
}

/// The server side of the mock: hands out the requests the client sends, in order.
pub(crate) struct Server(Handle<Request<Body>, Response<Body>>);

/// One request as the server saw it.
pub(crate) struct Seen {
    pub(crate) method: Method,
    pub(crate) path: String,
    /// The query, decoded.
    pub(crate) query: BTreeMap<String, String>,
    pub(crate) content_type: String,
    pub(crate) body: Value,
}

impl Server {
    /// The next request, answered with `status` and `answer` as JSON.
    pub(crate) async fn answer(&mut self, status: u16, answer: Value) -> Seen {
        self.answer_after(|| {}, status, answer).await
    }

    /// [`Self::answer`], with `meanwhile` run once the request has arrived and before it is
    /// answered (a shutdown in the middle of a write, say).
    pub(crate) async fn answer_after(
        &mut self,
        meanwhile: impl FnOnce(),
        status: u16,
        answer: Value,
    ) -> Seen {
        let Some((req, send)) = self.0.next_request().await else {
            panic!("the client sent no further request");
        };
        meanwhile();
        let (parts, body) = req.into_parts();
        let bytes = body.collect().await.expect("request body").to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON body")
        };
        let response = Response::builder()
            .status(StatusCode::from_u16(status).expect("status"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(serde_json::to_vec(&answer).expect("answer")))
            .expect("response");
        send.send_response(response);
        Seen {
            method: parts.method,
            path: parts.uri.path().to_owned(),
            query: parts
                .uri
                .query()
                .map(|q| {
                    q.split('&')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| (decode(k), decode(v)))
                        .collect()
                })
                .unwrap_or_default(),
            content_type: parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned(),
            body,
        }
    }

    /// Nothing more was sent: the client's owner (and with it the client) is gone.
    pub(crate) async fn expect_no_more(mut self) {
        if let Some((req, _)) = self.0.next_request().await {
            panic!("unexpected request {} {}", req.method(), req.uri());
        }
    }
}

/// A `Status` answer of the API server.
pub(crate) fn status(code: u16, reason: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("scripted {reason}"), "reason": reason, "code": code,
    })
}

/// `%XX` escapes and `+` decoded.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).expect("ascii");
                out.push(u8::from_str_radix(hex, 16).expect("an escape"));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("UTF-8")
}
