//! The rate limits that spare cache hits, as the cache path runs them:
//! counted only once the cache cannot answer, before the request fetches
//! or waits for a fetch.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::app::App;
use crate::cache::lookup::Admit;
use crate::cache::respond::Answer;
use crate::limits::{Phase, Tally, Who};
use crate::routes::Route;

/// A check that runs only if the cache cannot answer: handed to the cache
/// path, which runs it before it fetches or joins a fetch. Its tallies
/// are kept for the answer.
pub struct Gate {
    pub app: Arc<App>,
    pub route: Arc<Route>,
    pub who: Who,
    tallies: std::sync::Mutex<Vec<Tally>>,
}

impl Gate {
    pub fn new(app: Arc<App>, route: Arc<Route>, who: Who) -> Self {
        Gate {
            app,
            route,
            who,
            tallies: Default::default(),
        }
    }

    /// Counts the request against the limits that spare hits.
    pub async fn admit(&self) -> Result<(), Answer> {
        let t = self
            .app
            .limiter
            .check(&self.route.edge.limits, &self.who, Phase::Fetch)
            .await
            .map_err(crate::http::refusal::answer)?;
        self.tallies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(t);
        Ok(())
    }

    pub fn take_tallies(&self) -> Vec<Tally> {
        std::mem::take(
            &mut *self
                .tallies
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

impl Admit for Gate {
    fn admit(&self) -> BoxFuture<'_, Result<(), Answer>> {
        Box::pin(Gate::admit(self))
    }
}
