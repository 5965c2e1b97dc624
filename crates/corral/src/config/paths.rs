//! Maps a position in the YAML text to the dotted field path of the node there
//! (`routes[1].cache.default_ttl`), so parse errors can name the field they are about.
//! Reads the text only; it never decides whether the document is valid.

use serde_saphyr::granit_parser::{Event, Parser};

/// Whether a recorded node is a mapping key or a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Key,
    Value,
}

/// One node of the document: where it starts and which field it is.
#[derive(Debug, Clone)]
struct Node {
    line: u64,
    column: u64,
    role: Role,
    path: String,
}

/// Every node of the first document that parsed before any syntax error, in document order.
#[derive(Debug, Default)]
pub struct NodePaths {
    nodes: Vec<Node>,
}

/// A collection being walked, with the path of the collection itself.
enum Frame {
    Mapping {
        path: String,
        /// The key whose value comes next; `None` while a key is expected.
        key: Option<String>,
    },
    Sequence {
        path: String,
        next_index: usize,
    },
}

impl NodePaths {
    /// Indexes `text`, stopping quietly at the first syntax error or at the end of the
    /// first document.
    pub fn index(text: &str) -> Self {
        let mut nodes = Vec::new();
        let mut stack: Vec<Frame> = Vec::new();
        for item in Parser::new_from_str(text) {
            let Ok((event, span)) = item else { break };
            // Locations follow serde-saphyr: 1-based line, 1-based character column.
            let line = span.start.line() as u64;
            let column = span.start.col() as u64 + 1;
            let opens = match &event {
                Event::MappingStart(..) => Some(true),
                Event::SequenceStart(..) => Some(false),
                Event::Scalar(..) | Event::Alias(..) => None,
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                    continue;
                }
                Event::DocumentEnd => break,
                _ => continue,
            };
            let (role, path) = match stack.last_mut() {
                None => (Role::Value, String::new()),
                Some(Frame::Sequence { path, next_index }) => {
                    let item_path = format!("{path}[{next_index}]");
                    *next_index += 1;
                    (Role::Value, item_path)
                }
                Some(Frame::Mapping { path, key }) => match key.take() {
                    Some(key) => (Role::Value, join(path, &key)),
                    None => {
                        let name = match &event {
                            Event::Scalar(value, ..) => value.to_string(),
                            // A collection as a key has no field name; keep the walk in step.
                            _ => "?".to_owned(),
                        };
                        let key_path = join(path, &name);
                        *key = Some(name);
                        (Role::Key, key_path)
                    }
                },
            };
            nodes.push(Node {
                line,
                column,
                role,
                path: path.clone(),
            });
            match opens {
                Some(true) => stack.push(Frame::Mapping { path, key: None }),
                Some(false) => stack.push(Frame::Sequence {
                    path,
                    next_index: 0,
                }),
                None => {}
            }
        }
        Self { nodes }
    }

    /// The path of the mapping key that starts exactly at `line:column`.
    pub fn key_at(&self, line: u64, column: u64) -> Option<&str> {
        self.exact(line, column, Role::Key)
    }

    /// The path of the innermost value that starts exactly at `line:column`.
    pub fn value_at(&self, line: u64, column: u64) -> Option<&str> {
        self.exact(line, column, Role::Value)
    }

    /// Where the mapping key with this exact path starts, if the document has one.
    pub fn key_position(&self, path: &str) -> Option<(u64, u64)> {
        self.nodes
            .iter()
            .find(|node| node.role == Role::Key && node.path == path)
            .map(|node| (node.line, node.column))
    }

    /// The path of the last node that starts at or before `line:column`: the best guess
    /// for an error that points between nodes, such as a syntax error.
    pub fn nearest_before(&self, line: u64, column: u64) -> Option<&str> {
        self.nodes
            .iter()
            .rev()
            .find(|node| (node.line, node.column) <= (line, column))
            .map(|node| node.path.as_str())
    }

    fn exact(&self, line: u64, column: u64, role: Role) -> Option<&str> {
        // The last match is the innermost: a block mapping starts where its first key does.
        self.nodes
            .iter()
            .rev()
            .find(|node| node.line == line && node.column == column && node.role == role)
            .map(|node| node.path.as_str())
    }
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
listen: 127.0.0.1:8080
routes:
  - name: api
    cache:
      ttl: 5s
      ignore_query: [a, b]
  - name: web
    coalesce: { lock_timeout: 5s }
";

    #[test]
    fn keys_and_values_get_dotted_paths() {
        let paths = NodePaths::index(DOC);
        assert_eq!(paths.key_at(1, 1), Some("listen"));
        assert_eq!(paths.value_at(1, 9), Some("listen"));
        assert_eq!(paths.key_at(3, 5), Some("routes[0].name"));
        assert_eq!(paths.value_at(3, 5), Some("routes[0]"));
        assert_eq!(paths.value_at(5, 12), Some("routes[0].cache.ttl"));
        assert_eq!(paths.key_at(5, 7), Some("routes[0].cache.ttl"));
        assert_eq!(
            paths.value_at(6, 25),
            Some("routes[0].cache.ignore_query[1]")
        );
        assert_eq!(paths.key_at(8, 17), Some("routes[1].coalesce.lock_timeout"));
        assert_eq!(
            paths.value_at(8, 31),
            Some("routes[1].coalesce.lock_timeout")
        );
        assert_eq!(paths.key_position("routes[0].cache.ttl"), Some((5, 7)));
        assert_eq!(paths.key_position("routes[1].cache"), None);
    }

    #[test]
    fn position_between_nodes_takes_the_preceding_one() {
        let paths = NodePaths::index(DOC);
        assert_eq!(paths.nearest_before(5, 20), Some("routes[0].cache.ttl"));
        assert_eq!(paths.nearest_before(1, 1), Some("listen"));
    }

    #[test]
    fn syntax_error_keeps_what_parsed_before_it() {
        let paths = NodePaths::index("listen: a\nroutes:\n\t- name: x\n");
        assert_eq!(paths.key_at(2, 1), Some("routes"));
        assert_eq!(paths.nearest_before(3, 2), Some("routes"));
    }
}
