//! `localnet up`'s report: what `report.json` holds and the summary prints.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The report of a local run, written as `report.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpReport {
    /// The model's name as every party loads it (a preset, or a JSON file).
    pub model: String,
    pub stages: u32,
    /// Epochs trained.
    pub epochs: u64,
    /// Held-out loss of the initial weights.
    pub initial_loss: f32,
    /// Held-out loss after each trained epoch.
    pub loss_per_epoch: Vec<f32>,
    pub initial_perplexity: f32,
    pub perplexity_per_epoch: Vec<f32>,
    /// The grammar corpus's entropy floor; none on real text.
    pub entropy_floor: Option<f64>,
    /// The prepared dataset's manifest BLAKE3; none on the grammar corpus.
    pub dataset: Option<String>,
    /// A sample of the last epoch's weights, on real text.
    pub generation: Option<Generation>,
    /// The final weights' export folder.
    pub export: String,
    pub partitions: PartitionCounts,
    /// Tokens trained in the trained epochs.
    pub tokens: u64,
    pub wire_bytes_per_token: f64,
    /// What the same boundary tensors take in f32, per token.
    pub fp32_bytes_per_token: u64,
    pub weights_set: Vec<WeightsSet>,
    pub neurons: Vec<NeuronRow>,
    /// The loss curve's PNG.
    pub plot: String,
}

/// Text the last epoch's weights wrote after a prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub epoch: u64,
    pub prompt: String,
    pub text: String,
}

/// Partitions of the trained epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionCounts {
    pub total: u64,
    pub merged: u64,
    /// Merged with every result agreeing on one hash.
    pub agreeing: u64,
}

/// A validator's weights that count the last trained epoch, landed in a block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightsSet {
    /// The validator's hotkey (SS58).
    pub validator: String,
    pub block: Option<u64>,
    pub epoch: Option<u64>,
    pub state: String,
}

/// One neuron of the subnet: who it is and what the chain and the validators made of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NeuronRow {
    pub uid: Option<u16>,
    pub hotkey: String,
    pub name: String,
    /// `validator` or `miner`.
    pub role: String,
    /// The cheating behaviour, for the adversary.
    pub adversary: Option<String>,
    /// Its score summed over the scored epochs, averaged over the validators that scored it.
    pub score: Option<f64>,
    /// Yuma incentive in [0, 1].
    pub incentive: Option<f64>,
    pub emission: Option<u64>,
}

impl UpReport {
    /// Writes the report as pretty JSON. It goes through `serde_json::Value` so that the file
    /// keeps the layout it had when it was built as a JSON value: keys sorted, and the f32
    /// losses widened to f64.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let value = serde_json::to_value(self)?;
        std::fs::write(path, serde_json::to_vec_pretty(&value)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The summary printed after a run.
    pub fn print_summary(&self, report_path: &Path) {
        let (initial, losses) = (self.initial_loss, &self.loss_per_epoch);
        println!("\nsummary after {} epochs:", self.epochs);
        println!(
            "  held-out loss {initial:.3} -> {} ({})",
            losses
                .iter()
                .map(|l| format!("{l:.3}"))
                .collect::<Vec<_>>()
                .join(" -> "),
            match self.entropy_floor {
                Some(f) => format!("entropy floor {f:.3}"),
                None => format!(
                    "perplexity {:.1} -> {:.1}",
                    initial.exp(),
                    losses.last().copied().unwrap_or(initial).exp()
                ),
            }
        );
        let p = self.partitions;
        println!(
            "  partitions: {} total, {} merged, {} by agreement",
            p.total, p.merged, p.agreeing
        );
        println!(
            "  {} tokens, {:.1} wire bytes/token vs {} in f32",
            self.tokens, self.wire_bytes_per_token, self.fp32_bytes_per_token
        );
        for n in &self.neurons {
            println!(
                "  {:<22} uid {} score {:>10} incentive {:.4}",
                n.name,
                // As the line has always shown it: a number, or `null` (unpadded).
                n.uid.map_or("null".to_owned(), |u| u.to_string()),
                n.score.map_or("-".to_owned(), |s| format!("{s:.1}")),
                n.incentive.unwrap_or(0.0)
            );
        }
        println!("report: {}", report_path.display());
        println!("loss plot: {}", self.plot);
        println!(
            "final weights: {} (`iota model generate --checkpoint {} --prompt …`)",
            self.export, self.export
        );
        if let Some(g) = &self.generation {
            println!(
                "sample after epoch {}: prompt {:?}, continuation {:?}",
                g.epoch, g.prompt, g.text
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> UpReport {
        UpReport {
            model: "tiny".into(),
            stages: 3,
            epochs: 2,
            initial_loss: 2.5,
            loss_per_epoch: vec![2.25, 2.125],
            initial_perplexity: 2.5f32.exp(),
            perplexity_per_epoch: vec![2.25f32.exp(), 2.125f32.exp()],
            entropy_floor: Some(1.5),
            dataset: None,
            generation: None,
            export: "/run/model".into(),
            partitions: PartitionCounts {
                total: 8,
                merged: 8,
                agreeing: 7,
            },
            tokens: 1000,
            wire_bytes_per_token: 12.5,
            fp32_bytes_per_token: 256,
            weights_set: vec![WeightsSet {
                validator: "5V".into(),
                block: Some(40),
                epoch: Some(1),
                state: "revealed".into(),
            }],
            neurons: vec![NeuronRow {
                uid: Some(1),
                hotkey: "5M".into(),
                name: "miner0".into(),
                role: "miner".into(),
                adversary: None,
                score: Some(3.0),
                incentive: Some(0.5),
                emission: Some(7),
            }],
            plot: "/run/report.png".into(),
        }
    }

    #[test]
    fn the_report_file_has_the_documented_keys_and_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("report.json");
        let report = report();
        report.write(&path).expect("written");
        let text = std::fs::read_to_string(&path).expect("read");
        let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let keys: Vec<&str> = value
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        // Sorted, as the file has always been.
        assert_eq!(
            keys,
            [
                "dataset",
                "entropy_floor",
                "epochs",
                "export",
                "fp32_bytes_per_token",
                "generation",
                "initial_loss",
                "initial_perplexity",
                "loss_per_epoch",
                "model",
                "neurons",
                "partitions",
                "perplexity_per_epoch",
                "plot",
                "stages",
                "tokens",
                "weights_set",
                "wire_bytes_per_token",
            ]
        );
        assert!(value["generation"].is_null() && value["dataset"].is_null());
        assert_eq!(value["neurons"][0]["adversary"], serde_json::Value::Null);
        assert_eq!(value["partitions"]["agreeing"], 7);
        let back: UpReport = serde_json::from_str(&text).expect("reads back");
        assert_eq!(back, report);
    }
}
