//! The serving certificate, read from PEM files and swapped in when they change.

use crate::error::{Error, Result};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// The serving certificate, read from PEM files and swapped in when they change (a
/// cert-manager renewal rewrites the Secret volume's files in place).
#[derive(Debug)]
pub struct CertReloader {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The PEM bytes `current` came from, to notice a change.
    loaded_from: RwLock<(Vec<u8>, Vec<u8>)>,
}

pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_error(path: &Path, message: String) -> Error {
    Error::Usage {
        flag: "--tls-cert-file/--tls-key-file".into(),
        message: format!("{}: {message}", path.display()),
    }
}

fn certified_key(
    cert_file: &Path,
    key_file: &Path,
    cert: &[u8],
    key: &[u8],
) -> Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| tls_error(cert_file, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(tls_error(cert_file, "holds no certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| tls_error(key_file, format!("not a PEM private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| tls_error(key_file, format!("unusable private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match()
        .map_err(|e| tls_error(key_file, format!("does not match the certificate: {e}")))?;
    Ok(ck)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| tls_error(path, format!("cannot read: {e}")))
}

impl CertReloader {
    /// Load the certificate and key.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the file when either is unreadable, not PEM, or they do not
    /// belong together.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Self> {
        let (cert, key) = (read(cert_file)?, read(key_file)?);
        let ck = certified_key(cert_file, key_file, &cert, &key)?;
        Ok(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(Arc::new(ck)),
            loaded_from: RwLock::new((cert, key)),
        })
    }

    /// Re-read the files; swap the certificate in when they changed and are valid.
    /// `Ok(true)` when a new certificate is now served.
    ///
    /// # Errors
    /// The load error when the files changed but are not usable; the old certificate stays.
    pub fn reload(&self) -> Result<bool> {
        let (cert, key) = (read(&self.cert_file)?, read(&self.key_file)?);
        let unchanged = self
            .loaded_from
            .read()
            .map(|l| l.0 == cert && l.1 == key)
            .unwrap_or(false);
        if unchanged {
            return Ok(false);
        }
        let ck = certified_key(&self.cert_file, &self.key_file, &cert, &key)?;
        if let Ok(mut current) = self.current.write() {
            *current = Arc::new(ck);
        }
        if let Ok(mut from) = self.loaded_from.write() {
            *from = (cert, key);
        }
        Ok(true)
    }
}

impl ResolvesServerCert for CertReloader {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| Arc::clone(&c))
    }
}
