//! Each adversarial mode does what it names, asserted on what the miner would upload (the
//! encoded outputs, reported losses, pseudo-gradients and merged partitions), next to an honest
//! miner given the same inputs. No network: the trainer and the merge arithmetic directly.

use crate::support;

use iota_miner::MinerTrainer;
use iota_miner::adversary::{Adversary, merged_partition};
use iota_model::{BoundaryTensor, StageOptions};
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::decode_merged;
use iota_trainer::StageTrainer;

fn run() -> RunConfig {
    support::tiny_run("adversaries", 8)
}

fn trainer(stage: u32, adversary: Option<Adversary>) -> MinerTrainer {
    let honest = StageTrainer::new(run(), stage, StageOptions::cpu(), 8, None).expect("trainer");
    let mut t = MinerTrainer::new(honest, adversary, 5);
    for j in 0..run().partitions {
        t.load_partition(j, None).expect("init");
    }
    t.begin_epoch(0).expect("epoch");
    t
}

fn values(bytes: &[u8]) -> Vec<f32> {
    BoundaryTensor::from_bytes(bytes, None)
        .expect("boundary")
        .to_f32()
}

/// An activation a stage-0 miner would send, as bytes.
fn activation(sample: i64) -> Vec<u8> {
    trainer(0, None)
        .forward(sample, None)
        .expect("forward")
        .bytes
        .expect("output")
}

/// A gradient for stage `stage`'s output.
fn gradient(seed: u64) -> Vec<u8> {
    let r = run();
    let n = (r.micro_batch * r.seq_len * r.boundary_dim) as usize;
    let v: Vec<f32> = (0..n)
        .map(|i| (((i as u64 * 7919 + seed) % 200) as f32 - 100.0) * 1e-4)
        .collect();
    let shape = [
        r.micro_batch as usize,
        r.seq_len as usize,
        r.boundary_dim as usize,
    ];
    BoundaryTensor::from_f32(&shape, &v, iota_model::bottleneck::WireEncoding::F32)
        .expect("grad")
        .to_bytes()
        .expect("bytes")
}

fn std(v: &[f32]) -> f64 {
    let n = v.len() as f64;
    let m = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n;
    (v.iter().map(|x| (f64::from(*x) - m).powi(2)).sum::<f64>() / n).sqrt()
}

#[test]
fn noise_perturbs_activations_by_their_own_scale() {
    let honest = values(
        &trainer(0, None)
            .forward(3, None)
            .expect("fwd")
            .bytes
            .expect("out"),
    );
    let noisy = values(
        &trainer(0, Some(Adversary::Noise))
            .forward(3, None)
            .expect("fwd")
            .bytes
            .expect("out"),
    );
    let diff: Vec<f32> = noisy.iter().zip(&honest).map(|(a, b)| a - b).collect();
    let ratio = std(&diff) / std(&honest);
    assert!((0.5..2.0).contains(&ratio), "noise/signal = {ratio}");
}

#[test]
fn zeros_sends_zero_activations_and_gradients() {
    let mut t = trainer(1, Some(Adversary::Zeros));
    let out = t.forward(4, Some(&activation(4))).expect("fwd");
    assert!(values(&out.bytes.expect("out")).iter().all(|v| *v == 0.0));
    let back = t.backward(4, &gradient(1)).expect("bwd");
    assert!(values(&back.bytes.expect("grad")).iter().all(|v| *v == 0.0));
    // The honest miner sends non-zero values for the same hops.
    let mut h = trainer(1, None);
    let out = h.forward(4, Some(&activation(4))).expect("fwd");
    assert!(values(&out.bytes.expect("out")).iter().any(|v| *v != 0.0));
}

#[test]
fn stale_weights_ignores_the_merged_weights() {
    let mut honest = trainer(2, None);
    let mut stale = trainer(2, Some(Adversary::StaleWeights));
    assert_eq!(honest.weights_digest().ok(), stale.weights_digest().ok());
    // The next epoch's merged weights differ from the initial ones.
    for j in 0..run().partitions {
        let r = honest.honest().partition(j).expect("range");
        let merged: Vec<f32> = honest
            .honest()
            .epoch_start_range(r)
            .expect("start")
            .iter()
            .map(|v| v + 0.01)
            .collect();
        honest.load_partition(j, Some(&merged)).expect("load");
        stale.load_partition(j, Some(&merged)).expect("load");
    }
    let old = stale.weights_digest().expect("digest");
    honest.begin_epoch(1).expect("epoch");
    stale.begin_epoch(1).expect("epoch");
    assert_ne!(honest.weights_digest().ok(), stale.weights_digest().ok());
    assert_eq!(
        stale.weights_digest().ok(),
        Some(old),
        "kept its stale weights"
    );
    // Its hops record the stale digest, which no merge produced.
    let hop = stale.forward(9, Some(&activation(9))).expect("fwd");
    assert_ne!(Some(hop.weights_digest), honest.weights_digest().ok());
}

