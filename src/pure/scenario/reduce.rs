//! Reductions of a scenario's YAML for `kvrelay shrink` (`crate::shrink`): the document as a YAML value, and the
//! ordered list of one-step-smaller candidates (drop a request, halve its tokens, merge chunks, halve TP/PP/DCP,
//! halve the layers, drop a state component, a fault rule, ...).
//!
//! A candidate is only a proposal: it may not load (a DCP that no longer divides TP, a chunk split that no longer
//! sums); the shrinker lowers each one with [`super::parse`] and keeps only those that load and still fail the same
//! way. Mappings keep their key order, so the same document always gives the same candidates and the same text.

use serde_yaml_ng::{Mapping, Value};

/// A scenario document being reduced.
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    root: Mapping,
}

/// One proposed reduction: what it does, in words, and the reduced document.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub what: String,
    pub draft: Draft,
}

fn key(name: &str) -> Value {
    Value::String(name.to_owned())
}

fn number(value: Option<&Value>) -> Option<u64> {
    value.and_then(Value::as_u64)
}

fn numbers(value: Option<&Value>) -> Option<Vec<u64>> {
    value?.as_sequence()?.iter().map(Value::as_u64).collect()
}

fn sequence(values: &[u64]) -> Value {
    Value::Sequence(values.iter().map(|value| Value::Number((*value).into())).collect())
}

/// Why a scenario's text is not a draft.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DraftError {
    #[error("the scenario is not a YAML mapping")]
    NotMapping,
    #[error("the scenario is not YAML: {reason}")]
    NotYaml { reason: String },
}

error_kinds! {
    /// The kind of a [`DraftError`].
    pub enum DraftErrorKind {
        /// YAML whose root is not a mapping.
        NotMapping = "not_mapping",
        /// Text that does not parse as YAML.
        NotYaml = "not_yaml",
    }
}

impl DraftError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> DraftErrorKind {
        match self {
            DraftError::NotMapping => DraftErrorKind::NotMapping,
            DraftError::NotYaml { .. } => DraftErrorKind::NotYaml,
        }
    }
}

impl Draft {
    /// The document of `text` (already loaded once as a scenario, so bounded); it must be a mapping.
    pub fn parse(text: &str) -> Result<Draft, DraftError> {
        match serde_yaml_ng::from_str::<Value>(text) {
            Ok(Value::Mapping(root)) => Ok(Draft { root }),
            Ok(_) => Err(DraftError::NotMapping),
            Err(error) => Err(DraftError::NotYaml { reason: error.to_string() }),
        }
    }

