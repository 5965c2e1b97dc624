//! An HTTP/2 client that reports what hyper's drops: the interim (1xx)
//! answers before the final one, with their fields, in the order they
//! came. Speaks over any stream: h2c with prior knowledge over TCP, or
//! TLS once ALPN chose h2.

use std::future::poll_fn;

use http::HeaderMap;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::wait::DEADLINE;

/// One exchange as the client saw it.
#[derive(Debug)]
pub struct H2Answer {
    /// Each interim answer's status and fields, in order.
    pub interim: Vec<(u16, HeaderMap)>,
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl H2Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The interim answers' statuses.
    pub fn interim_statuses(&self) -> Vec<u16> {
        self.interim.iter().map(|(s, _)| *s).collect()
    }
}

/// GETs `scheme://authority/path` over `io`, within [`DEADLINE`].
pub async fn h2_get<I>(io: I, scheme: &str, authority: &str, path: &str) -> Result<H2Answer, String>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    H2Connection::open(io, scheme, authority)
        .await?
        .get(path)
        .await
}

/// One HTTP/2 connection, for requests that share it.
#[derive(Clone)]
pub struct H2Connection {
    send: h2::client::SendRequest<bytes::Bytes>,
    base: String,
}

fn err(e: h2::Error) -> String {
    e.to_string()
}

impl H2Connection {
    /// The handshake over `io`, within [`DEADLINE`]; the connection is
    /// driven by a task of its own.
    pub async fn open<I>(io: I, scheme: &str, authority: &str) -> Result<Self, String>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, connection) = tokio::time::timeout(DEADLINE, h2::client::handshake(io))
            .await
            .map_err(|_| "no handshake within the deadline".to_owned())?
            .map_err(err)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(H2Connection {
            send,
            base: format!("{scheme}://{authority}"),
        })
    }

    /// GETs `path`, within [`DEADLINE`].
    pub async fn get(&self, path: &str) -> Result<H2Answer, String> {
        let uri = format!("{}{path}", self.base);
        tokio::time::timeout(DEADLINE, exchange(self.send.clone(), uri))
            .await
            .map_err(|_| "no answer within the deadline".to_owned())?
    }
}

async fn exchange(
    send: h2::client::SendRequest<bytes::Bytes>,
    uri: String,
) -> Result<H2Answer, String> {
    let mut send = send.ready().await.map_err(err)?;
    let req = http::Request::get(uri)
        .body(())
        .map_err(|e| e.to_string())?;
    let (mut response, _) = send.send_request(req, true).map_err(err)?;
    let mut interim = Vec::new();
    // Ready(None) once the final answer's head is next.
    while let Some(res) = poll_fn(|cx| response.poll_informational(cx)).await {
        let res = res.map_err(err)?;
        interim.push((res.status().as_u16(), res.headers().clone()));
    }
    let res = response.await.map_err(err)?;
    let status = res.status().as_u16();
    let (parts, mut recv) = res.into_parts();
    let mut body = Vec::new();
    while let Some(data) = recv.data().await {
        let data = data.map_err(err)?;
        let _ = recv.flow_control().release_capacity(data.len());
        body.extend_from_slice(&data);
    }
    Ok(H2Answer {
        interim,
        status,
        headers: parts.headers,
        body,
    })
}
