//! TLS on the client listener (`listen_tls`): rustls with ALPN h2 and
//! http/1.1, and a certificate that follows its files. Every second the
//! certificate and key files are read; when their bytes change and they
//! make a valid pair, new connections get the new certificate (connections
//! already open keep theirs). A bad pair (cert-manager mid-rotation, a
//! typo) is logged and the running certificate stays.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::ListenTls;

/// How often the files are looked at.
const POLL: Duration = Duration::from_secs(1);

pub struct ListenerTls {
    current: ArcSwap<rustls::ServerConfig>,
    cert_file: PathBuf,
    key_file: PathBuf,
}

impl ListenerTls {
    /// Loads the pair (the configuration loader checked it a moment ago).
    pub fn load(config: &ListenTls) -> anyhow::Result<Arc<Self>> {
        let (cert, key) = read(&config.cert_file, &config.key_file)?;
        let server = crate::config::tls::server_config(&cert, &key)
            .map_err(|e| anyhow::anyhow!("listen_tls.{}: {}", e.field, e.message))?;
        Ok(Arc::new(ListenerTls {
            current: ArcSwap::from_pointee(server),
            cert_file: config.cert_file.clone(),
            key_file: config.key_file.clone(),
        }))
    }

    /// The acceptor for a new connection: the certificate of this moment.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.load_full())
    }

    /// Watches the files for as long as the listener lives.
    pub fn spawn_watch(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let Some(tls) = me.upgrade() else { return };
                match read(&tls.cert_file, &tls.key_file) {
                    Ok((cert, key)) => {
                        let seen = crate::config::fingerprint(&[cert.as_slice(), &key].concat());
                        if last.is_some_and(|l| l != seen) {
                            match crate::config::tls::server_config(&cert, &key) {
                                Ok(server) => {
                                    tls.current.store(Arc::new(server));
                                    tracing::info!(cert_file = %tls.cert_file.display(), "listen_tls certificate reloaded");
                                }
                                Err(e) => {
                                    tracing::error!(field = e.field, error = %e.message, "listen_tls: the new certificate files are not a valid pair; keeping the running certificate")
                                }
                            }
                        }
                        last = Some(seen);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "listen_tls: cannot read the certificate files; keeping the running certificate")
                    }
                }
                drop(tls);
                tokio::time::sleep(POLL).await;
            }
        });
    }
}

fn read(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    use anyhow::Context as _;
    Ok((
        std::fs::read(cert).with_context(|| format!("cannot read {}", cert.display()))?,
        std::fs::read(key).with_context(|| format!("cannot read {}", key.display()))?,
    ))
}
