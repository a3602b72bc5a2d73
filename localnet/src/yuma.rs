//! Yuma consensus epoch for a single subnet, in subtensor's fixed-point arithmetic.
//!
//! [`run_epoch`] is a pure, deterministic function: it takes plain per-neuron data
//! (stake, weights, bonds, block numbers, the stored validator permit) plus the subnet
//! hyperparameters and returns everything subtensor's sparse `epoch_mechanism` would
//! write back (consensus, incentive, dividends, validator trust, new permits, bonds,
//! and the rao emission split).
//!
//! The arithmetic follows subtensor step by step so that results match bit for bit:
//! stakes are normalised in `I64F64` and narrowed to `I32F32`; everything else is
//! `I32F32` with saturating add/sub/mul and a division that yields 0 when the divisor
//! is 0 (subtensor's `safe_div`); rao amounts go through `I96F32` and are floored.
//! The stake-weighted median uses subtensor's deterministic mid-pivot partition, so
//! ties and rounding behave the same way.
//!
//! Modelled:
//! * activity cutoff (`active`), stake threshold (subnet owner exempt), top-k
//!   validator permits (ties go to the higher uid, zero stake never gets one, owner
//!   forced), active stake masked by inactivity and by the *stored* permits;
//! * weight preprocessing: rows without a stored permit dropped, self-weights dropped
//!   (except the owner's), weights set before the target registered dropped, rows
//!   normalised;
//! * consensus (kappa), clipping, validator trust, incentive, bonds penalty;
//! * bonds and dividends for both Yuma3 (`yuma3 = true`) and the original Yuma;
//! * the in-epoch emission split, including the "nobody set weights" fallback that
//!   pays validators by active stake (or by stake when no stake is active).
//!
//! Not modelled (callers must account for these elsewhere, or accept the difference):
//! * liquid alpha: the bond EMA always uses `alpha = 1 - bonds_moving_average / 1e6`;
//! * several mechanisms per subnet (`MechanismEmissionSplit`): one mechanism only;
//! * the commit-reveal column mask (weights versus the earliest pending commit);
//! * childkey/parent stake inheritance and root (TAO-weighted) stake: `stake` is
//!   taken as the neuron's final stake weight in alpha rao;
//! * anything after the epoch (owner cut, validator take, nominator payouts).
//!
//! Defensive choices, which only matter for inputs a real chain never holds: bond
//! entries whose target uid is `>= n` are ignored (subtensor ignores such weight
//! entries too), sums saturate instead of overflowing, and at most 65 535 neurons are
//! processed (uids are `u16`); extra neurons get zeroed outputs.

use substrate_fixed::types::{I32F32, I64F64, I96F32};

/// Largest subnet the epoch will process; uids are `u16`.
const MAX_NEURONS: usize = u16::MAX as usize;

/// Row-major sparse matrix: one `(column, value)` list per row.
type Sparse = Vec<Vec<(u16, I32F32)>>;

/// Subnet hyperparameters and chain state that the epoch reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochParams {
    /// Block the epoch runs in.
    pub current_block: u64,
    /// Blocks after its last weight update before a neuron counts as inactive.
    pub activity_cutoff: u64,
    /// Consensus majority as a u16 proportion (subtensor default 32 767, about 0.5).
    pub kappa: u16,
    /// Bond moving average in millionths; EMA alpha is `1 - this / 1e6`.
    pub bonds_moving_average: u64,
    /// How much of the clipping applies to bonds, as a u16 proportion.
    pub bonds_penalty: u16,
    /// Number of validator permits handed out by stake.
    pub max_allowed_validators: u16,
    /// Minimum stake (rao) to count at all; the subnet owner is exempt.
    pub stake_threshold: u64,
    /// `Yuma3On`: Yuma3 bonds (u16 proportions) instead of the original Yuma bonds.
    pub yuma3: bool,
    /// `LastMechansimStepBlock`: block of the previous epoch, 0 if none.
    pub last_mechanism_step_block: u64,
    /// Subnet tempo; used for the bond mask when there was no previous epoch.
    pub tempo: u16,
    /// Uid of the subnet owner's hotkey, if it is registered on the subnet.
    pub owner_uid: Option<u16>,
}

impl Default for EpochParams {
    /// Subtensor's runtime defaults for a new subnet (Yuma3 on, no owner uid).
    fn default() -> Self {
        Self {
            current_block: 0,
            activity_cutoff: 5_000,
            kappa: 32_767,
            bonds_moving_average: 900_000,
            bonds_penalty: u16::MAX,
            max_allowed_validators: 128,
            stake_threshold: 0,
            yuma3: true,
            last_mechanism_step_block: 0,
            tempo: 360,
            owner_uid: None,
        }
    }
}

/// One uid's stored state as the epoch sees it. The slice index is the uid.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Neuron {
    /// Stake weight in alpha rao.
    pub stake: u64,
    /// `LastUpdate`: block of the neuron's last weight update.
    pub last_update: u64,
    /// `BlockAtRegistration`.
    pub block_at_registration: u64,
    /// Stored `ValidatorPermit` from the previous epoch.
    pub validator_permit: bool,
    /// Stored `Weights` row: `(target uid, raw u16 weight)`.
    pub weights: Vec<(u16, u16)>,
    /// Stored `Bonds` row: `(target uid, u16 bond)`.
    pub bonds: Vec<(u16, u16)>,
}

/// Everything the epoch writes back, one entry per uid (same length as the input).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EpochResult {
    /// `Active`.
    pub active: Vec<bool>,
    /// `Consensus` (u16 proportion).
    pub consensus: Vec<u16>,
    /// `Incentive` (u16 proportion, sums to about 65 535 or to 0).
    pub incentive: Vec<u16>,
    /// `Dividends` (u16 proportion, sums to about 65 535 or to 0).
    pub dividends: Vec<u16>,
    /// `ValidatorTrust` (u16 proportion).
    pub validator_trust: Vec<u16>,
    /// `StakeWeight`: normalised stake after the threshold (u16 proportion).
    pub stake_weight: Vec<u16>,
    /// `ValidatorPermit` to store for the next epoch.
    pub new_validator_permit: Vec<bool>,
    /// `Bonds` rows to store; empty for uids without a new permit.
    pub bonds: Vec<Vec<(u16, u16)>>,
    /// Rao owed to each uid as a miner.
    pub server_emission: Vec<u64>,
    /// Rao owed to each uid as a validator.
    pub validator_emission: Vec<u64>,
    /// `Emission` storage: normalised (incentive + dividends) times the total.
    pub emission: Vec<u64>,
}

