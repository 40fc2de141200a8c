//! `moeshard inspect`: what a user needs to know about a GGUF file before splitting it across
//! machines: architecture and hyperparameters, tokenizer, the tensor table, and where the bytes
//! are (by type, per layer split into dense weights and routed experts, per expert). One
//! [`Report`] is built from the model and rendered either as readable tables or as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use gguf::{Array, GgufModel, Value};
use serde::Serialize;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The GGUF file (any file of a split model finds the others).
    pub file: PathBuf,
    /// Print machine-readable JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also list every metadata entry (long arrays summarized).
    #[arg(long)]
    pub metadata: bool,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let model = GgufModel::open(&args.file)?;
    let report = Report::build(&model);
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        out.write_all(report.render(args.metadata).as_bytes())?;
    }
    Ok(())
}

/// Hyperparameters shown when present, as `<arch>.<suffix>`.
const HYPERPARAMETERS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_count",
    "expert_shared_feed_forward_length",
    "expert_gating_func",
    "expert_weights_scale",
    "expert_weights_norm",
    "expert_group_count",
    "expert_group_used_count",
    "leading_dense_block_count",
    "nextn_predict_layers",
    "attention.q_lora_rank",
    "attention.kv_lora_rank",
    "attention.key_length_mla",
    "attention.value_length_mla",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_log_multiplier",
    "vocab_size",
];

/// Name parts of routed-expert tensors: `blk.N.ffn_{gate,up,down,gate_up}_exps.*`.
const ROUTED_EXPERT_TENSORS: &[&str] = &[
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_up_exps",
];

/// Arrays longer than this are summarized (type and length) rather than listed.
const MAX_LISTED_ITEMS: usize = 64;

#[derive(Serialize)]
struct Report {
    files: Vec<FileSummary>,
    fingerprint: String,
    architecture: Option<String>,
    name: Option<String>,
    hyperparameters: BTreeMap<String, serde_json::Value>,
    tokenizer: TokenizerSummary,
    total_bytes: u64,
    tensors: Vec<TensorRow>,
    bytes_by_type: Vec<TypeTotal>,
    non_layer_tensors: Vec<NamedBytes>,
    non_layer_bytes: u64,
    layers: Vec<LayerBytes>,
    dense_layer_bytes: u64,
    routed_expert_bytes: u64,
    expert_count: Option<u64>,
    metadata: Vec<MetadataEntry>,
}

#[derive(Serialize)]
struct FileSummary {
    path: String,
    version: u32,
    file_bytes: u64,
    tensors: usize,
    metadata_entries: usize,
}

#[derive(Serialize, Default)]
struct TokenizerSummary {
    model: Option<String>,
    pre: Option<String>,
    vocab_size: Option<usize>,
    merges: Option<usize>,
    bos_token_id: Option<u64>,
    eos_token_id: Option<u64>,
}

#[derive(Serialize)]
struct TensorRow {
    name: String,
    #[serde(rename = "type")]
    dtype: String,
    shape: Vec<u64>,
    bytes: u64,
    split: usize,
    /// Absolute byte offset in its split file.
    offset: u64,
}

#[derive(Serialize)]
struct TypeTotal {
    #[serde(rename = "type")]
    dtype: String,
    tensors: usize,
    bytes: u64,
}

#[derive(Serialize)]
struct NamedBytes {
    name: String,
    bytes: u64,
}

#[derive(Serialize, Default)]
struct LayerBytes {
    layer: u64,
    dense_bytes: u64,
    routed_expert_bytes: u64,
    /// Routed-expert bytes of the layer ÷ expert_count.
    per_expert_bytes: Option<u64>,
}

#[derive(Serialize)]
struct MetadataEntry {
    key: String,
    #[serde(rename = "type")]
    value_type: String,
    value: serde_json::Value,
}

/// Where a tensor's bytes count: a layer's dense weights, its routed experts, or outside layers.
enum Placement {
    Dense(u64),
    RoutedExperts(u64),
    NonLayer,
}

fn placement(name: &str) -> Placement {
    let Some((layer, rest)) = name
        .strip_prefix("blk.")
        .and_then(|s| s.split_once('.'))
        .and_then(|(n, rest)| Some((n.parse::<u64>().ok()?, rest)))
    else {
        return Placement::NonLayer;
    };
    let base = rest.split('.').next().unwrap_or_default();
    if ROUTED_EXPERT_TENSORS.contains(&base) {
        Placement::RoutedExperts(layer)
    } else {
        Placement::Dense(layer)
    }
}

