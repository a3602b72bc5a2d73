//! `iota validator` flags (every flag also from the environment).

use std::time::Duration;

use iota_chain::cli::SubtensorArgs;
use iota_chain::wallet::cli::WalletArgs;

use crate::replay::ReplayThresholds;
use crate::service::ValidatorConfig;

/// Flags shared by the validator's commands.
#[derive(Clone, Debug, clap::Args)]
pub struct ValidatorArgs {
    /// The validator's wallet (the hotkey signs requests and weights).
    #[command(flatten)]
    pub wallet: WalletArgs,
    /// Chain endpoint selection.
    #[command(flatten)]
    pub subtensor: SubtensorArgs,
    /// Subnet.
    #[arg(long, env = "BT_NETUID", default_value_t = 9)]
    pub netuid: u16,
    /// The orchestrator's base URL.
    #[arg(
        long = "orchestrator.url",
        env = "IOTA_ORCHESTRATOR_URL",
        default_value = "http://127.0.0.1:8700"
    )]
    pub orchestrator_url: String,
    /// The validator's PostgreSQL database.
    #[arg(long = "database.url", env = "IOTA_VALIDATOR_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Miners replayed per epoch (0: all).
    #[arg(
        long = "replays-per-epoch",
        env = "IOTA_REPLAYS_PER_EPOCH",
        default_value_t = 4
    )]
    pub replays_per_epoch: usize,
    /// Cut each replayed micro-batch into this many runs of sequences, replayed side by side,
    /// one per core: on a CPU of 2 cores or more, 2 is faster than 1 (`BENCHMARKS.md`,
    /// cpu-vs-torch). Unless the environment chooses, `iota validator run` then runs
    /// element-wise operations on one thread each.
    #[arg(long = "sub-batches", env = "IOTA_SUB_BATCHES", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub sub_batches: u16,
    /// Merged partitions re-derived per epoch (0: all).
    #[arg(
        long = "merges-per-epoch",
        env = "IOTA_MERGES_PER_EPOCH",
        default_value_t = 4
    )]
    pub merges_per_epoch: usize,
    /// Smallest cosine of a replayed tensor that passes.
    #[arg(long = "min-cosine", env = "IOTA_MIN_COSINE", default_value_t = 0.99)]
    pub min_cosine: f64,
    /// Largest relative error of a replayed tensor that passes.
    #[arg(
        long = "max-relative-error",
        env = "IOTA_MAX_RELATIVE_ERROR",
        default_value_t = 0.05
    )]
    pub max_relative_error: f64,
    /// Per-epoch decay of older scores, in (0, 1] (anything else is taken as 1).
    #[arg(long = "score-decay", env = "IOTA_SCORE_DECAY", default_value_t = 0.7)]
    pub score_decay: f64,
    /// Epochs of scores that count (1 to 1000).
    #[arg(long = "score-window", env = "IOTA_SCORE_WINDOW", default_value_t = 10)]
    pub score_window: u64,
    /// Epochs of samples one CLASP fit pools: the scored epoch and those before it (1 to 64).
    #[arg(long = "clasp-window", env = "IOTA_CLASP_WINDOW", default_value_t = 10)]
    pub clasp_window: u64,
    /// Uid that receives the burn share.
    #[arg(long = "burn-uid", env = "IOTA_BURN_UID")]
    pub burn_uid: Option<u16>,
    /// Share of the weights to the burn uid, in [0, 1).
    #[arg(long = "burn-share", env = "IOTA_BURN_SHARE", default_value_t = 0.0)]
    pub burn_share: f64,
    /// Seconds between loop steps.
    #[arg(
        long = "poll-interval-s",
        env = "IOTA_POLL_INTERVAL_S",
        default_value_t = 5
    )]
    pub poll_interval_s: u64,
    /// Score only; never set weights.
    #[arg(long = "no-weights", env = "IOTA_NO_WEIGHTS")]
    pub no_weights: bool,
    /// Debug logging.
    #[arg(long = "logging.debug", env = "BT_LOGGING_DEBUG")]
    pub debug: bool,
    /// A local copy of the run's prepared dataset folder (`iota data prepare`), to replay a run
    /// that names a dataset. Without it, the dataset is fetched from the run's store into
    /// --data-cache.
    #[arg(long = "data-dir", env = "IOTA_DATA_DIR")]
    pub data_dir: Option<std::path::PathBuf>,
    /// Where a dataset fetched from the run's store is kept, in a folder named by its
    /// manifest's BLAKE3; files already there that hash right are not fetched again.
    #[arg(long = "data-cache", env = "IOTA_DATA_CACHE", default_value = iota_protocol::dataset_cache::DEFAULT_DATA_CACHE)]
    pub data_cache: std::path::PathBuf,
}

impl ValidatorArgs {
    /// The library config.
    pub fn validator_config(&self) -> ValidatorConfig {
        let mut c = ValidatorConfig::new(&self.orchestrator_url, self.netuid);
        c.poll_interval = Duration::from_secs(self.poll_interval_s.max(1));
        c.replays_per_epoch = self.replays_per_epoch;
        c.replay_sub_batches = usize::from(self.sub_batches);
        c.merges_per_epoch = self.merges_per_epoch;
        c.thresholds = ReplayThresholds {
            min_cosine: self.min_cosine,
            max_relative_error: self.max_relative_error,
            ..ReplayThresholds::default()
        };
        // Published with every epoch's scores, where the orchestrator refuses a decay outside
        // (0, 1]: one would hold back every later publication.
        c.score.decay = if self.score_decay > 0.0 && self.score_decay <= 1.0 {
            self.score_decay
        } else {
            1.0
        };
        c.score.window = self
            .score_window
            .clamp(1, iota_protocol::api::ScoringParams::MAX_WINDOW);
        c.clasp.window = self
            .clasp_window
            .clamp(1, iota_protocol::api::ScoringParams::MAX_CLASP_WINDOW);
        c.burn = self
            .burn_uid
            .filter(|_| self.burn_share > 0.0)
            .map(|u| (u, self.burn_share.clamp(0.0, 0.99)));
        c.set_weights = !self.no_weights;
        c.data_dir = self.data_dir.clone();
        c.data_cache = self.data_cache.clone();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the flags say, the settings a validator publishes are ones the orchestrator
    /// takes: a refused publication would hold back every later one.
    #[test]
    fn flags_out_of_bounds_give_settings_the_orchestrator_takes() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ValidatorArgs,
        }
        for flags in [
            vec![],
            vec!["--score-decay", "1.5"],
            vec!["--score-decay", "0"],
            vec!["--score-decay", "NaN"],
            vec!["--score-window", "0"],
            vec!["--score-window", "100000"],
            vec!["--clasp-window", "0"],
            vec!["--clasp-window", "1000"],
            vec!["--burn-uid", "3", "--burn-share", "1.0"],
        ] {
            let argv = std::iter::once("validator").chain(flags.iter().copied());
            let cfg = <Cli as clap::Parser>::try_parse_from(argv)
                .expect("parses")
                .args
                .validator_config();
            let params = crate::published::params(&cfg.clasp, &cfg.score, cfg.burn);
            assert!(params.is_valid(), "{flags:?}: {params:?}");
        }
    }
}