impl EpochResult {
    /// Pads every vector with defaults up to `len` entries.
    fn pad_to(&mut self, len: usize) {
        self.active.resize(len, false);
        self.consensus.resize(len, 0);
        self.incentive.resize(len, 0);
        self.dividends.resize(len, 0);
        self.validator_trust.resize(len, 0);
        self.stake_weight.resize(len, 0);
        self.new_validator_permit.resize(len, false);
        self.bonds.resize(len, Vec::new());
        self.server_emission.resize(len, 0);
        self.validator_emission.resize(len, 0);
        self.emission.resize(len, 0);
    }
}

/// Runs one Yuma epoch over `neurons` (indexed by uid), distributing `emission_rao`.
///
/// Never panics; degenerate inputs (no neurons, no stake, no weights) give zeros or
/// the stake-based fallback exactly as subtensor would.
pub fn run_epoch(params: &EpochParams, neurons: &[Neuron], emission_rao: u64) -> EpochResult {
    let total = neurons.len();
    let neurons = neurons.get(..MAX_NEURONS).unwrap_or(neurons);
    let mut result = epoch_inner(params, neurons, emission_rao);
    result.pad_to(total);
    result
}

fn epoch_inner(params: &EpochParams, neurons: &[Neuron], emission_rao: u64) -> EpochResult {
    let n = neurons.len();
    let columns = u16::try_from(n).unwrap_or(u16::MAX);
    let zero = I32F32::from_num(0);
    let owner = params.owner_uid.map(usize::from).filter(|&o| o < n);

    // == Activity ==
    let last_update: Vec<u64> = neurons.iter().map(|x| x.last_update).collect();
    let registered: Vec<u64> = neurons.iter().map(|x| x.block_at_registration).collect();
    let inactive: Vec<bool> = last_update
        .iter()
        .map(|&u| u.saturating_add(params.activity_cutoff) < params.current_block)
        .collect();
    let active: Vec<bool> = inactive.iter().map(|&b| !b).collect();

    // == Stake ==
    let mut stake64: Vec<I64F64> = neurons
        .iter()
        .enumerate()
        .map(|(uid, x)| {
            let s = I64F64::saturating_from_num(x.stake);
            if Some(uid) != owner && s.saturating_to_num::<u64>() < params.stake_threshold {
                I64F64::from_num(0)
            } else {
                s
            }
        })
        .collect();
    normalize_64(&mut stake64);
    let stake: Vec<I32F32> = stake64
        .iter()
        .map(|&s| I32F32::saturating_from_num(s))
        .collect();

    // == Validator permits ==
    let mut permits: Vec<bool> = neurons.iter().map(|x| x.validator_permit).collect();
    let mut new_permits = topk_nonzero(&stake, usize::from(params.max_allowed_validators));
    if let Some(o) = owner {
        set_at(&mut permits, o, true);
        set_at(&mut new_permits, o, true);
    }

    // == Active stake ==
    let mut active_stake: Vec<I32F32> = stake
        .iter()
        .zip(inactive.iter().zip(&permits))
        .map(|(&s, (&off, &permit))| if off || !permit { zero } else { s })
        .collect();
    normalize(&mut active_stake);

    // == Weights ==
    let mut weights: Sparse = neurons
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if !at(&permits, i) {
                return Vec::new();
            }
            let updated = at(&last_update, i);
            x.weights
                .iter()
                .filter(|&&(j, _)| {
                    let j = usize::from(j);
                    j < n && (i != j || Some(i) == owner) && updated > at(&registered, j)
                })
                .map(|&(j, w)| (j, I32F32::from_num(w)))
                .collect()
        })
        .collect();
    row_normalize(&mut weights);

    // == Consensus, clipping, validator trust ==
    let kappa = proportion(params.kappa);
    let consensus = weighted_median_cols(&active_stake, &weights, columns, kappa);
    let clipped = col_clip(&weights, &consensus);
    let validator_trust: Vec<I32F32> = clipped.iter().map(|row| row_sum(row)).collect();

    // == Incentive ==
    let mut incentive = matmul(&clipped, &active_stake, columns);
    normalize(&mut incentive);

    // == Bonds and dividends ==
    let bonds_penalty = proportion(params.bonds_penalty);
    let weights_for_bonds = interpolate(&weights, &clipped, columns, bonds_penalty);
    let last_tempo = if params.last_mechanism_step_block == 0 {
        params.current_block.saturating_sub(u64::from(params.tempo))
    } else {
        params.last_mechanism_step_block.saturating_add(1)
    };
    let alpha = ema_alpha(params.bonds_moving_average);
    let u16_max = I32F32::from_num(u16::MAX);
    let stored_bonds = |scale: bool| -> Sparse {
        neurons
            .iter()
            .map(|x| {
                x.bonds
                    .iter()
                    .filter(|&&(j, _)| usize::from(j) < n && last_tempo > at(&registered, j.into()))
                    .map(|&(j, b)| {
                        let b = I32F32::from_num(b);
                        (j, if scale { safe_div(b, u16_max) } else { b })
                    })
                    .collect()
            })
            .collect()
    };

    let mut dividends: Vec<I32F32>;
    let mut ema_bonds: Sparse;
    if params.yuma3 {
        let bonds = stored_bonds(true);
        ema_bonds = mat_ema(&weights_for_bonds, &bonds, alpha, n);
        let mut ema_norm = ema_bonds.clone();
        col_normalize(&mut ema_norm, columns);
        let per_validator: Vec<I32F32> = ema_norm
            .iter()
            .map(|row| {
                row.iter().fold(zero, |acc, &(j, b)| {
                    acc.saturating_add(b.saturating_mul(at(&incentive, j.into())))
                })
            })
            .collect();
        dividends = per_validator
            .iter()
            .zip(&active_stake)
            .map(|(&v, &s)| v.checked_mul(s).unwrap_or(zero))
            .collect();
        normalize(&mut dividends);
    } else {
        let mut bonds = stored_bonds(false);
        col_normalize(&mut bonds, columns);
        let mut delta: Sparse = weights_for_bonds
            .iter()
            .zip(&active_stake)
            .map(|(row, &s)| row.iter().map(|&(j, w)| (j, w.saturating_mul(s))).collect())
            .collect();
        col_normalize(&mut delta, columns);
        ema_bonds = mat_ema(&delta, &bonds, alpha, n);
        col_normalize(&mut ema_bonds, columns);
        dividends = ema_bonds
            .iter()
            .map(|row| {
                row.iter().fold(zero, |acc, &(j, b)| {
                    acc.saturating_add(at(&incentive, j.into()).saturating_mul(b))
                })
            })
            .collect();
        normalize(&mut dividends);
        col_max_upscale(&mut ema_bonds, columns);
    }

    // == Emission ==
    let combined: Vec<I32F32> = incentive
        .iter()
        .zip(&dividends)
        .map(|(&i, &d)| i.saturating_add(d))
        .collect();
    let emission_sum = sum(&combined);
    let server_share: Vec<I32F32> = incentive
        .iter()
        .map(|&i| safe_div_nz(i, emission_sum))
        .collect();
    let mut validator_share: Vec<I32F32> = dividends
        .iter()
        .map(|&d| safe_div_nz(d, emission_sum))
        .collect();
    let mut combined_share = combined;
    normalize(&mut combined_share);
    if emission_sum == zero {
        // Nobody set (usable) weights: validators are paid by stake.
        let fallback = if sum(&active_stake) == zero {
            &stake
        } else {
            &active_stake
        };
        validator_share.clone_from(fallback);
        combined_share.clone_from(fallback);
    }
    let rao = I96F32::saturating_from_num(emission_rao);
    let to_rao = |shares: &[I32F32]| -> Vec<u64> {
        shares
            .iter()
            .map(|&x| {
                I96F32::saturating_from_num(x)
                    .saturating_mul(rao)
                    .saturating_to_num::<u64>()
            })
            .collect()
    };
    let to_u16 =
        |xs: &[I32F32]| -> Vec<u16> { xs.iter().map(|&x| fixed_proportion_to_u16(x)).collect() };

    let bonds_out: Vec<Vec<(u16, u16)>> = ema_bonds
        .iter()
        .enumerate()
        .map(|(i, row)| {
            if at(&new_permits, i) {
                row.iter()
                    .map(|&(j, b)| (j, fixed_proportion_to_u16(b)))
                    .collect()
            } else {
                Vec::new()
            }
        })
        .collect();

    EpochResult {
        active,
        consensus: to_u16(&consensus),
        incentive: to_u16(&incentive),
        dividends: to_u16(&dividends),
        validator_trust: to_u16(&validator_trust),
        stake_weight: to_u16(&stake),
        new_validator_permit: new_permits,
        bonds: bonds_out,
        server_emission: to_rao(&server_share),
        validator_emission: to_rao(&validator_share),
        emission: to_rao(&combined_share),
    }
}