impl Report {
    fn build(model: &GgufModel) -> Self {
        let metadata = model.metadata();
        let architecture = metadata.arch().ok().map(str::to_string);
        let hyperparameters = match &architecture {
            Some(arch) => HYPERPARAMETERS
                .iter()
                .filter_map(|suffix| {
                    let value = metadata.get(&format!("{arch}.{suffix}"))?;
                    Some((suffix.to_string(), json_value(value)))
                })
                .collect(),
            None => BTreeMap::new(),
        };
        let expert_count = metadata
            .arch_u64_opt("expert_count")
            .ok()
            .flatten()
            .filter(|&n| n > 0);

        let mut tensors = Vec::with_capacity(model.tensor_count());
        let mut by_type: BTreeMap<gguf::GgmlType, (usize, u64)> = BTreeMap::new();
        let mut layers: BTreeMap<u64, LayerBytes> = BTreeMap::new();
        let mut non_layer_tensors = Vec::new();
        for tensor in model.tensors() {
            let info = tensor.info;
            tensors.push(TensorRow {
                name: info.name.clone(),
                dtype: info.dtype.to_string(),
                shape: info.shape.to_vec(),
                bytes: info.n_bytes,
                split: tensor.split,
                offset: info.file_offset,
            });
            let type_total = by_type.entry(info.dtype).or_default();
            type_total.0 += 1;
            type_total.1 += info.n_bytes;
            match placement(&info.name) {
                Placement::Dense(layer) => {
                    layer_entry(&mut layers, layer).dense_bytes += info.n_bytes
                }
                Placement::RoutedExperts(layer) => {
                    layer_entry(&mut layers, layer).routed_expert_bytes += info.n_bytes;
                }
                Placement::NonLayer => {
                    non_layer_tensors.push(NamedBytes {
                        name: info.name.clone(),
                        bytes: info.n_bytes,
                    });
                }
            }
        }
        let layers: Vec<LayerBytes> = layers
            .into_values()
            .map(|mut layer| {
                layer.per_expert_bytes = expert_count
                    .filter(|_| layer.routed_expert_bytes > 0)
                    .map(|n| layer.routed_expert_bytes / n);
                layer
            })
            .collect();

        Report {
            files: model
                .splits()
                .iter()
                .map(|file| FileSummary {
                    path: file.path().display().to_string(),
                    version: file.version(),
                    file_bytes: file.file_len(),
                    tensors: file.tensors().len(),
                    metadata_entries: file.metadata().len(),
                })
                .collect(),
            fingerprint: model.fingerprint().to_string(),
            name: metadata
                .get_str("general.name")
                .ok()
                .flatten()
                .map(str::to_string),
            architecture,
            hyperparameters,
            tokenizer: tokenizer_summary(metadata),
            total_bytes: tensors.iter().map(|t| t.bytes).sum(),
            tensors,
            bytes_by_type: by_type
                .into_iter()
                .map(|(dtype, (tensors, bytes))| TypeTotal {
                    dtype: dtype.to_string(),
                    tensors,
                    bytes,
                })
                .collect(),
            non_layer_bytes: non_layer_tensors.iter().map(|t| t.bytes).sum(),
            non_layer_tensors,
            dense_layer_bytes: layers.iter().map(|l| l.dense_bytes).sum(),
            routed_expert_bytes: layers.iter().map(|l| l.routed_expert_bytes).sum(),
            layers,
            expert_count,
            metadata: metadata
                .iter()
                .map(|(key, value)| MetadataEntry {
                    key: key.to_string(),
                    value_type: value.type_description(),
                    value: json_value(value),
                })
                .collect(),
        }
    }

