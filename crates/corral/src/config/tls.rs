//! TLS to an upstream (`upstream: https://…` and its route's `tls:`),
//! built once per load from the files the route names, so a bad file is
//! refused with its line and field, and a reload reads them anew.
//!
//! rustls with the *ring* provider: it builds with the C compiler every
//! machine here has (aws-lc-rs needs cmake and a longer build), and it is
//! what the rest of the Rust HTTP stack is tested with. Server
//! certificates are verified by default against the platform's roots
//! (rustls-native-certs: `/etc/ssl/certs` on Debian, so a CA an operator
//! installs with `update-ca-certificates` is trusted, as it is by curl and
//! nginx), or against `ca_file` alone when given. A host with no platform
//! roots and no `ca_file` is refused at load rather than failing every
//! request.

use std::sync::{Arc, LazyLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// An https upstream's TLS settings, ready to connect with.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    pub config: Arc<ClientConfig>,
    /// Sent as SNI and verified in place of the upstream's host.
    pub server_name: Option<ServerName<'static>>,
    pub insecure_skip_verify: bool,
}

/// What a route's `tls:` says, with the files already read.
pub struct TlsFiles {
    pub ca: Option<Vec<u8>>,
    pub client_cert: Option<Vec<u8>>,
    pub client_key: Option<Vec<u8>>,
    pub server_name: Option<String>,
    pub insecure_skip_verify: bool,
}

/// Which field a refusal is about, and why.
pub struct TlsError {
    pub field: &'static str,
    pub message: String,
}

fn err(field: &'static str, message: impl Into<String>) -> TlsError {
    TlsError {
        field,
        message: message.into(),
    }
}

/// The certificates of a PEM file named by `field`: at least one.
fn certificates(pem: &[u8], field: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(field, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(err(field, "holds no PEM certificate"));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The platform's roots, read once.
static PLATFORM_ROOTS: LazyLock<Result<RootCertStore, String>> = LazyLock::new(|| {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_owned(), ToString::to_string);
        return Err(format!("no platform root certificates ({why})"));
    }
    Ok(roots)
});

pub fn build(files: &TlsFiles) -> Result<UpstreamTls, TlsError> {
    let server_name = match &files.server_name {
        None => None,
        Some(n) => Some(ServerName::try_from(n.trim().to_owned()).map_err(|_| {
            err(
                "server_name",
                format!("`{n}` is not a host name or address"),
            )
        })?),
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| err("", e.to_string()))?;
    let builder = if files.insecure_skip_verify {
        if files.ca.is_some() {
            return Err(err(
                "insecure_skip_verify",
                "is set beside ca_file: choose one (the CA would never be checked)",
            ));
        }
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider())))
    } else {
        let roots = match &files.ca {
            Some(pem) => {
                let mut roots = RootCertStore::empty();
                for c in certificates(pem, "ca_file")? {
                    roots
                        .add(c)
                        .map_err(|e| err("ca_file", format!("a certificate is unusable: {e}")))?;
                }
                roots
            }
            None => PLATFORM_ROOTS.clone().map_err(|m| {
                err(
                    "ca_file",
                    format!("{m}: give tls.ca_file, or install the ca-certificates package"),
                )
            })?,
        };
        builder.with_root_certificates(roots)
    };
    let config = match (&files.client_cert, &files.client_key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            let chain = certificates(cert, "client_cert")?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|e| err("client_key", format!("no PEM private key: {e}")))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| err("client_key", format!("does not fit client_cert: {e}")))?
        }
        (Some(_), None) => return Err(err("client_key", "client_cert needs client_key")),
        (None, Some(_)) => return Err(err("client_cert", "client_key needs client_cert")),
    };
    Ok(UpstreamTls {
        config: Arc::new(config),
        server_name,
        insecure_skip_verify: files.insecure_skip_verify,
    })
}

/// `insecure_skip_verify: true`: any certificate is accepted (the
/// handshake's signatures are still checked, so the connection is at
/// least encrypted to whoever answered).
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The listener's certificate and key (`listen_tls`), checked: a PEM
/// chain and its private key, offered with ALPN h2 and http/1.1.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<rustls::ServerConfig, TlsError> {
    let chain = certificates(cert_pem, "cert_file")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| err("key_file", format!("no PEM private key: {e}")))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| err("", e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| err("key_file", format!("does not fit cert_file: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
