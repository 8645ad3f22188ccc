//! Authentication of the side channel: the pool's shared keys (a file, re-read by path so a
//! Kubernetes Secret volume's `..data` swap is picked up without a restart), the session
//! transcript that binds both sides' fresh nonces into every frame's HMAC-SHA256, and the
//! random numbers.
//!
//! A session's MAC input is `"fabricgate-peer-v2" | direction | sequence | client nonce |
//! responder nonce | the frame's first 224 bytes`; the tag fills the frame's last 32 bytes.
//! A recorded session cannot be replayed (the other side's nonce is new), frames cannot be
//! reordered or reflected (direction and sequence), and the comparison is ring's constant-time
//! `hmac::verify`.

use super::{FRAME_LEN, MAC_AT};
use crate::error::{ProbeError, Result};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of a key's public identifier (HMAC of a fixed text under the key).
pub const KEY_ID_LEN: usize = 8;
/// Keys one file may hold (the current one first; the others accepted during a rotation).
pub const MAX_KEYS: usize = 4;
/// Shortest key accepted, in bytes (32 hex digits); `openssl rand -hex 32` gives 32 bytes.
pub const MIN_KEY_BYTES: usize = 16;
/// The key file is looked at again at most this often (by path: a Secret volume swaps a
/// `..data` symlink, so the file's inode changes and a watch on it would see nothing).
pub const KEY_RELOAD: Duration = Duration::from_secs(1);
/// Larger key files are refused (four keys of 64 hex digits are 260 bytes).
const MAX_FILE: u64 = 4096;
const LABEL: &[u8] = b"fabricgate-peer-v2";

pub(super) type KeyId = [u8; KEY_ID_LEN];

#[derive(Clone)]
struct Key {
    id: KeyId,
    mac: hmac::Key,
}

/// The keys of the pool, current first. Its `Debug` shows key ids only, never a key.
#[derive(Clone)]
pub struct Keys {
    keys: Vec<Key>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|k| hex(&k.id)))
            .finish()
    }
}

impl Keys {
    /// Keys from raw bytes, current first (tests and benches).
    pub fn from_secrets(secrets: &[&[u8]]) -> Self {
        Self {
            keys: secrets.iter().map(|s| key(s)).collect(),
        }
    }

    /// The key file's text: one key per line as hex digits (at least 32), the current one
    /// first; blank lines and `#` comments are ignored; at most [`MAX_KEYS`].
    ///
    /// # Errors
    /// What is wrong, without quoting the file (it holds secrets).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bytes = unhex(line).ok_or_else(|| {
                format!(
                    "line {}: not a key (hex digits, e.g. from `openssl rand -hex 32`)",
                    n + 1
                )
            })?;
            if bytes.len() < MIN_KEY_BYTES {
                return Err(format!(
                    "line {}: a key of {} bytes is too short (at least {MIN_KEY_BYTES}: \
                     `openssl rand -hex 32`)",
                    n + 1,
                    bytes.len()
                ));
            }
            keys.push(key(&bytes));
        }
        if keys.is_empty() {
            return Err("holds no key (create one with `openssl rand -hex 32`)".into());
        }
        if keys.len() > MAX_KEYS {
            return Err(format!(
                "holds {} keys; at most {MAX_KEYS} (the current one first, then the ones \
                 still accepted during a rotation)",
                keys.len()
            ));
        }
        Ok(Self { keys })
    }

    /// Identifiers of the keys, current first (what a client offers in OPEN).
    pub(super) fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.iter().map(|k| k.id)
    }

    /// The first of our keys (current first) that `offered` names.
    pub(super) fn pick(&self, offered: &[KeyId]) -> Option<(KeyId, hmac::Key)> {
        self.keys
            .iter()
            .find(|k| offered.contains(&k.id))
            .map(|k| (k.id, k.mac.clone()))
    }

    pub(super) fn by_id(&self, id: &KeyId) -> Option<hmac::Key> {
        self.keys
            .iter()
            .find(|k| &k.id == id)
            .map(|k| k.mac.clone())
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn key(secret: &[u8]) -> Key {
    let mac = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let tag = hmac::sign(&mac, b"fabricgate-peer key id");
    let mut id = [0u8; KEY_ID_LEN];
    id.copy_from_slice(&tag.as_ref()[..KEY_ID_LEN]);
    Key { id, mac }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The key file, re-read by path at most every [`KEY_RELOAD`] when sessions ask for the keys.
/// A re-read that fails (the file briefly missing, or edited into something invalid) keeps
/// the keys in use and is reported once by [`KeyRing::take_reload_error`].
#[derive(Debug)]
pub struct KeyRing {
    path: Option<PathBuf>,
    state: Mutex<RingState>,
}

#[derive(Debug)]
struct RingState {
    keys: Arc<Keys>,
    /// The file's bytes when last loaded, to see a change.
    loaded: Vec<u8>,
    checked: Instant,
    error: Option<String>,
    generation: u64,
}

impl KeyRing {
    /// Read and parse the key file at `path`.
    ///
    /// # Errors
    /// [`ProbeError::PeerKey`] naming the path and what is wrong.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = read_bounded(path)?;
        let keys = parse_file(path, &bytes)?;
        Ok(Self {
            path: Some(path.to_owned()),
            state: Mutex::new(RingState {
                keys: Arc::new(keys),
                loaded: bytes,
                checked: Instant::now(),
                error: None,
                generation: 0,
            }),
        })
    }

    /// Fixed keys, never reloaded (tests, benches).
    pub fn fixed(keys: Keys) -> Self {
        Self {
            path: None,
            state: Mutex::new(RingState {
                keys: Arc::new(keys),
                loaded: Vec::new(),
                checked: Instant::now(),
                error: None,
                generation: 0,
            }),
        }
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The keys to use now; looks at the file again when the last look is older than
    /// [`KEY_RELOAD`].
    pub fn keys(&self) -> Arc<Keys> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(path) = &self.path
            && st.checked.elapsed() >= KEY_RELOAD
        {
            st.checked = Instant::now();
            match read_bounded(path).and_then(|b| parse_file(path, &b).map(|k| (b, k))) {
                Ok((bytes, keys)) => {
                    if bytes != st.loaded {
                        st.keys = Arc::new(keys);
                        st.loaded = bytes;
                        st.generation += 1;
                    }
                    st.error = None;
                }
                Err(e) => {
                    let message = format!("{e}; still using the keys loaded before");
                    if st.error.as_deref() != Some(&message) {
                        st.error = Some(message);
                    }
                }
            }
        }
        Arc::clone(&st.keys)
    }

    /// How many times a changed key file has been loaded since start.
    pub fn generation(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .generation
    }

    /// The last reload failure, once.
    pub fn take_reload_error(&self) -> Option<String> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .error
            .take()
    }
}