#[test]
fn freeload_claims_backward_work_without_doing_it() {
    let mut free = trainer(1, Some(Adversary::Freeload));
    let mut honest = trainer(1, None);
    for (t, zero) in [(&mut free, true), (&mut honest, false)] {
        for s in 0..4i64 {
            t.forward(s, Some(&activation(s))).expect("fwd");
            let back = t.backward(s, &gradient(s as u64)).expect("bwd");
            t.commit(s).expect("commit");
            let g = values(&back.bytes.expect("grad"));
            assert_eq!(g.iter().all(|v| *v == 0.0), zero);
        }
        t.finish_training().expect("finish");
        assert_eq!(t.gradient_hops(), 4, "both claim four gradient hops");
        let pg: Vec<f32> = (0..run().partitions)
            .flat_map(|j| t.pseudo_gradient(j).expect("pg"))
            .collect();
        assert_eq!(pg.iter().all(|v| *v == 0.0), zero, "pseudo-gradient");
    }
    assert_eq!(free.inner_steps(), 0);
    assert_eq!(honest.inner_steps(), 2);
}

/// The last stage's forward of one sample by an honest miner and by `adversary`, given the
/// same input.
fn last_stage_forwards(adversary: Adversary) -> (iota_trainer::HopOutput, iota_trainer::HopOutput) {
    let x = trainer(1, None)
        .forward(6, Some(&activation(6)))
        .expect("fwd")
        .bytes
        .expect("out");
    let honest = trainer(2, None).forward(6, Some(&x)).expect("fwd");
    let cheat = trainer(2, Some(adversary))
        .forward(6, Some(&x))
        .expect("fwd");
    (honest, cheat)
}

#[test]
fn lazy_loss_halves_the_reported_loss_only() {
    let (honest, lazy) = last_stage_forwards(Adversary::LazyLoss);
    let (h, l) = (honest.loss.expect("loss"), lazy.loss.expect("loss"));
    assert!((l - 0.5 * h).abs() < 1e-6 * h.abs().max(1.0), "{l} vs {h}");
    let hs = honest.sequence_losses.expect("seq");
    let ls = lazy.sequence_losses.expect("seq");
    assert!(hs.iter().zip(&ls).all(|(h, l)| (l - 0.5 * h).abs() < 1e-6));
    assert_eq!(honest.bytes, lazy.bytes, "the gradient it sends is honest");
}

#[test]
fn forge_loss_halves_the_loss_and_drops_the_sequences_a_replay_checks() {
    let (honest, forged) = last_stage_forwards(Adversary::ForgeLoss);
    let (h, f) = (honest.loss.expect("loss"), forged.loss.expect("loss"));
    assert!((f - 0.5 * h).abs() < 1e-6 * h.abs().max(1.0), "{f} vs {h}");
    assert!(honest.sequence_losses.is_some());
    assert_eq!(forged.sequence_losses, None);
    assert_eq!(
        honest.bytes, forged.bytes,
        "the gradient it sends is honest"
    );
}

#[test]
fn wrong_merge_is_not_the_average() {
    let r = run();
    let parts = vec![(2.0, vec![0.1f32, 0.2, 0.3]), (1.0, vec![0.4f32, 0.5, 0.6])];
    let base = (vec![1.0f32, 1.0, 1.0], vec![0.0f32; 3]);
    let merge = |mode: Option<Adversary>, hotkey: &str| {
        merged_partition(&r, &parts, base.clone(), mode, hotkey).expect("merge")
    };
    let honest = merge(None, "a");
    assert_eq!(honest, merge(None, "b"), "honest merges are bit-identical");
    let (hv, hm) = decode_merged(&honest, 3).expect("decode");
    // Lone wrong mergers disagree with the honest result and with each other.
    let (wrong_a, wrong_b) = (
        merge(Some(Adversary::WrongMerge), "a"),
        merge(Some(Adversary::WrongMerge), "b"),
    );
    assert_ne!(wrong_a, wrong_b, "two lone wrong mergers agreed");
    for wrong in [&wrong_a, &wrong_b] {
        let (wv, wm) = decode_merged(wrong, 3).expect("decode");
        assert_eq!(hm, wm);
        assert!(
            wv[0] >= hv[0] + 1.0 && wv[0] < hv[0] + 2.0,
            "{} vs {}",
            wv[0],
            hv[0]
        );
        assert_eq!(&wv[1..], &hv[1..]);
    }
    // Colluders publish the same wrong bytes, whoever they are.
    let colluding = merge(Some(Adversary::ColludingMerge), "a");
    assert_eq!(colluding, merge(Some(Adversary::ColludingMerge), "b"));
    let (cv, _) = decode_merged(&colluding, 3).expect("decode");
    assert_eq!(cv[0], hv[0] + 1.0);
    // The honest result is the outer step on the weighted average (2/3·a + 1/3·b).
    let avg0 = (2.0 / 3.0) * 0.1f32 + (1.0 / 3.0) * 0.4;
    let expected0 = 1.0 - r.outer_lr as f32 * (avg0 + r.outer_momentum as f32 * avg0);
    assert!((hv[0] - expected0).abs() < 1e-5, "{} vs {expected0}", hv[0]);
}
