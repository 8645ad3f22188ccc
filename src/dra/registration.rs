//! Each DRA driver's kubelet plugin followed through its registration socket (docs/dra.md):
//! a connection is held open to it, and when it ends and the socket refuses a new one (a
//! killed plugin leaves its socket file with nobody listening), or answers again, the probe
//! loop probes at once. The probe's own socket check still decides; this only makes a dead
//! driver known within a second instead of at the next interval probe.
//!
//! The plugin's gRPC server closes a connection that never sends the HTTP/2 preface after its
//! handshake timeout (grpc-go: 120 s); a new one is made then, without a probe.

use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::sync::watch;

/// How long to wait before trying a socket that refused, or is not there, again.
const RETRY: Duration = Duration::from_secs(1);

/// Follows every driver's registration socket in `dir` until `kick` has no receiver; bumps
/// `kick` whenever a driver's plugin stops or starts answering.
pub async fn follow(dir: PathBuf, drivers: Vec<String>, kick: watch::Sender<u64>) {
    let tasks: Vec<_> = drivers
        .into_iter()
        .map(|driver| tokio::spawn(follow_one(dir.clone(), driver, kick.clone())))
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// The driver's sockets in `dir`: `<driver>-reg.sock` first, then any `<driver>-<uid>-reg.sock`.
fn sockets(dir: &Path, driver: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    fabricgate_probes::host::registration_sockets(&names, driver)
        .into_iter()
        .map(|n| dir.join(n))
        .collect()
}

enum Plugin {
    /// Connected: held until it ends.
    Answers(UnixStream),
    /// Someone listens but its backlog is full (`EAGAIN`): alive, nothing to hold.
    Busy,
    /// Absent, or nobody listens.
    Gone,
}

async fn connect(dir: &Path, driver: &str) -> Plugin {
    let mut busy = false;
    for path in sockets(dir, driver) {
        match UnixStream::connect(&path).await {
            Ok(stream) => return Plugin::Answers(stream),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => busy = true,
            Err(_) => {}
        }
    }
    if busy { Plugin::Busy } else { Plugin::Gone }
}

/// Until the connection ends: the server's bytes (its HTTP/2 settings) are read and dropped.
async fn until_closed(stream: UnixStream) {
    let mut buf = [0u8; 512];
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

async fn follow_one(dir: PathBuf, driver: String, kick: watch::Sender<u64>) {
    // Whether the plugin answered when last tried; the first state is the probe's to find.
    let mut answering: Option<bool> = None;
    loop {
        if kick.is_closed() {
            return;
        }
        let plugin = connect(&dir, &driver).await;
        let now = !matches!(plugin, Plugin::Gone);
        if answering.is_some_and(|before| before != now) {
            if now {
                tracing::info!(
                    driver,
                    "DRA plugin answers on its registration socket again"
                );
            } else {
                tracing::warn!(
                    driver,
                    dir = %dir.display(),
                    "DRA plugin's registration socket stopped answering; probing now"
                );
            }
            kick.send_modify(|k| *k = k.wrapping_add(1));
        }
        answering = Some(now);
        match plugin {
            Plugin::Answers(stream) => until_closed(stream).await,
            Plugin::Busy | Plugin::Gone => tokio::time::sleep(RETRY).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    async fn kicked(rx: &mut watch::Receiver<u64>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// A plugin that dies (its listener closed, the socket file left) and comes back: one kick
    /// each, none while it just keeps answering or stays dead.
    #[tokio::test]
    async fn a_plugin_dying_and_coming_back_kicks_the_probe_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dra.net-reg.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, mut rx) = watch::channel(0u64);
        let task = tokio::spawn(follow(dir.path().to_owned(), vec!["dra.net".into()], tx));
        // Connected and quiet: no kick for the first state.
        assert!(
            tokio::time::timeout(Duration::from_millis(1500), rx.changed())
                .await
                .is_err(),
            "kicked while the plugin answered"
        );
        drop(listener);
        assert!(kicked(&mut rx).await, "no kick when the plugin died");
        assert_eq!(*rx.borrow_and_update(), 1);
        assert!(
            tokio::time::timeout(Duration::from_millis(2500), rx.changed())
                .await
                .is_err(),
            "kicked again while the plugin stayed dead"
        );
        std::fs::remove_file(&path).unwrap();
        let _back = UnixListener::bind(&path).unwrap();
        assert!(kicked(&mut rx).await, "no kick when the plugin came back");
        assert_eq!(*rx.borrow_and_update(), 2);
        drop(rx);
        task.abort();
    }

    #[test]
    fn sockets_prefer_the_plain_name_and_ignore_other_drivers() {
        let dir = tempfile::tempdir().unwrap();
        let uid = "0b6c4a3e-1f2d-4c5b-8a9e-0123456789ab";
        for name in [
            format!("dra.net-{uid}-reg.sock"),
            "dra.net-reg.sock".into(),
            "dra.net.example-reg.sock".into(),
        ] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let found: Vec<String> = sockets(dir.path(), "dra.net")
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            found,
            [
                "dra.net-reg.sock".to_owned(),
                format!("dra.net-{uid}-reg.sock")
            ]
        );
    }
}