fn read_bounded(path: &Path) -> Result<Vec<u8>> {
    let bad = |message: String| ProbeError::PeerKey {
        path: path.to_owned(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read: {e}")))?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(bad(format!("larger than {MAX_FILE} bytes; not a key file")));
    }
    Ok(bytes)
}

fn parse_file(path: &Path, bytes: &[u8]) -> Result<Keys> {
    let bad = |message: String| ProbeError::PeerKey {
        path: path.to_owned(),
        message,
    };
    let text = std::str::from_utf8(bytes).map_err(|_| bad("not text".into()))?;
    Keys::parse(text).map_err(bad)
}

/// Fresh random bytes from the system (getrandom).
pub(super) fn random<const N: usize>() -> Option<[u8; N]> {
    let mut out = [0u8; N];
    SystemRandom::new().fill(&mut out).ok()?;
    Some(out)
}

/// Which side sent a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Responder,
}

/// One session's MAC state: the key both sides agreed on, both nonces, and the next sequence
/// number in each direction.
pub struct Transcript {
    key: hmac::Key,
    client_nonce: [u8; NONCE_LEN],
    responder_nonce: [u8; NONCE_LEN],
    me: Side,
    sent: u8,
    received: u8,
}

impl Transcript {
    fn new_with(
        key: hmac::Key,
        client_nonce: [u8; NONCE_LEN],
        responder_nonce: [u8; NONCE_LEN],
        me: Side,
    ) -> Self {
        Self {
            key,
            client_nonce,
            responder_nonce,
            me,
            sent: 0,
            received: 0,
        }
    }

    pub(super) fn new(
        key: hmac::Key,
        client_nonce: [u8; NONCE_LEN],
        responder_nonce: [u8; NONCE_LEN],
        me: Side,
    ) -> Self {
        Self::new_with(key, client_nonce, responder_nonce, me)
    }

    /// A transcript under the current key of `keys` (benches: the MAC work of a session).
    pub fn for_bench(
        keys: &Keys,
        client_nonce: [u8; NONCE_LEN],
        responder_nonce: [u8; NONCE_LEN],
        me: Side,
    ) -> Option<Self> {
        let key = keys.keys.first()?.mac.clone();
        Some(Self::new_with(key, client_nonce, responder_nonce, me))
    }

    fn input(&self, from: Side, seq: u8, frame: &[u8; FRAME_LEN]) -> Vec<u8> {
        let mut data = Vec::with_capacity(LABEL.len() + 2 + 2 * NONCE_LEN + MAC_AT);
        data.extend_from_slice(LABEL);
        data.push(match from {
            Side::Client => b'C',
            Side::Responder => b'R',
        });
        data.push(seq);
        data.extend_from_slice(&self.client_nonce);
        data.extend_from_slice(&self.responder_nonce);
        data.extend_from_slice(&frame[..MAC_AT]);
        data
    }

    /// Put our next MAC into `frame`'s last 32 bytes.
    pub fn seal(&mut self, mut frame: [u8; FRAME_LEN]) -> [u8; FRAME_LEN] {
        let tag = hmac::sign(&self.key, &self.input(self.me, self.sent, &frame));
        frame[MAC_AT..].copy_from_slice(tag.as_ref());
        self.sent = self.sent.wrapping_add(1);
        frame
    }

    /// Whether `frame` carries the other side's next MAC (constant-time comparison).
    pub fn verify(&mut self, frame: &[u8; FRAME_LEN]) -> bool {
        let from = match self.me {
            Side::Client => Side::Responder,
            Side::Responder => Side::Client,
        };
        let ok = hmac::verify(
            &self.key,
            &self.input(from, self.received, frame),
            &frame[MAC_AT..],
        )
        .is_ok();
        self.received = self.received.wrapping_add(1);
        ok
    }
}