// ---------------------------------------------------------------------------
// Fixed-point helpers mirroring subtensor's epoch math.
// ---------------------------------------------------------------------------

/// Element `i` of `v`, or the type's default when out of range.
fn at<T: Copy + Default>(v: &[T], i: usize) -> T {
    v.get(i).copied().unwrap_or_default()
}

fn set_at<T>(v: &mut [T], i: usize, value: T) {
    if let Some(cell) = v.get_mut(i) {
        *cell = value;
    }
}

/// `a / b`, or 0 when `b` is 0 or the quotient overflows (subtensor `safe_div`).
fn safe_div(a: I32F32, b: I32F32) -> I32F32 {
    a.checked_div(b).unwrap_or_default()
}

/// `a / b`, leaving `a` unchanged when `b` is 0 (the normalise-with-sum convention).
fn safe_div_nz(a: I32F32, b: I32F32) -> I32F32 {
    if b == I32F32::from_num(0) {
        a
    } else {
        safe_div(a, b)
    }
}

/// A u16 proportion as `I32F32` in `[0, 1]`.
fn proportion(x: u16) -> I32F32 {
    safe_div(I32F32::from_num(x), I32F32::from_num(u16::MAX))
}

/// `x * 65535`, saturated and floored into a u16 (subtensor `fixed_proportion_to_u16`).
fn fixed_proportion_to_u16(x: I32F32) -> u16 {
    x.saturating_mul(I32F32::from_num(u16::MAX))
        .saturating_to_num::<u16>()
}

/// EMA coefficient `1 - bonds_moving_average / 1e6`, computed as subtensor does.
fn ema_alpha(bonds_moving_average: u64) -> I32F32 {
    let bma = I64F64::saturating_from_num(bonds_moving_average)
        .checked_div(I64F64::from_num(1_000_000))
        .unwrap_or_default();
    I32F32::from_num(1).saturating_sub(I32F32::saturating_from_num(bma))
}

fn sum(x: &[I32F32]) -> I32F32 {
    x.iter()
        .fold(I32F32::from_num(0), |acc, &v| acc.saturating_add(v))
}

fn row_sum(row: &[(u16, I32F32)]) -> I32F32 {
    row.iter()
        .fold(I32F32::from_num(0), |acc, &(_, v)| acc.saturating_add(v))
}

/// Scales `x` to sum to 1 unless its sum is 0.
fn normalize(x: &mut [I32F32]) {
    let total = sum(x);
    if total != I32F32::from_num(0) {
        x.iter_mut().for_each(|v| *v = safe_div(*v, total));
    }
}

fn normalize_64(x: &mut [I64F64]) {
    let zero = I64F64::from_num(0);
    let total = x.iter().fold(zero, |acc, &v| acc.saturating_add(v));
    if total != zero {
        x.iter_mut()
            .for_each(|v| *v = v.checked_div(total).unwrap_or_default());
    }
}

/// True for the `k` largest entries (stable ascending sort, so ties favour the
/// higher index), and never for a zero entry. With `n <= k` every nonzero entry.
fn topk_nonzero(x: &[I32F32], k: usize) -> Vec<bool> {
    let n = x.len();
    let mut result: Vec<bool> = x.iter().map(|&v| v != I32F32::from_num(0)).collect();
    if n < k {
        return result;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| at(x, i));
    for &i in order.iter().take(n.saturating_sub(k)) {
        set_at(&mut result, i, false);
    }
    result
}

/// Each row scaled to sum to 1, when its sum is positive.
fn row_normalize(m: &mut Sparse) {
    for row in m.iter_mut() {
        let total = row_sum(row);
        if total > I32F32::from_num(0) {
            row.iter_mut().for_each(|(_, v)| *v = safe_div(*v, total));
        }
    }
}

/// Each column scaled to sum to 1, when its sum is nonzero.
fn col_normalize(m: &mut Sparse, columns: u16) {
    let zero = I32F32::from_num(0);
    let mut totals = vec![zero; usize::from(columns)];
    for &(j, v) in m.iter().flatten() {
        if let Some(t) = totals.get_mut(usize::from(j)) {
            *t = t.saturating_add(v);
        }
    }
    for (j, v) in m.iter_mut().flatten() {
        let t = at(&totals, usize::from(*j));
        if t != zero {
            *v = safe_div(*v, t);
        }
    }
}

