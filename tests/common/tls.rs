//! A throwaway PKI for tests of the admission webhook over real TLS: a CA and a serving
//! certificate for `127.0.0.1` (and `localhost`), written as PEM files into a folder.
//!
//! ```ignore
//! let pki = common::tls::TestPki::generate(dir.path());
//! // serve with pki.cert_file / pki.key_file; give the API server pki.ca_pem as caBundle
//! ```

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
    SanType,
};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

/// The files of one test PKI.
pub struct TestPki {
    /// The CA certificate (PEM): the `caBundle` of a webhook configuration, or a client's
    /// trust root.
    pub ca_pem: String,
    pub ca_file: PathBuf,
    /// The serving certificate (PEM), signed by the CA, for 127.0.0.1 and localhost.
    pub cert_file: PathBuf,
    /// Its private key (PEM, PKCS#8).
    pub key_file: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl TestPki {
    /// A new CA and serving certificate in `dir` (`ca.crt`, `tls.crt`, `tls.key`).
    pub fn generate(dir: &Path) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params
            .distinguished_name
            .push(DnType::CommonName, "fabricgate test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
            .expect("self-signed CA");
        let ca_pem = ca.pem();
        let pki = Self {
            ca_file: dir.join("ca.crt"),
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
            ca_pem,
            ca,
        };
        std::fs::write(&pki.ca_file, &pki.ca_pem).expect("write ca.crt");
        pki.issue("fabricgate-webhook");
        pki
    }

    /// Sign a fresh serving certificate (new key) with `common_name` and write it over
    /// `tls.crt`/`tls.key`, as a certificate renewal does. Returns the certificate's DER.
    pub fn issue(&self, common_name: &str) -> Vec<u8> {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned()]).expect("server params");
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let key = KeyPair::generate().expect("server key");
        let issuer: &rcgen::Issuer<'_, KeyPair> = &self.ca;
        let cert = params.signed_by(&key, issuer).expect("sign server cert");
        // Key first, then certificate: a reader between the writes sees a mismatch, which
        // the webhook must survive (it keeps the old pair).
        std::fs::write(&self.key_file, key.serialize_pem()).expect("write tls.key");
        std::fs::write(&self.cert_file, cert.pem()).expect("write tls.crt");
        cert.der().to_vec()
    }

    /// A rustls client configuration that trusts only this CA.
    pub fn client_config(&self) -> std::sync::Arc<rustls::ClientConfig> {
        use rustls_pki_types::CertificateDer;
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(cert.expect("CA PEM")).expect("add CA");
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        std::sync::Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }
}