    fn render(&self, with_metadata: bool) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; the results are discarded on purpose.
        let _ = self.render_into(&mut out, with_metadata);
        out
    }

    fn render_into(&self, out: &mut String, with_metadata: bool) -> std::fmt::Result {
        for file in &self.files {
            writeln!(out, "file          {}", file.path)?;
            writeln!(
                out,
                "              GGUF v{}, {}, {} tensors, {} metadata entries",
                file.version,
                human_bytes(file.file_bytes),
                file.tensors,
                file.metadata_entries
            )?;
        }
        writeln!(out, "fingerprint   {}", self.fingerprint)?;
        let arch = self.architecture.as_deref().unwrap_or("(not set)");
        writeln!(out, "architecture  {arch}")?;
        if let Some(name) = &self.name {
            writeln!(out, "name          {name}")?;
        }

        section(out, "Hyperparameters")?;
        let keys: Vec<String> = self
            .hyperparameters
            .keys()
            .map(|s| format!("{arch}.{s}"))
            .collect();
        let width = keys.iter().map(String::len).max().unwrap_or(0);
        for (key, value) in keys.iter().zip(self.hyperparameters.values()) {
            writeln!(out, "  {key:<width$}  {}", compact_json(value))?;
        }

        section(out, "Tokenizer")?;
        let t = &self.tokenizer;
        let or_unset = |v: &Option<String>| v.clone().unwrap_or_else(|| "(not set)".into());
        writeln!(
            out,
            "  model {}, pre {}",
            or_unset(&t.model),
            or_unset(&t.pre)
        )?;
        let count = |n: Option<usize>| n.map_or_else(|| "(none)".into(), |n| n.to_string());
        writeln!(
            out,
            "  vocab {} tokens, {} merges",
            count(t.vocab_size),
            count(t.merges)
        )?;

        let total = human_bytes(self.total_bytes);
        section(out, &format!("Tensors: {}, {total}", self.tensors.len()))?;
        self.render_tensor_table(out)?;

        section(out, "Bytes by type")?;
        for total in &self.bytes_by_type {
            let bytes = human_bytes(total.bytes);
            writeln!(
                out,
                "  {:<8} {:>6} tensors  {bytes}",
                total.dtype, total.tensors
            )?;
        }

        section(out, "Outside layers")?;
        let width = self
            .non_layer_tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(0)
            .max(5);
        for tensor in &self.non_layer_tensors {
            writeln!(
                out,
                "  {:<width$}  {}",
                tensor.name,
                human_bytes(tensor.bytes)
            )?;
        }
        writeln!(
            out,
            "  {:<width$}  {}",
            "total",
            human_bytes(self.non_layer_bytes)
        )?;

        self.render_layers(out)?;

        if with_metadata {
            section(out, "Metadata")?;
            for entry in &self.metadata {
                let value = truncate(&compact_json(&entry.value), 100);
                writeln!(out, "  {:<44} {:<16} {value}", entry.key, entry.value_type)?;
            }
        }
        Ok(())
    }

    fn render_tensor_table(&self, out: &mut String) -> std::fmt::Result {
        let multi_split = self.files.len() > 1;
        let shapes: Vec<String> = self
            .tensors
            .iter()
            .map(|t| format!("{:?}", t.shape))
            .collect();
        let sizes: Vec<String> = self.tensors.iter().map(|t| human_bytes(t.bytes)).collect();
        let name_width = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(0)
            .max(4);
        let shape_width = shapes.iter().map(String::len).max().unwrap_or(0).max(5);
        let size_width = sizes.iter().map(String::len).max().unwrap_or(0).max(5);
        writeln!(
            out,
            "  {:<name_width$}  {:<8}  {:<shape_width$}  {:>size_width$}  offset",
            "name", "type", "shape", "bytes"
        )?;
        for ((tensor, shape), size) in self.tensors.iter().zip(&shapes).zip(&sizes) {
            let split = if multi_split {
                format!(" (split {})", tensor.split + 1)
            } else {
                String::new()
            };
            writeln!(
                out,
                "  {:<name_width$}  {:<8}  {shape:<shape_width$}  {size:>size_width$}  {}{split}",
                tensor.name, tensor.dtype, tensor.offset
            )?;
        }
        Ok(())
    }

    fn render_layers(&self, out: &mut String) -> std::fmt::Result {
        let experts = self
            .expert_count
            .map_or_else(String::new, |n| format!(", {n} experts"));
        section(
            out,
            &format!("Bytes per layer ({} layers{experts})", self.layers.len()),
        )?;
        if self.layers.is_empty() {
            return writeln!(out, "  (no blk.N tensors)");
        }
        let header = ["layer", "dense", "routed experts", "per expert"].map(String::from);
        let body = self.layers.iter().map(|l| {
            [
                l.layer.to_string(),
                human_bytes(l.dense_bytes),
                dash_if_zero(l.routed_expert_bytes),
                l.per_expert_bytes.map_or_else(|| "-".into(), human_bytes),
            ]
        });
        let total = [
            "total".into(),
            human_bytes(self.dense_layer_bytes),
            dash_if_zero(self.routed_expert_bytes),
            String::new(),
        ];
        let rows: Vec<[String; 4]> = std::iter::once(header)
            .chain(body)
            .chain(std::iter::once(total))
            .collect();
        let width = |i: usize| rows.iter().map(|r| r[i].len()).max().unwrap_or(0);
        let (w0, w1, w2, w3) = (width(0), width(1), width(2), width(3));
        for [layer, dense, routed, per_expert] in &rows {
            writeln!(
                out,
                "  {layer:<w0$}  {dense:>w1$}  {routed:>w2$}  {per_expert:>w3$}"
            )?;
        }
        Ok(())
    }
}