    /// The document as YAML text (block style, keys in their original order).
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(&Value::Mapping(self.root.clone())).unwrap_or_default()
    }

    /// Sets a top-level scalar field (`seed`, `name`), keeping its place when it exists, first otherwise.
    pub fn set_first(&mut self, field: &str, value: Value) {
        if let Some(slot) = self.root.get_mut(field) {
            *slot = value;
            return;
        }
        let mut root = Mapping::new();
        root.insert(key(field), value);
        root.extend(std::mem::take(&mut self.root));
        self.root = root;
    }

    /// Sets `seed`.
    pub fn set_seed(&mut self, seed: u64) {
        self.set_first("seed", Value::Number(seed.into()));
    }

    /// Sets `name`.
    pub fn set_name(&mut self, name: &str) {
        self.set_first("name", Value::String(name.to_owned()));
    }

    fn with(&self, what: String, edit: impl FnOnce(&mut Mapping) -> Option<()>) -> Option<Candidate> {
        let mut root = self.root.clone();
        edit(&mut root)?;
        (root != self.root).then(|| Candidate { what, draft: Draft { root } })
    }

    /// Every one-step reduction of this document, coarse first; `layer_count` and `kv_layers` are the model's as
    /// lowered (a preset's when the file gives none).
    pub fn candidates(&self, layer_count: u32, kv_layers: &[u32]) -> Vec<Candidate> {
        let mut res = Vec::new();
        self.request_drops(&mut res);
        self.fault_drops(&mut res);
        self.topology(&mut res);
        self.layers(&mut res, layer_count, kv_layers);
        self.model_parts(&mut res);
        self.request_parts(&mut res);
        self.side_parts(&mut res);
        res
    }

    fn request_count(&self) -> usize {
        self.root.get("requests").and_then(Value::as_sequence).map_or(0, Vec::len)
    }

    fn request_drops(&self, res: &mut Vec<Candidate>) {
        let count = self.request_count();
        if count < 2 {
            return;
        }
        let keep = |range: std::ops::Range<usize>, what: String| {
            self.with(what, |root| {
                let requests = root.get_mut("requests")?.as_sequence_mut()?;
                *requests = requests[range].to_vec();
                Some(())
            })
        };
        if count >= 4 {
            let half = count / 2;
            res.extend(keep(0..half, format!("keep requests 0..{half}")));
            res.extend(keep(half..count, format!("keep requests {half}..{count}")));
        }
        for index in 0..count {
            res.extend(self.with(format!("drop request {index}"), |root| {
                root.get_mut("requests")?.as_sequence_mut()?.remove(index);
                Some(())
            }));
        }
    }

    fn fault_drops(&self, res: &mut Vec<Candidate>) {
        let Some(faults) = self.root.get("faults").and_then(Value::as_sequence) else { return };
        for index in 0..faults.len() {
            res.extend(self.with(format!("drop fault rule {index}"), |root| {
                let faults = root.get_mut("faults")?.as_sequence_mut()?;
                faults.remove(index);
                if faults.is_empty() {
                    root.remove("faults");
                }
                Some(())
            }));
        }
        for (index, fault) in faults.iter().enumerate() {
            let Some(probability) = fault.get("probability").and_then(Value::as_f64) else { continue };
            if probability <= 0.001 {
                continue;
            }
            // Decimal halving keeps the written probabilities short (0.02 -> 0.01 -> 0.005).
            let lower = format!("{:.6}", probability / 2.0).trim_end_matches('0').to_owned();
            let Ok(lower) = lower.parse::<f64>() else { continue };
            res.extend(self.with(format!("halve fault rule {index}'s probability to {lower}"), |root| {
                let faults = root.get_mut("faults")?.as_sequence_mut()?;
                faults.get_mut(index)?.as_mapping_mut()?.insert(key("probability"), Value::from(lower));
                Some(())
            }));
        }
    }

    fn side(&self, side: &str, field: &str) -> u64 {
        number(self.root.get(side).and_then(|it| it.get(field))).unwrap_or(1)
    }

    fn topology(&self, res: &mut Vec<Candidate>) {
        let set = |root: &mut Mapping, side: &str, field: &str, value: u64| -> Option<()> {
            let side = root.get_mut(side)?.as_mapping_mut()?;
            if value == 1 {
                side.remove(field);
            } else {
                side.insert(key(field), Value::Number(value.into()));
            }
            Some(())
        };
        let (prefill_pp, decode_pp) = (self.side("prefill", "pp"), self.side("decode", "pp"));
        if prefill_pp > 1 && decode_pp == prefill_pp {
            res.extend(self.with(format!("halve PP on both sides to {}", prefill_pp / 2), |root| {
                set(root, "prefill", "pp", prefill_pp / 2)?;
                set(root, "decode", "pp", decode_pp / 2)
            }));
        }
        if decode_pp > 1 {
            res.extend(self.with("decode PP 1".to_owned(), |root| set(root, "decode", "pp", 1)));
        }
        if prefill_pp > 1 {
            res.extend(self.with(format!("halve prefill PP to {}", prefill_pp / 2), |root| {
                set(root, "prefill", "pp", prefill_pp / 2)
            }));
        }
        for side in ["prefill", "decode"] {
            let (tp, dcp) = (self.side(side, "tp"), self.side(side, "dcp"));
            if tp > 1 {
                let half = tp / 2;
                res.extend(self.with(format!("halve {side} TP to {half}"), |root| {
                    set(root, side, "tp", half)?;
                    set(root, side, "dcp", dcp.min(half))
                }));
            }
            if dcp > 1 {
                res.extend(
                    self.with(format!("halve {side} DCP to {}", dcp / 2), |root| set(root, side, "dcp", dcp / 2)),
                );
            }
        }
    }

    fn layers(&self, res: &mut Vec<Candidate>, layer_count: u32, kv_layers: &[u32]) {
        if layer_count < 2 {
            return;
        }
        let layers = u64::from(layer_count / 2);
        let below = |value: &mut Value| {
            if let Some(ids) = numbers(Some(value)) {
                *value = sequence(&ids.into_iter().filter(|id| *id < layers).collect::<Vec<_>>());
            }
        };
        res.extend(self.with(format!("halve the layers to {layers}"), |root| {
            let model = root.get_mut("model")?.as_mapping_mut()?;
            model.insert(key("layers"), Value::Number(layers.into()));
            // A preset's own KV layers, written out: with `layers` given, the loader would make every layer KV.
            let kv = model
                .entry(key("kv_layers"))
                .or_insert_with(|| sequence(&kv_layers.iter().map(|id| u64::from(*id)).collect::<Vec<_>>()));
            below(kv);
            for component in model.get_mut("state").and_then(Value::as_sequence_mut).into_iter().flatten() {
                component.get_mut("layers").map(below);
            }
            for side in ["prefill", "decode"] {
                root.get_mut(side).and_then(|it| it.get_mut("missing_layers")).map(below);
            }
            Some(())
        }));
    }

    fn model_parts(&self, res: &mut Vec<Candidate>) {
        let Some(model) = self.root.get("model").and_then(Value::as_mapping) else { return };
        if let Some(state) = model.get("state").and_then(Value::as_sequence) {
            for index in 0..state.len() {
                res.extend(self.with(format!("drop state component {index}"), |root| {
                    root.get_mut("model")?.get_mut("state")?.as_sequence_mut()?.remove(index);
                    Some(())
                }));
            }
        } else if model.contains_key("preset") {
            res.extend(self.with("drop the preset's state components".to_owned(), |root| {
                root.get_mut("model")?.as_mapping_mut()?.insert(key("state"), Value::Sequence(Vec::new()));
                Some(())
            }));
        }
        for field in ["aux", "draft"] {
            res.extend(self.with(format!("drop model.{field}"), |root| {
                root.get_mut("model")?.as_mapping_mut()?.remove(field).map(|_| ())
            }));
        }
    }

    fn request_parts(&self, res: &mut Vec<Candidate>) {
        for index in 0..self.request_count() {
            let Some(request) = self.root.get("requests").and_then(|it| it.get(index)) else { continue };
            let edit = |what: String, change: &dyn Fn(&mut Mapping) -> Option<()>| {
                self.with(format!("request {index}: {what}"), |root| {
                    let requests = root.get_mut("requests")?.as_sequence_mut()?;
                    change(requests.get_mut(index)?.as_mapping_mut()?)
                })
            };
            let chunks = numbers(request.get("chunks")).unwrap_or_default();
            if chunks.len() > 1 {
                res.extend(edit("one chunk".to_owned(), &|request| request.remove("chunks").map(|_| ())));
                res.extend(edit("merge its last two chunks".to_owned(), &|request| {
                    let mut merged = chunks.clone();
                    let last = merged.pop()?;
                    *merged.last_mut()? += last;
                    request.insert(key("chunks"), sequence(&merged));
                    Some(())
                }));
            }
            let tokens = number(request.get("tokens")).unwrap_or(0);
            for (what, fewer) in [("halve", tokens / 2), ("three quarters of", tokens - tokens / 4)] {
                if fewer == 0 || fewer >= tokens {
                    continue;
                }
                res.extend(edit(format!("{what} its tokens ({tokens} -> {fewer})"), &|request| {
                    scale_request(request, tokens, fewer)
                }));
            }
            for field in [
                "decode_prefix",
                "cached_prefix",
                "state_pages",
                "prefill_pages",
                "decode_pages",
                "decode_page_count",
                "decode_host_pages",
            ] {
                if request.get(field).is_some() {
                    res.extend(edit(format!("drop {field}"), &|request| request.remove(field).map(|_| ())));
                }
            }
        }
    }

    fn side_parts(&self, res: &mut Vec<Candidate>) {
        for side in ["prefill", "decode"] {
            for field in ["pool_pages", "slots"] {
                res.extend(self.with(format!("drop {side}.{field}"), |root| {
                    root.get_mut(side)?.as_mapping_mut()?.remove(field).map(|_| ())
                }));
            }
        }
        res.extend(self.with("drop events".to_owned(), |root| root.remove("events").map(|_| ())));
    }
}

