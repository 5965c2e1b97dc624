//! TLS for tests: a certificate authority made at run time (rcgen), the
//! certificates it signs (for names, expired, for clients), and an https
//! origin on loopback that records the SNI each handshake sent and whether
//! the client showed a certificate.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
    SanType,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A CA and the files of what it signed, written under `dir`.
pub struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Issued {
    /// corral's `listen_tls` value serving this certificate on `addr`.
    pub fn listen_tls(&self, addr: std::net::SocketAddr) -> String {
        format!(
            "{{ addr: {addr}, cert_file: {}, key_file: {} }}",
            self.cert.display(),
            self.key.display()
        )
    }
}

impl Pki {
    /// A new CA named `name`, its certificate at `dir/<name>.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
            .expect("self-signed CA");
        std::fs::write(dir.join(format!("{name}.pem")), ca.pem()).expect("write CA");
        Pki {
            dir: dir.to_owned(),
            ca,
        }
    }

    /// The CA certificate's file.
    pub fn ca_file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.pem"))
    }

    /// A certificate for `names` (host names, or IP addresses), valid now,
    /// or long expired with `expired`.
    pub fn issue(&self, file: &str, names: &[&str], expired: bool) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or(file));
        for n in names {
            params.subject_alt_names.push(match n.parse() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*n).try_into().expect("DNS name")),
            });
        }
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        let issued = Issued {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).expect("write cert");
        std::fs::write(&issued.key, key.serialize_pem()).expect("write key");
        issued
    }
}

/// An https origin: answers every request `200 tls ok`.
pub struct TlsOrigin {
    addr: SocketAddr,
    state: Arc<Seen>,
    _task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Seen {
    sni: Mutex<Vec<Option<String>>>,
    client_certs: AtomicUsize,
    requests: AtomicUsize,
    versions: Mutex<Vec<http::Version>>,
    host_fields: AtomicUsize,
}

impl TlsOrigin {
    /// Serves with `cert`; with `client_ca`, a client certificate signed
    /// by it is required.
    pub async fn start(cert: &Issued, client_ca: Option<&Path>) -> Self {
        Self::serve(cert, client_ca, true).await
    }

    /// An origin whose ALPN offers http/1.1 only.
    pub async fn start_http1(cert: &Issued) -> Self {
        Self::serve(cert, None, false).await
    }

    async fn serve(cert: &Issued, client_ca: Option<&Path>, h2: bool) -> Self {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert.cert)
            .expect("cert file")
            .collect::<Result<_, _>>()
            .expect("certs");
        let key = PrivateKeyDer::from_pem_file(&cert.key).expect("key file");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions");
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca).expect("client CA") {
                    roots.add(c.expect("client CA cert")).expect("add");
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots.into(),
                    provider,
                )
                .build()
                .expect("client verifier");
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).expect("server config");
        config.alpn_protocols = if h2 {
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Seen::default());
        let seen = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    {
                        let (_, conn) = tls.get_ref();
                        super::tls::lock(&seen.sni).push(conn.server_name().map(str::to_owned));
                        if conn.peer_certificates().is_some_and(|c| !c.is_empty()) {
                            seen.client_certs.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let seen2 = Arc::clone(&seen);
                    let service = service_fn(move |req: Request<Incoming>| {
                        seen2.requests.fetch_add(1, Ordering::SeqCst);
                        lock(&seen2.versions).push(req.version());
                        seen2.host_fields.fetch_add(
                            req.headers().get_all("host").iter().count(),
                            Ordering::SeqCst,
                        );
                        async {
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("tls ok"))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
                });
            }
        });
        TlsOrigin {
            addr,
            state,
            _task: task,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The SNI of each completed handshake (None: none sent).
    pub fn sni(&self) -> Vec<Option<String>> {
        lock(&self.state.sni).clone()
    }

    /// Handshakes in which the client showed a certificate.
    pub fn client_certs(&self) -> usize {
        self.state.client_certs.load(Ordering::SeqCst)
    }

    /// The HTTP version of each request.
    pub fn versions(&self) -> Vec<http::Version> {
        lock(&self.state.versions).clone()
    }

    /// Host fields seen, over all requests.
    pub fn host_fields(&self) -> usize {
        self.state.host_fields.load(Ordering::SeqCst)
    }

    /// Requests answered.
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }
}

impl Drop for TlsOrigin {
    fn drop(&mut self) {
        self._task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a TLS client saw: the protocol ALPN chose, the answer, and the
/// server's certificate.
#[derive(Debug)]
pub struct TlsAnswer {
    pub alpn: Option<Vec<u8>>,
    /// The interim (1xx) answers before the final one, as statuses.
    pub interim: Vec<u16>,
    pub status: u16,
    pub body: String,
    pub server_cert: Vec<u8>,
}

/// GETs `path` from `addr` over TLS, trusting `ca_file`, naming
/// `server_name`, offering `alpn` (`h2` is then spoken if chosen).
pub async fn tls_get(
    addr: SocketAddr,
    ca_file: &Path,
    server_name: &str,
    alpn: &[&[u8]],
    path: &str,
) -> Result<TlsAnswer, String> {
    use http_body_util::BodyExt;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca_file).map_err(|e| e.to_string())? {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (_, conn) = tls.get_ref();
    let negotiated = conn.alpn_protocol().map(<[u8]>::to_vec);
    let server_cert = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .unwrap_or_default();
    let mut req = Request::get(format!("https://{server_name}{path}"))
        .header("host", server_name)
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let interim = Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let interim = Arc::clone(&interim);
        hyper::ext::on_informational(&mut req, move |res| {
            interim
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(res.status().as_u16());
        });
    }
    if negotiated.as_deref() == Some(b"h2") {
        // hyper's h2 client drops 1xx answers; the h2 crate's reports them.
        let got = crate::h2_client::h2_get(tls, "https", server_name, path).await?;
        return Ok(TlsAnswer {
            alpn: negotiated,
            interim: got.interim_statuses(),
            status: got.status,
            body: got.text(),
            server_cert,
        });
    }
    let res = {
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        send.send_request(req).await.map_err(|e| e.to_string())?
    };
    let status = res.status().as_u16();
    let body = res
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let interim = interim.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(TlsAnswer {
        alpn: negotiated,
        interim,
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
        server_cert,
    })
}

/// The DER of the first certificate in a PEM file.
pub fn cert_der(pem_file: &Path) -> Vec<u8> {
    CertificateDer::pem_file_iter(pem_file)
        .expect("cert file")
        .next()
        .expect("a certificate")
        .expect("PEM")
        .as_ref()
        .to_vec()
}