fn layer_entry(layers: &mut BTreeMap<u64, LayerBytes>, layer: u64) -> &mut LayerBytes {
    layers.entry(layer).or_insert_with(|| LayerBytes {
        layer,
        ..LayerBytes::default()
    })
}

fn tokenizer_summary(metadata: &gguf::Metadata) -> TokenizerSummary {
    let string = |key: &str| metadata.get_str(key).ok().flatten().map(str::to_string);
    let length = |key: &str| metadata.get_array(key).ok().flatten().map(Array::len);
    let id = |key: &str| metadata.get_u64(key).ok().flatten();
    TokenizerSummary {
        model: string("tokenizer.ggml.model"),
        pre: string("tokenizer.ggml.pre"),
        vocab_size: length("tokenizer.ggml.tokens"),
        merges: length("tokenizer.ggml.merges"),
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_id: id("tokenizer.ggml.eos_token_id"),
    }
}

fn section(out: &mut String, title: &str) -> std::fmt::Result {
    writeln!(out, "\n{title}")
}

/// `28.69 MiB (30081024 B)`; plain bytes below 1 KiB.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut scaled = n as f64 / 1024.0;
    let mut unit = 0;
    while scaled >= 1024.0 && unit + 1 < UNITS.len() {
        scaled /= 1024.0;
        unit += 1;
    }
    format!("{scaled:.2} {} ({n} B)", UNITS[unit])
}

fn dash_if_zero(n: u64) -> String {
    if n == 0 { "-".into() } else { human_bytes(n) }
}

fn truncate(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_string(),
    }
}

fn compact_json(value: &serde_json::Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// A metadata value as JSON; arrays longer than [`MAX_LISTED_ITEMS`] become
/// `{"type": ..., "len": ...}` so a vocabulary does not flood the output. Non-finite floats
/// become `null`.
fn json_value(value: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        Value::U8(v) => J::from(*v),
        Value::I8(v) => J::from(*v),
        Value::U16(v) => J::from(*v),
        Value::I16(v) => J::from(*v),
        Value::U32(v) => J::from(*v),
        Value::I32(v) => J::from(*v),
        Value::U64(v) => J::from(*v),
        Value::I64(v) => J::from(*v),
        Value::F32(v) => J::from(widen(*v)),
        Value::F64(v) => J::from(*v),
        Value::Bool(v) => J::from(*v),
        Value::String(s) => J::from(s.as_str()),
        Value::Array(array) => json_array(array),
    }
}

/// The f64 whose shortest decimal form is the f32's (1e-5, not 9.999999747378752e-6).
fn widen(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::NAN)
}

fn json_array(array: &Array) -> serde_json::Value {
    use serde_json::Value as J;
    if array.len() > MAX_LISTED_ITEMS {
        return serde_json::json!({ "type": array.type_description(), "len": array.len() });
    }
    let items: Vec<J> = match array {
        Array::U8(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::I8(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::U16(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::I16(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::U32(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::I32(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::U64(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::I64(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::F32(v) => v.iter().map(|&x| J::from(widen(x))).collect(),
        Array::F64(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::Bool(v) => v.iter().map(|&x| J::from(x)).collect(),
        Array::String(v) => v.iter().map(J::from).collect(),
        Array::Array(v) => v.iter().map(json_array).collect(),
    };
    J::Array(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_placed_by_name() {
        assert!(matches!(
            placement("blk.3.ffn_up_exps.weight"),
            Placement::RoutedExperts(3)
        ));
        assert!(matches!(
            placement("blk.12.ffn_gate_up_exps.bias"),
            Placement::RoutedExperts(12)
        ));
        assert!(matches!(
            placement("blk.3.ffn_up_shexp.weight"),
            Placement::Dense(3)
        ));
        assert!(matches!(
            placement("blk.0.ffn_gate_inp.weight"),
            Placement::Dense(0)
        ));
        assert!(matches!(
            placement("blk.x.attn_q.weight"),
            Placement::NonLayer
        ));
        assert!(matches!(
            placement("token_embd.weight"),
            Placement::NonLayer
        ));
        assert!(matches!(
            placement("output_norm.weight"),
            Placement::NonLayer
        ));
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(1536), "1.50 KiB (1536 B)");
        assert_eq!(human_bytes(30_081_024), "28.69 MiB (30081024 B)");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB (3221225472 B)");
    }
}