/// Scales one request from `tokens` to `fewer` tokens: its decode prefix and cached prefix in proportion, its chunks
/// cut to the shorter send range (the leading ones kept whole), its explicit page lists dropped (the allocator hands
/// out pages again).
fn scale_request(request: &mut Mapping, tokens: u64, fewer: u64) -> Option<()> {
    let prefix = number(request.get("decode_prefix")).unwrap_or(0);
    let new_prefix = prefix * fewer / tokens;
    request.insert(key("tokens"), Value::Number(fewer.into()));
    if prefix > 0 {
        request.insert(key("decode_prefix"), Value::Number(new_prefix.into()));
    }
    if let Some(cached) = number(request.get("cached_prefix")) {
        request.insert(key("cached_prefix"), Value::Number((cached * fewer / tokens).into()));
    }
    if let Some(chunks) = numbers(request.get("chunks")) {
        let new_send = fewer.checked_sub(new_prefix)?;
        if new_send == 0 {
            return None;
        }
        // Whole leading chunks while they fit, then the remainder: chunk boundaries stay page-aligned.
        let (mut scaled, mut left) = (Vec::new(), new_send);
        for chunk in chunks {
            if left == 0 {
                break;
            }
            scaled.push(chunk.min(left));
            left -= chunk.min(left);
        }
        if scaled.len() > 1 {
            request.insert(key("chunks"), sequence(&scaled));
        } else {
            request.remove("chunks");
        }
    }
    for field in ["prefill_pages", "decode_pages", "decode_page_count", "state_pages", "decode_host_pages"] {
        request.remove(field);
    }
    Some(())
}