/// Each column divided by its maximum, when that maximum is nonzero.
fn col_max_upscale(m: &mut Sparse, columns: u16) {
    let zero = I32F32::from_num(0);
    let mut maxima = vec![zero; usize::from(columns)];
    for &(j, v) in m.iter().flatten() {
        if let Some(mx) = maxima.get_mut(usize::from(j))
            && *mx < v
        {
            *mx = v;
        }
    }
    for (j, v) in m.iter_mut().flatten() {
        let mx = at(&maxima, usize::from(*j));
        if mx != zero {
            *v = safe_div(*v, mx);
        }
    }
}

/// `r_j = sum_i m_ij * v_i`.
fn matmul(m: &Sparse, v: &[I32F32], columns: u16) -> Vec<I32F32> {
    let mut out = vec![I32F32::from_num(0); usize::from(columns)];
    for (row, &scale) in m.iter().zip(v) {
        for &(j, w) in row {
            if let Some(cell) = out.get_mut(usize::from(j)) {
                *cell = cell.saturating_add(scale.saturating_mul(w));
            }
        }
    }
    out
}

/// Entries above their column's consensus are lowered to it; dropped when the
/// consensus is not positive.
fn col_clip(m: &Sparse, consensus: &[I32F32]) -> Sparse {
    let zero = I32F32::from_num(0);
    m.iter()
        .map(|row| {
            row.iter()
                .filter_map(|&(j, v)| {
                    let c = at(consensus, usize::from(j));
                    if c < v {
                        (c > zero).then_some((j, c))
                    } else {
                        Some((j, v))
                    }
                })
                .collect()
        })
        .collect()
}

/// `a + ratio * (b - a)` element-wise, keeping positive results (subtensor
/// `interpolate_sparse`, including its shortcuts at ratio 0 and 1).
fn interpolate(a: &Sparse, b: &Sparse, columns: u16, ratio: I32F32) -> Sparse {
    let zero = I32F32::from_num(0);
    if ratio == zero {
        return a.clone();
    }
    if ratio == I32F32::from_num(1) {
        return b.clone();
    }
    let width = usize::from(columns);
    a.iter()
        .zip(b)
        .map(|(row_a, row_b)| {
            let dense = |row: &[(u16, I32F32)]| {
                let mut d = vec![zero; width];
                for &(j, v) in row {
                    set_at(&mut d, usize::from(j), v);
                }
                d
            };
            let (da, db) = (dense(row_a), dense(row_b));
            da.iter()
                .zip(&db)
                .enumerate()
                .filter_map(|(j, (&x, &y))| {
                    let v = x.saturating_add(ratio.saturating_mul(y.saturating_sub(x)));
                    let j = u16::try_from(j).ok()?;
                    (v > zero).then_some((j, v))
                })
                .collect()
        })
        .collect()
}

/// `alpha * new + (1 - alpha) * old` element-wise over `n` columns, keeping
/// positive results (subtensor `mat_ema_sparse`: entries absent from `new` decay).
fn mat_ema(new: &Sparse, old: &Sparse, alpha: I32F32, n: usize) -> Sparse {
    let zero = I32F32::from_num(0);
    let keep = I32F32::from_num(1).saturating_sub(alpha);
    new.iter()
        .enumerate()
        .map(|(i, new_row)| {
            let mut acc = vec![zero; n];
            for &(j, v) in new_row {
                if let Some(cell) = acc.get_mut(usize::from(j)) {
                    *cell = cell.saturating_add(alpha.saturating_mul(v));
                }
            }
            for &(j, v) in old.get(i).map(Vec::as_slice).unwrap_or_default() {
                if let Some(cell) = acc.get_mut(usize::from(j)) {
                    *cell = cell.saturating_add(keep.saturating_mul(v));
                }
            }
            acc.iter()
                .enumerate()
                .filter_map(|(j, &v)| {
                    let j = u16::try_from(j).ok()?;
                    (v > zero).then_some((j, v))
                })
                .collect()
        })
        .collect()
}

/// Stake-weighted median of every column (subtensor `weighted_median_col_sparse`):
/// only rows with positive stake vote, their stake renormalised; a missing entry
/// votes 0.
fn weighted_median_cols(stake: &[I32F32], m: &Sparse, columns: u16, kappa: I32F32) -> Vec<I32F32> {
    let zero = I32F32::from_num(0);
    let mut voter_stake: Vec<I32F32> = stake.iter().copied().filter(|&s| s > zero).collect();
    normalize(&mut voter_stake);
    let stake_sum = sum(&voter_stake);
    let minority = stake_sum.saturating_sub(kappa);
    let voters: Vec<usize> = (0..voter_stake.len()).collect();

    // Column-major list of (voter index, score); later entries overwrite earlier
    // ones when the column is densified, as in subtensor.
    let mut by_column: Vec<Vec<(usize, I32F32)>> = vec![Vec::new(); usize::from(columns)];
    let mut k = 0usize;
    for (&s, row) in stake.iter().zip(m) {
        if s > zero {
            for &(j, v) in row {
                if let Some(col) = by_column.get_mut(usize::from(j)) {
                    col.push((k, v));
                }
            }
            k = k.saturating_add(1);
        }
    }

    by_column
        .iter()
        .map(|entries| {
            let mut score = vec![zero; voter_stake.len()];
            for &(k, v) in entries {
                set_at(&mut score, k, v);
            }
            weighted_median(&voter_stake, &score, &voters, minority, zero, stake_sum)
        })
        .collect()
}

