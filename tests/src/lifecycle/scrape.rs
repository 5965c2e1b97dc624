//! Reads Prometheus exposition text (`/metrics`) into samples a test can
//! query by name and a subset of labels, whatever order the labels render in.
//!
//! Only the sample lines are read (`# HELP` / `# TYPE` are skipped); it never
//! interprets a metric's type.

use std::collections::BTreeMap;

/// One sample line: `name{a="x",b="y"} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Metric name, with any `_bucket` / `_sum` / `_count` suffix.
    pub name: String,
    /// Label names to values (unescaped).
    pub labels: BTreeMap<String, String>,
    /// The sample value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
}

impl Sample {
    /// Whether every `(name, value)` of `subset` is one of this sample's labels.
    pub fn has_labels(&self, subset: &[(&str, &str)]) -> bool {
        subset
            .iter()
            .all(|(k, v)| self.labels.get(*k).is_some_and(|have| have == v))
    }
}

/// One scrape of `/metrics`: its samples and the text they came from.
#[derive(Clone, Debug)]
pub struct Scrape {
    text: String,
    samples: Vec<Sample>,
}

impl Scrape {
    /// Parses exposition text; an unreadable sample line is an error naming it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(|line| parse_sample(line).ok_or_else(|| format!("unreadable sample: {line:?}")))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            text: text.to_owned(),
            samples,
        })
    }

    /// The text as scraped, for failure messages.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every sample.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The samples named `name` whose labels include `labels`.
    pub fn matching(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| s.name == name && s.has_labels(labels))
            .collect()
    }

    /// The sum of the samples named `name` whose labels include `labels`
    /// (0 when there are none, as for a counter never incremented).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).iter().map(|s| s.value).sum()
    }

    /// The value of the one sample named `name` whose labels include
    /// `labels`; `None` when there is none. Fails the test when several
    /// match (the label subset was ambiguous).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found = self.matching(name, labels);
        assert!(
            found.len() <= 1,
            "{name} with labels {labels:?} matches {} samples: {found:?}",
            found.len()
        );
        found.first().map(|s| s.value)
    }

    /// Whether any sample is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }
}

fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    // A timestamp may follow the value.
    let value = rest.split_whitespace().next()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value: parse_value(value)?,
    })
}

/// Reads `a="x",b="y"}` into `labels`; returns what follows the `}`.
fn parse_labels<'a>(mut rest: &'a str, labels: &mut BTreeMap<String, String>) -> Option<&'a str> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some(after);
        }
        let (key, after_eq) = rest.split_once('=')?;
        let quoted = after_eq.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let close = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                other => value.push(other),
            }
        };
        labels.insert(key.trim().to_owned(), value);
        rest = quoted[close + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

fn parse_value(token: &str) -> Option<f64> {
    match token {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        other => other.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE corral_requests_total counter
corral_requests_total{route=\"api\",method=\"GET\",cache=\"miss\"} 1
corral_requests_total{cache=\"hit\",method=\"GET\",route=\"api\"} 2
corral_requests_total{route=\"api\",method=\"POST\",cache=\"pass\"} 1

corral_l1_entries 3
corral_flight_waiters_bucket{le=\"+Inf\"} 4
corral_stampede_top_waiters{key=\"api GET h/a?q=\\\"x\\\",y\\\\z\"} 99 1700000000
";

    #[test]
    fn labels_match_as_a_subset_in_any_order() {
        let scrape = Scrape::parse(TEXT).expect("parses");
        assert_eq!(
            scrape.value(
                "corral_requests_total",
                &[("cache", "hit"), ("route", "api")]
            ),
            Some(2.0)
        );
        assert_eq!(
            scrape.sum("corral_requests_total", &[("method", "GET")]),
            3.0
        );
        assert_eq!(scrape.sum("corral_requests_total", &[("route", "x")]), 0.0);
        assert_eq!(scrape.value("corral_l1_entries", &[]), Some(3.0));
        assert_eq!(
            scrape.value("corral_flight_waiters_bucket", &[("le", "+Inf")]),
            Some(4.0)
        );
    }

    #[test]
    fn escaped_label_values_and_timestamps_are_read() {
        let scrape = Scrape::parse(TEXT).expect("parses");
        assert_eq!(
            scrape.value(
                "corral_stampede_top_waiters",
                &[("key", "api GET h/a?q=\"x\",y\\z")]
            ),
            Some(99.0)
        );
    }

    #[test]
    fn a_broken_line_is_reported() {
        let error = Scrape::parse("ok 1\nbroken{a=\"x} 1\n").expect_err("refused");
        assert!(error.contains("broken"), "{error}");
    }

    #[test]
    #[should_panic(expected = "matches 3 samples")]
    fn an_ambiguous_value_fails() {
        let scrape = Scrape::parse(TEXT).expect("parses");
        let _ = scrape.value("corral_requests_total", &[("route", "api")]);
    }
}