/// Deterministic mid-pivot search for the stake-weighted median (subtensor
/// `weighted_median`). `[lo, hi]` is the slice of the stake integral that the
/// current partition covers; `minority = total stake - kappa`.
fn weighted_median(
    stake: &[I32F32],
    score: &[I32F32],
    partition: &[usize],
    minority: I32F32,
    mut lo: I32F32,
    mut hi: I32F32,
) -> I32F32 {
    let zero = I32F32::from_num(0);
    let mut current: Vec<usize> = partition.to_vec();
    loop {
        let pivot = match current.as_slice() {
            [] => return zero,
            [only] => return at(score, *only),
            _ => at(score, at(&current, current.len() / 2)),
        };
        let mut lo_stake = zero;
        let mut hi_stake = zero;
        let mut lower: Vec<usize> = Vec::new();
        let mut upper: Vec<usize> = Vec::new();
        for &idx in &current {
            let s = at(score, idx);
            if s < pivot {
                lo_stake = lo_stake.saturating_add(at(stake, idx));
                lower.push(idx);
            } else if s > pivot {
                hi_stake = hi_stake.saturating_add(at(stake, idx));
                upper.push(idx);
            }
        }
        if minority < lo.saturating_add(lo_stake) && !lower.is_empty() {
            hi = lo.saturating_add(lo_stake);
            current = lower;
        } else if hi.saturating_sub(hi_stake) <= minority && !upper.is_empty() {
            lo = hi.saturating_sub(hi_stake);
            current = upper;
        } else {
            return pivot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: u64 = 1_000_000_000;

    fn neuron(stake: u64, last_update: u64, permit: bool, weights: &[(u16, u16)]) -> Neuron {
        Neuron {
            stake,
            last_update,
            block_at_registration: 0,
            validator_permit: permit,
            weights: weights.to_vec(),
            bonds: Vec::new(),
        }
    }

    fn params_at(block: u64) -> EpochParams {
        EpochParams {
            current_block: block,
            tempo: 10,
            ..EpochParams::default()
        }
    }

    fn bond_at(row: &[(u16, u16)], j: u16) -> u16 {
        row.iter().find(|(k, _)| *k == j).map_or(0, |(_, b)| *b)
    }

    /// Stores what the chain would store after an epoch: new permits and bonds.
    fn apply(neurons: &mut [Neuron], r: &EpochResult) {
        for (i, x) in neurons.iter_mut().enumerate() {
            x.validator_permit = r.new_validator_permit[i];
            x.bonds = r.bonds[i].clone();
        }
    }

    fn fx(x: f64) -> I32F32 {
        I32F32::from_num(x)
    }

    #[test]
    fn one_validator_two_miners_split_by_weight() {
        let neurons = vec![
            neuron(E, 99, true, &[(1, 21_845), (2, 65_535)]),
            neuron(0, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.incentive, vec![0, 16_383, 49_151]);
        assert_eq!(r.consensus, vec![0, 16_383, 49_151]);
        assert_eq!(r.dividends, vec![65_535, 0, 0]);
        assert_eq!(r.validator_trust, vec![65_535, 0, 0]);
        assert_eq!(r.stake_weight, vec![65_535, 0, 0]);
        assert_eq!(r.new_validator_permit, vec![true, false, false]);
        assert_eq!(r.active, vec![true, true, true]);
        assert_eq!(r.server_emission, vec![0, 125_000_000, 375_000_000]);
        assert_eq!(r.validator_emission, vec![500_000_000, 0, 0]);
        assert_eq!(r.emission, vec![500_000_000, 125_000_000, 375_000_000]);
        // Yuma3 first epoch: bond = alpha * weight, alpha = 0.1.
        let b = &r.bonds[0];
        assert_eq!(b.len(), 2);
        assert!(bond_at(b, 1).abs_diff(1_638) <= 1, "{b:?}");
        assert!(bond_at(b, 2).abs_diff(4_915) <= 1, "{b:?}");
        assert!(r.bonds[1].is_empty() && r.bonds[2].is_empty());
    }

    #[test]
    fn lone_minority_weight_is_clipped() {
        // 60% validator weights miner 2 only; 40% validator splits 2 and 3.
        let neurons = vec![
            neuron(600, 99, true, &[(2, 65_535)]),
            neuron(400, 99, true, &[(2, 65_535), (3, 65_535)]),
            neuron(0, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.consensus[3], 0);
        assert_eq!(r.consensus[2], 65_535);
        assert_eq!(r.incentive, vec![0, 0, 65_535, 0]);
        assert_eq!(r.server_emission[3], 0);
        assert_eq!(r.validator_trust[0], 65_535);
        assert!(r.validator_trust[1].abs_diff(32_767) <= 1);
        // The clipped entry still earns the second validator nothing extra.
        assert!(r.dividends[0] > r.dividends[1]);
    }

    #[test]
    fn stake_threshold_masks_small_stake_except_owner() {
        let neurons = vec![
            neuron(10_000, 99, true, &[(2, 65_535)]),
            neuron(500, 99, true, &[(2, 65_535)]),
            neuron(0, 0, false, &[]),
        ];
        let mut p = params_at(100);
        p.stake_threshold = 1_000;
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.stake_weight[1], 0);
        assert!(!r.new_validator_permit[1]);
        assert_eq!(r.incentive, vec![0, 0, 65_535]);
        assert_eq!(r.dividends, vec![65_535, 0, 0]);
        assert_eq!(r.validator_emission[1], 0);

        p.owner_uid = Some(1);
        let r = run_epoch(&p, &neurons, E);
        assert!(r.stake_weight[1] > 0);
        assert!(r.new_validator_permit[1]);
        assert!(r.validator_emission[1] > 0);
    }

    #[test]
    fn owner_keeps_self_weight_others_do_not() {
        let neurons = vec![
            neuron(E, 99, true, &[(0, 65_535)]),
            neuron(0, 0, false, &[]),
        ];
        let mut p = params_at(100);
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.incentive, vec![0, 0]);
        assert_eq!(r.validator_emission, vec![E, 0]);

        p.owner_uid = Some(0);
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.incentive, vec![65_535, 0]);
        assert_eq!(r.dividends, vec![65_535, 0]);
        assert_eq!(r.server_emission[0], E / 2);
        assert_eq!(r.validator_emission[0], E / 2);
    }

    #[test]
    fn inactive_validator_loses_its_vote() {
        let neurons = vec![
            neuron(700, 10, true, &[(2, 65_535)]),
            neuron(300, 5_999, true, &[(3, 65_535)]),
            neuron(0, 5_999, false, &[]),
            neuron(0, 5_999, false, &[]),
        ];
        let r = run_epoch(&params_at(6_000), &neurons, E);
        assert_eq!(r.active, vec![false, true, true, true]);
        assert_eq!(r.incentive, vec![0, 0, 0, 65_535]);
        assert_eq!(r.dividends, vec![0, 65_535, 0, 0]);
        // Stake weight still counts inactive stake; the permit is by stake too.
        assert!(r.new_validator_permit[0]);
    }

    #[test]
    fn nobody_set_weights_pays_validators_by_stake() {
        let mut neurons = vec![
            neuron(3 * E, 99, true, &[]),
            neuron(E, 99, true, &[]),
            neuron(0, 99, false, &[]),
        ];
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.server_emission, vec![0, 0, 0]);
        assert_eq!(r.validator_emission, vec![750_000_000, 250_000_000, 0]);
        assert_eq!(r.emission, r.validator_emission);
        assert_eq!(r.incentive, vec![0, 0, 0]);
        assert_eq!(r.dividends, vec![0, 0, 0]);

        // No stored permits yet (first epoch): no active stake, so plain stake.
        neurons.iter_mut().for_each(|x| x.validator_permit = false);
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.validator_emission, vec![750_000_000, 250_000_000, 0]);
        assert_eq!(r.new_validator_permit, vec![true, true, false]);

        // Only validator 1 active: it takes everything.
        neurons.iter_mut().for_each(|x| x.validator_permit = true);
        neurons[1].last_update = 9_999;
        let r = run_epoch(&params_at(10_000), &neurons, E);
        assert_eq!(r.active, vec![false, true, false]);
        assert_eq!(r.validator_emission, vec![0, E, 0]);

        // Nobody active at all: back to plain stake.
        let r = run_epoch(&params_at(20_000), &neurons, E);
        assert_eq!(r.validator_emission, vec![750_000_000, 250_000_000, 0]);
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        let r = run_epoch(&params_at(0), &[], E);
        assert_eq!(r, EpochResult::default());

        let one = vec![neuron(5, 0, true, &[(0, 65_535), (7, 1)])];
        let r = run_epoch(&params_at(0), &one, E);
        assert_eq!(r.incentive, vec![0]);
        assert_eq!(r.validator_emission, vec![E]);

        let zero_stake = vec![
            neuron(0, 99, true, &[(1, 65_535)]),
            neuron(0, 99, true, &[(0, 65_535)]),
        ];
        let r = run_epoch(&params_at(100), &zero_stake, E);
        assert_eq!(r.server_emission, vec![0, 0]);
        assert_eq!(r.validator_emission, vec![0, 0]);
        assert_eq!(r.new_validator_permit, vec![false, false]);
        assert_eq!(r.bonds, vec![Vec::<(u16, u16)>::new(); 2]);

        let extreme = EpochParams {
            current_block: u64::MAX,
            activity_cutoff: u64::MAX,
            bonds_moving_average: u64::MAX,
            last_mechanism_step_block: u64::MAX,
            ..EpochParams::default()
        };
        let big = vec![
            neuron(u64::MAX, u64::MAX, true, &[(1, u16::MAX)]),
            neuron(u64::MAX, 0, true, &[(0, u16::MAX)]),
        ];
        let r = run_epoch(&extreme, &big, u64::MAX);
        assert_eq!(r.incentive.len(), 2);
    }

    #[test]
    fn top_k_permits_break_ties_toward_higher_uid() {
        let neurons = vec![
            neuron(5, 0, false, &[]),
            neuron(5, 0, false, &[]),
            neuron(5, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        let mut p = params_at(1);
        p.max_allowed_validators = 2;
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.new_validator_permit, vec![false, true, true, false]);
        p.max_allowed_validators = 4;
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.new_validator_permit, vec![true, true, true, false]);
        p.owner_uid = Some(3);
        let r = run_epoch(&p, &neurons, E);
        assert_eq!(r.new_validator_permit, vec![true, true, true, true]);
    }

    #[test]
    fn weights_older_than_target_registration_are_dropped() {
        let mut neurons = vec![
            neuron(E, 50, true, &[(1, 65_535), (2, 65_535)]),
            neuron(0, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        neurons[1].block_at_registration = 50;
        neurons[2].block_at_registration = 49;
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.incentive, vec![0, 0, 65_535]);
    }

    #[test]
    fn validators_without_stored_permit_do_not_vote() {
        let neurons = vec![
            neuron(E, 99, true, &[(2, 65_535)]),
            neuron(9 * E, 99, false, &[(3, 65_535)]),
            neuron(0, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        let r = run_epoch(&params_at(100), &neurons, E);
        assert_eq!(r.incentive, vec![0, 0, 65_535, 0]);
        assert_eq!(r.dividends, vec![65_535, 0, 0, 0]);
        assert!(r.new_validator_permit[1]);
    }

    #[test]
    fn yuma3_bonds_decay_when_weight_moves() {
        let mut neurons = vec![
            neuron(E, 99, true, &[(1, 65_535)]),
            neuron(0, 0, false, &[]),
            neuron(0, 0, false, &[]),
        ];
        let mut p = params_at(100);
        let r = run_epoch(&p, &neurons, E);
        apply(&mut neurons, &r);
        let first = bond_at(&neurons[0].bonds, 1);
        assert!(first > 0);
        neurons[0].weights = vec![(2, 65_535)];
        p.current_block = 110;
        p.last_mechanism_step_block = 100;
        let r = run_epoch(&p, &neurons, E);
        // Without liquid alpha the old bond decays by (1 - alpha) instead of vanishing.
        let decayed = bond_at(&r.bonds[0], 1);
        assert!(decayed > 0 && decayed < first, "{first} -> {decayed}");
        assert!(bond_at(&r.bonds[0], 2) > 0);
    }

    #[test]
    fn bonds_to_recently_registered_uids_are_reset() {
        let mut neurons = vec![
            neuron(E, 99, true, &[(1, 65_535)]),
            neuron(0, 0, false, &[]),
        ];
        neurons[0].bonds = vec![(1, 60_000)];
        neurons[1].block_at_registration = 95;
        let mut p = params_at(100);
        p.last_mechanism_step_block = 90; // last_tempo = 91 <= 95: masked
        let r = run_epoch(&p, &neurons, E);
        assert!(bond_at(&r.bonds[0], 1) < 7_000, "{:?}", r.bonds[0]);
        p.last_mechanism_step_block = 95; // last_tempo = 96 > 95: kept
        let r = run_epoch(&p, &neurons, E);
        assert!(bond_at(&r.bonds[0], 1) > 50_000, "{:?}", r.bonds[0]);
    }

    #[test]
    fn weighted_median_matches_definition() {
        let third = fx(1.0 / 3.0);
        let stake = vec![third, third, third];
        let idx = vec![0, 1, 2];
        let total = sum(&stake);
        let kappa = proportion(32_767);
        let minority = total.saturating_sub(kappa);
        let score = vec![fx(0.3), fx(0.1), fx(0.2)];
        let m = weighted_median(&stake, &score, &idx, minority, fx(0.0), total);
        assert_eq!(m, fx(0.2));
        // Heavy stake on the low score pulls the median down.
        let stake = vec![fx(0.1), fx(0.8), fx(0.1)];
        let m = weighted_median(&stake, &score, &idx, minority, fx(0.0), total);
        assert_eq!(m, fx(0.1));
        // All equal scores: the pivot itself.
        let score = vec![fx(0.5); 3];
        let m = weighted_median(&stake, &score, &idx, minority, fx(0.0), total);
        assert_eq!(m, fx(0.5));
        assert_eq!(
            weighted_median(&[], &[], &[], minority, fx(0.0), total),
            fx(0.0)
        );
    }

    /// One golden step: block, optional new weight row `(uid, row)`, bond column, bonds.
    type Step = (u64, Option<(usize, Vec<(u16, u16)>)>, u16, [u16; 4]);

    /// Subtensor's `tests::epoch::test_bonds` (original Yuma, sparse): exact stored bonds.
    #[test]
    fn golden_original_yuma_bond_sequence() {
        let quarter = [(4, 16_383), (5, 32_767), (6, 49_149), (7, 65_535)];
        let mut neurons: Vec<Neuron> = [1u64, 2, 3, 4, 0, 0, 0, 0]
            .iter()
            .map(|&s| neuron(s, 0, false, &[]))
            .collect();
        let mut p = EpochParams {
            tempo: 1,
            yuma3: false,
            max_allowed_validators: 8,
            ..EpochParams::default()
        };
        let r = run_epoch(&p, &neurons, E); // block 0: hands out permits
        apply(&mut neurons, &r);
        assert_eq!(
            r.new_validator_permit,
            vec![true, true, true, true, false, false, false, false]
        );

        for x in neurons.iter_mut().take(4) {
            x.weights = quarter.to_vec();
            x.last_update = 1;
        }
        let steps: [Step; 7] = [
            (1, None, 4, [16_383, 32_767, 49_151, 65_535]),
            (
                2,
                Some((0, vec![(0, 65_535)])),
                4,
                [14_582, 32_767, 49_151, 65_535],
            ),
            (
                3,
                Some((1, vec![(1, 65_535)])),
                4,
                [12_603, 28_321, 49_151, 65_535],
            ),
            (
                4,
                Some((2, vec![(2, 65_535)])),
                7,
                [12_602, 28_320, 49_150, 65_535],
            ),
            (
                5,
                Some((2, vec![(7, 65_535)])),
                7,
                [10_951, 24_609, 49_150, 65_535],
            ),
            (6, None, 7, [9_559, 21_482, 49_150, 65_535]),
            (7, None, 7, [8_376, 18_824, 49_150, 65_535]),
        ];
        for (block, set, col, expected) in steps {
            if let Some((uid, w)) = set {
                neurons[uid].weights = w;
                neurons[uid].last_update = block - 1;
            }
            p.current_block = block;
            let r = run_epoch(&p, &neurons, E);
            let got: Vec<u16> = (0..4).map(|i| bond_at(&r.bonds[i], col)).collect();
            assert_eq!(got, expected, "block {block}");
            match block {
                1 => assert_eq!(
                    r.server_emission[4..],
                    [49_998_779, 100_000_610, 149_996_337, 200_004_272]
                ),
                4 => assert_eq!(
                    r.validator_emission[..4],
                    [99_999_999, 199_999_999, 299_999_999, 399_999_999]
                ),
                5 => assert_eq!(r.server_emission[7], 500_000_000),
                _ => {}
            }
            apply(&mut neurons, &r);
        }
    }

    /// Subtensor's `test_yuma_3_liquid_alpha_disabled`: dividends within 1e-3.
    #[test]
    fn golden_yuma3_dividends_without_liquid_alpha() {
        let mut neurons: Vec<Neuron> = [33u64, 33, 34, 0, 0]
            .iter()
            .map(|&s| Neuron {
                block_at_registration: 1,
                ..neuron(s, 0, false, &[])
            })
            .collect();
        let mut p = EpochParams {
            current_block: 2,
            tempo: 1,
            bonds_moving_average: 975_000,
            bonds_penalty: 0,
            max_allowed_validators: 3,
            ..EpochParams::default()
        };
        let r = run_epoch(&p, &neurons, E);
        apply(&mut neurons, &r);

        let targets = [
            [0.3300, 0.3300, 0.3400],
            [0.3300, 0.3300, 0.3400],
            [0.3734, 0.3734, 0.2532],
            [0.3611, 0.3611, 0.2779],
            [0.3541, 0.3541, 0.2919],
            [0.3495, 0.3495, 0.3009],
        ];
        for (epoch, target) in targets.iter().enumerate() {
            for (uid, x) in neurons.iter_mut().take(3).enumerate() {
                x.weights = if epoch == 2 && uid == 2 {
                    vec![(3, 0), (4, 65_535)]
                } else {
                    vec![(3, 65_535), (4, 0)]
                };
                x.last_update = p.current_block;
            }
            p.current_block += 1;
            let r = run_epoch(&p, &neurons, E);
            for (uid, want) in target.iter().enumerate() {
                let got = f64::from(r.dividends[uid]) / 65_535.0;
                assert!(
                    (got - want).abs() <= 1e-3,
                    "epoch {epoch} uid {uid}: {got} vs {want}"
                );
            }
            apply(&mut neurons, &r);
        }
    }

    /// splitmix64: a tiny deterministic PRNG for property tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, bound: u64) -> u64 {
            if bound == 0 { 0 } else { self.next() % bound }
        }
        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    fn random_subnet(rng: &mut Rng) -> (EpochParams, Vec<Neuron>, u64) {
        let n = match rng.below(10) {
            0 => rng.below(2) as usize,
            1 => 40,
            _ => 2 + rng.below(10) as usize,
        };
        let block = 1_000 + rng.below(10_000);
        let owner_uid = (n > 0 && rng.chance(30)).then(|| rng.below(n as u64 + 1) as u16);
        let params = EpochParams {
            current_block: block,
            activity_cutoff: 1 + rng.below(6_000),
            kappa: rng.below(65_536) as u16,
            bonds_moving_average: rng.below(1_000_001),
            bonds_penalty: rng.below(65_536) as u16,
            max_allowed_validators: rng.below(n as u64 + 3) as u16,
            stake_threshold: if rng.chance(30) {
                rng.below(1_000_000)
            } else {
                0
            },
            yuma3: rng.chance(50),
            last_mechanism_step_block: if rng.chance(50) {
                block - rng.below(500)
            } else {
                0
            },
            tempo: 1 + rng.below(400) as u16,
            owner_uid,
        };
        let n_u64 = n as u64;
        let neurons = (0..n)
            .map(|_| {
                let stake = match rng.below(4) {
                    0 => 0,
                    1 => rng.below(1_000),
                    _ => rng.below(1_000_000_000_000_000),
                };
                let row = |rng: &mut Rng| -> Vec<(u16, u16)> {
                    (0..rng.below(n_u64 + 2))
                        .map(|_| (rng.below(n_u64 + 1) as u16, rng.below(65_536) as u16))
                        .collect()
                };
                Neuron {
                    stake,
                    last_update: block.saturating_sub(rng.below(8_000)),
                    block_at_registration: block.saturating_sub(rng.below(9_000)),
                    validator_permit: rng.chance(60),
                    weights: row(rng),
                    bonds: row(rng),
                }
            })
            .collect();
        let emission = match rng.below(3) {
            0 => 0,
            1 => rng.below(1_000_000),
            _ => rng.below(1_000_000_000_000),
        };
        (params, neurons, emission)
    }

    fn check_invariants(p: &EpochParams, neurons: &[Neuron], emission: u64, r: &EpochResult) {
        let n = neurons.len();
        for len in [
            r.active.len(),
            r.consensus.len(),
            r.incentive.len(),
            r.dividends.len(),
            r.validator_trust.len(),
            r.stake_weight.len(),
            r.new_validator_permit.len(),
            r.bonds.len(),
            r.server_emission.len(),
            r.validator_emission.len(),
            r.emission.len(),
        ] {
            assert_eq!(len, n);
        }
        let total = |v: &[u16]| v.iter().map(|&x| u64::from(x)).sum::<u64>();
        let slack = n as u64 + 2;
        for v in [&r.incentive, &r.dividends, &r.stake_weight] {
            let s = total(v);
            assert!(
                s == 0 || (65_535 - slack..=65_535).contains(&s),
                "sum {s} of {v:?}"
            );
        }
        for (i, x) in neurons.iter().enumerate() {
            let off = x.last_update.saturating_add(p.activity_cutoff) < p.current_block;
            assert_eq!(r.active[i], !off);
            if r.new_validator_permit[i] {
                assert!(r.stake_weight[i] > 0 || p.owner_uid == Some(i as u16));
            } else {
                assert!(r.bonds[i].is_empty());
            }
            assert!(r.bonds[i].iter().all(|&(j, _)| usize::from(j) < n));
        }
        let permits = r.new_validator_permit.iter().filter(|&&b| b).count();
        let forced = usize::from(p.owner_uid.is_some());
        assert!(permits <= usize::from(p.max_allowed_validators) + forced);

        let paid: u64 = r.server_emission.iter().chain(&r.validator_emission).sum();
        let stored: u64 = r.emission.iter().sum();
        // Each share is floored, and each fixed-point share loses < 2^-32 per step.
        let tolerance = slack * (1 + 8 * (emission >> 32) + 1);
        assert!(
            paid <= emission && stored <= emission,
            "{paid} {stored} > {emission}"
        );
        if total(&r.stake_weight) > 0 {
            assert!(paid + tolerance >= emission, "paid {paid} of {emission}");
            assert!(
                stored + tolerance >= emission,
                "stored {stored} of {emission}"
            );
        } else {
            assert_eq!(paid, 0);
        }
        if total(&r.incentive) == 0 {
            assert!(r.server_emission.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn property_random_subnets_keep_invariants() {
        let mut rng = Rng(0x1077_A5EE_D000_0009);
        let (mut with_incentive, mut with_yuma3_bonds, mut with_yuma_bonds) = (0, 0, 0);
        for _ in 0..300 {
            let (mut p, mut neurons, emission) = random_subnet(&mut rng);
            for _ in 0..3 {
                let r = run_epoch(&p, &neurons, emission);
                check_invariants(&p, &neurons, emission, &r);
                if r.incentive.iter().any(|&x| x > 0) {
                    with_incentive += 1;
                }
                if r.bonds.iter().any(|row| !row.is_empty()) {
                    if p.yuma3 {
                        with_yuma3_bonds += 1;
                    } else {
                        with_yuma_bonds += 1;
                    }
                }
                assert_eq!(r, run_epoch(&p, &neurons, emission), "not deterministic");
                apply(&mut neurons, &r);
                p.last_mechanism_step_block = p.current_block;
                p.current_block += 1 + u64::from(p.tempo);
                for x in neurons.iter_mut() {
                    if rng.chance(50) {
                        x.last_update = p.current_block - 1;
                    }
                }
            }
        }
        // The generator must exercise the interesting paths, not just fallbacks.
        assert!(with_incentive > 100, "{with_incentive}");
        assert!(with_yuma3_bonds > 50 && with_yuma_bonds > 50);
    }

    #[test]
    fn property_consensus_subnets_pay_out_fully() {
        // All validators active, permitted and weighting the same miners: no clipping.
        let mut rng = Rng(42);
        for _ in 0..100 {
            let validators = 1 + rng.below(6) as usize;
            let miners = 1 + rng.below(8) as usize;
            let n = validators + miners;
            let targets: Vec<(u16, u16)> = (validators..n)
                .map(|j| (j as u16, 1 + rng.below(65_535) as u16))
                .collect();
            let mut neurons: Vec<Neuron> = (0..n)
                .map(|i| {
                    if i < validators {
                        neuron(1 + rng.below(1_000_000_000_000), 99, true, &targets)
                    } else {
                        neuron(0, 0, false, &[])
                    }
                })
                .collect();
            let mut p = params_at(100);
            p.yuma3 = rng.chance(50);
            for epoch in 0..3 {
                let r = run_epoch(&p, &neurons, E);
                check_invariants(&p, &neurons, E, &r);
                let server: u64 = r.server_emission.iter().sum();
                let validator: u64 = r.validator_emission.iter().sum();
                assert!(
                    server.abs_diff(E / 2) <= n as u64 + 2,
                    "epoch {epoch}: {server}"
                );
                assert!(
                    validator.abs_diff(E / 2) <= n as u64 + 2,
                    "epoch {epoch}: {validator}"
                );
                assert!(r.incentive[..validators].iter().all(|&x| x == 0));
                assert!(r.dividends[validators..].iter().all(|&x| x == 0));
                apply(&mut neurons, &r);
                p.last_mechanism_step_block = p.current_block;
                p.current_block += 10;
                neurons
                    .iter_mut()
                    .take(validators)
                    .for_each(|x| x.last_update = p.current_block - 1);
            }
        }
    }
}
