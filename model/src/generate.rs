//! Using a trained model: text generation with key/value caches, and held-out loss.
//!
//! All stages run in one process. [`forward_cached`] feeds new positions through every stage,
//! bottleneck modules included (they act position by position), with one key/value cache per
//! block in a [`KvState`]: the prompt in one call (prefill), then one token per call. Its
//! logits equal those of the plain full-sequence forward ([`last_logits`]) to f32 rounding; the
//! tests check this position by position, across stage boundaries with and without bottleneck.
//!
//! Sampling ([`sample`]) is greedy at temperature 0, otherwise temperature plus nucleus (top-p),
//! drawn from [`SplitMix64`] seeded with [`GenerateOptions::seed`]: the same model, prompt and
//! options give the same tokens.

use candle_core::{DType, Device, Tensor};
use tokenizers::Tokenizer;

use crate::data::{Dataset, make_batch};
use crate::error::{ModelError, Result};
use crate::export::check_whole_model;
use crate::layers::KvCache;
use crate::rng::SplitMix64;
use crate::stage::{Stage, StageOutput};

/// The key/value caches of every block of a model: the positions fed so far.
#[derive(Debug, Clone)]
pub struct KvState {
    /// One cache per block, per stage.
    caches: Vec<Vec<KvCache>>,
    batch: Option<usize>,
}

impl KvState {
    /// Empty caches for the model `stages` (stages `0..K` of one config).
    pub fn new(stages: &[Stage]) -> Result<Self> {
        check_whole_model(stages)?;
        Ok(Self {
            caches: stages
                .iter()
                .map(|s| vec![KvCache::default(); s.num_blocks()])
                .collect(),
            batch: None,
        })
    }

    /// Positions fed so far.
    pub fn len(&self) -> usize {
        self.caches
            .first()
            .and_then(|c| c.first())
            .map_or(0, KvCache::len)
    }

    /// Whether no position was fed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Feed `tokens: [batch, n]` (u32), the `n` positions that follow those already in `state`,
/// through every stage; returns the logits of the last new position, `[batch, vocab]` f32. On
/// an error `state` is left as it was.
pub fn forward_cached(stages: &[Stage], state: &mut KvState, tokens: &Tensor) -> Result<Tensor> {
    check_whole_model(stages)?;
    if state.caches.len() != stages.len()
        || state
            .caches
            .iter()
            .zip(stages)
            .any(|(c, s)| c.len() != s.num_blocks())
    {
        return Err(ModelError::InvalidInput(
            "key/value state was made for another model".into(),
        ));
    }
    let (b, n) = tokens
        .dims2()
        .map_err(|_| ModelError::shape("tokens [batch, n]", &[0, 0], tokens.dims()))?;
    if let Some(sb) = state.batch
        && sb != b
    {
        return Err(ModelError::shape("tokens", &[sb, n], tokens.dims()));
    }
    // The caches hold tensors (shared, not copied), so a backup is cheap.
    let backup = state.caches.clone();
    match feed(stages, &mut state.caches, tokens, n) {
        Ok(l) => {
            state.batch = Some(b);
            Ok(l)
        }
        Err(e) => {
            state.caches = backup;
            Err(e)
        }
    }
}

fn feed(
    stages: &[Stage],
    caches: &mut [Vec<KvCache>],
    tokens: &Tensor,
    n: usize,
) -> Result<Tensor> {
    let mut x = tokens.clone();
    for (stage, c) in stages.iter().zip(caches.iter_mut()) {
        x = stage.run_cached(&x, c)?;
    }
    let last = &stages[stages.len() - 1];
    let logits = last.logits(&x.narrow(1, n - 1, 1)?)?;
    Ok(logits.squeeze(1)?.to_dtype(DType::F32)?)
}

/// The plain forward (no cache, the evaluation path of every stage): logits `[batch, vocab]` f32
/// of the last position of `tokens: [batch, t]`.
pub fn last_logits(stages: &[Stage], tokens: &Tensor) -> Result<Tensor> {
    check_whole_model(stages)?;
    let mut x = tokens.clone();
    for stage in &stages[..stages.len() - 1] {
        match stage.forward_eval(&x, None)? {
            StageOutput::Activations(a) => x = a,
            StageOutput::Loss(_) => {
                return Err(ModelError::InvalidInput(
                    "a middle stage gave a loss".into(),
                ));
            }
        }
    }
    let logits = stages[stages.len() - 1].last_logits(&x, 1)?;
    Ok(logits.squeeze(1)?.to_dtype(DType::F32)?)
}

/// How [`generate_tokens`] and [`generate`] pick and stop.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// 0 for greedy decoding (the first highest logit); otherwise logits are divided by it.
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose probabilities first reach this total
    /// (at least one token). In `(0, 1]`; 1 samples from the whole vocabulary.
    pub top_p: f64,
    /// Seed of the sampling generator.
    pub seed: u64,
    /// Stop when this token is produced (it is not returned). [`generate`] fills it from the
    /// tokenizer's end-of-text token when `None`.
    pub stop_token: Option<u32>,
    /// When the prompt plus `max_new_tokens` exceed `max_seq_len`: drop the prompt's oldest
    /// tokens if true, otherwise refuse.
    pub truncate_prompt: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop_token: None,
            truncate_prompt: false,
        }
    }
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            ..Self::default()
        }
    }

    /// Temperature and nucleus sampling with `seed`.
    pub fn sampled(max_new_tokens: usize, temperature: f64, top_p: f64, seed: u64) -> Self {
        Self {
            max_new_tokens,
            temperature,
            top_p,
            seed,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::InvalidInput(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidInput(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The stop token came.
    Stop,
    /// `max_new_tokens` were generated.
    Length,
}

/// What [`generate_tokens`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// The new tokens (without the stop token).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// Oldest prompt tokens dropped to fit `max_seq_len` (with `truncate_prompt`).
    pub prompt_tokens_dropped: usize,
}

/// Pick the next token from one position's `logits` (see [`GenerateOptions`]): greedy at
/// temperature 0 (no draw), else one draw `u = rng.next_f64()` against the probabilities
/// `softmax(logits / temperature)` (in f64) of the nucleus: all tokens in id order when
/// `top_p == 1`, else tokens by descending probability (ties by id) up to and including the
/// first at which the running sum reaches `top_p` times the total.
pub fn sample(logits: &[f32], opts: &GenerateOptions, rng: &mut SplitMix64) -> Result<u32> {
    opts.validate()?;
    if logits.is_empty() {
        return Err(ModelError::InvalidInput("no logits to sample from".into()));
    }
    if logits.iter().any(|l| !l.is_finite()) {
        return Err(ModelError::NonFinite("logits".into()));
    }
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if *l > logits[best] {
            best = i;
        }
    }
    if opts.temperature == 0.0 {
        return Ok(best as u32);
    }
    let max = f64::from(logits[best]);
    let weights: Vec<f64> = logits
        .iter()
        .map(|l| ((f64::from(*l) - max) / opts.temperature).exp())
        .collect();
    let order: Vec<usize> = if opts.top_p >= 1.0 {
        (0..weights.len()).collect()
    } else {
        let total: f64 = weights.iter().sum();
        let mut order: Vec<usize> = (0..weights.len()).collect();
        // Stable sort: equal probabilities stay in id order.
        order.sort_by(|a, b| weights[*b].total_cmp(&weights[*a]));
        let mut kept = 0;
        let mut sum = 0.0;
        for i in &order {
            sum += weights[*i];
            kept += 1;
            if sum >= opts.top_p * total {
                break;
            }
        }
        order.truncate(kept);
        order
    };
    let kept_total: f64 = order.iter().map(|i| weights[*i]).sum();
    let mut u = rng.next_f64() * kept_total;
    for i in &order {
        if u < weights[*i] {
            return Ok(*i as u32);
        }
        u -= weights[*i];
    }
    // Rounding can leave u just past the last weight: that token, then.
    Ok(*order.last().unwrap_or(&best) as u32)
}

/// Generate up to `opts.max_new_tokens` tokens after `prompt` (at least one token) with the
/// model `stages`, using the key/value caches. The prompt plus the new tokens must fit in
/// `max_seq_len` positions (see [`GenerateOptions::truncate_prompt`]).
pub fn generate_tokens(
    stages: &[Stage],
    prompt: &[u32],
    opts: &GenerateOptions,
) -> Result<Generation> {
    opts.validate()?;
    let cfg = check_whole_model(stages)?;
    if prompt.is_empty() {
        return Err(ModelError::InvalidInput(
            "the prompt has no tokens (generation needs at least one)".into(),
        ));
    }
    let max = cfg.max_seq_len;
    let mut dropped = 0;
    if prompt.len() + opts.max_new_tokens > max {
        if !opts.truncate_prompt || opts.max_new_tokens >= max {
            return Err(ModelError::InvalidInput(format!(
                "{} prompt tokens plus {} new tokens exceed the model's max_seq_len {max}",
                prompt.len(),
                opts.max_new_tokens
            )));
        }
        dropped = prompt.len() + opts.max_new_tokens - max;
    }
    let prompt = &prompt[dropped..];
    let mut state = KvState::new(stages)?;
    let mut rng = SplitMix64::new(opts.seed);
    let mut tokens = Vec::with_capacity(opts.max_new_tokens);
    if opts.max_new_tokens == 0 {
        return Ok(Generation {
            tokens,
            finish: Finish::Length,
            prompt_tokens_dropped: dropped,
        });
    }
    let input = Tensor::from_vec(prompt.to_vec(), (1, prompt.len()), &Device::Cpu)?;
    let mut logits = forward_cached(stages, &mut state, &input)?;
    loop {
        let row = logits.squeeze(0)?.to_vec1::<f32>()?;
        let next = sample(&row, opts, &mut rng)?;
        if opts.stop_token == Some(next) {
            return Ok(Generation {
                tokens,
                finish: Finish::Stop,
                prompt_tokens_dropped: dropped,
            });
        }
        tokens.push(next);
        if tokens.len() == opts.max_new_tokens {
            return Ok(Generation {
                tokens,
                finish: Finish::Length,
                prompt_tokens_dropped: dropped,
            });
        }
        let input = Tensor::from_vec(vec![next], (1, 1), &Device::Cpu)?;
        logits = forward_cached(stages, &mut state, &input)?;
    }
}

/// The tokenizer's end-of-text token (the one the datasets append to every document).
pub fn end_of_text(tokenizer: &Tokenizer) -> Option<u32> {
    crate::data::eos_token(tokenizer)
}

/// Continue `prompt`: encode it (without added special tokens, as the text datasets do),
/// [`generate_tokens`] (stopping at the tokenizer's end-of-text token unless
/// `opts.stop_token` names another), and decode the new tokens (special tokens skipped).
pub fn generate(
    stages: &[Stage],
    tokenizer: &Tokenizer,
    prompt: &str,
    opts: &GenerateOptions,
) -> Result<String> {
    let tok_err = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
    let ids = tokenizer.encode(prompt, false).map_err(tok_err)?;
    let opts = GenerateOptions {
        stop_token: opts.stop_token.or_else(|| end_of_text(tokenizer)),
        ..opts.clone()
    };
    let out = generate_tokens(stages, ids.get_ids(), &opts)?;
    tokenizer.decode(&out.tokens, true).map_err(tok_err)
}

/// Loss on held-out windows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeldOutLoss {
    /// Mean next-token cross-entropy over every token of the windows (nats).
    pub loss: f32,
    /// `exp(loss)`.
    pub perplexity: f32,
    /// Tokens scored.
    pub tokens: usize,
}

/// Mean next-token loss of the model `stages` over the windows `ids` of `dataset`, in batches
/// of at most `batch_size` windows (the evaluation forward, no gradients), and its perplexity.
pub fn held_out_loss(
    stages: &[Stage],
    dataset: &dyn Dataset,
    ids: &[u64],
    batch_size: usize,
) -> Result<HeldOutLoss> {
    check_whole_model(stages)?;
    if ids.is_empty() || batch_size == 0 {
        return Err(ModelError::InvalidInput(
            "held-out loss needs window ids and a positive batch size".into(),
        ));
    }
    let device = &stages[0].options().device;
    let (mut sum, mut tokens) = (0f64, 0usize);
    for chunk in ids.chunks(batch_size) {
        let batch = make_batch(dataset, chunk, device)?;
        let mut x = batch.inputs;
        for stage in stages {
            let targets = stage.is_last().then_some(&batch.targets);
            match stage.forward_eval(&x, targets)? {
                StageOutput::Activations(a) => x = a,
                StageOutput::Loss(l) => {
                    // Batches weigh by their tokens: the result is the mean over all tokens.
                    sum += f64::from(l.mean) * l.tokens as f64;
                    tokens += l.tokens;
                }
            }
        }
    }
    let loss = sum / tokens.max(1) as f64;
    Ok(HeldOutLoss {
        loss: loss as f32,
        perplexity: loss.exp() as f32,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::data::GrammarCorpus;
    use crate::pipeline::Pipeline;
    use crate::stage::StageOptions;

    /// `tiny` with larger initial weights: attention is sharp, so a position or cache error
    /// changes the logits far beyond rounding (at `tiny`'s init, attention is nearly uniform).
    pub(crate) fn sharp(cfg: ModelConfig) -> ModelConfig {
        ModelConfig {
            init_std: 0.3,
            ..cfg
        }
    }

    fn configs() -> Vec<ModelConfig> {
        vec![
            // Bottlenecks at both boundaries; the middle stage's one block decodes and encodes.
            sharp(ModelConfig::tiny()),
            // No bottleneck, uneven stages.
            sharp(
                ModelConfig::tiny()
                    .with_bottleneck(32)
                    .with_stages(vec![2, 1]),
            ),
            // Bottlenecks, several blocks per stage.
            sharp(ModelConfig::tiny().with_stages(vec![1, 2, 2])),
            // One stage: no boundary.
            sharp(ModelConfig::tiny().with_stages(vec![2])),
        ]
    }

    fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
        let mut r = SplitMix64::new(seed);
        (0..n)
            .map(|_| (r.next_u64() % vocab as u64) as u32)
            .collect()
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    /// Largest |a - b| over the largest |b|.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) = (rows(a), rows(b));
        let mut diff = 0f32;
        let mut scale = 0f32;
        for (ra, rb) in a.iter().zip(&b) {
            assert_eq!(ra.len(), rb.len());
            for (x, y) in ra.iter().zip(rb) {
                diff = diff.max((x - y).abs());
                scale = scale.max(y.abs());
            }
        }
        diff / scale
    }

    fn argmax(v: &[f32]) -> u32 {
        let mut best = 0;
        for (i, x) in v.iter().enumerate() {
            if *x > v[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The cached forward (prefill in pieces, then one position at a time, two sequences in a
    /// batch) gives at every position the logits the full forward gives for the prefix ending
    /// there.
    #[test]
    fn cached_logits_equal_full_forward() {
        for cfg in configs() {
            let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
            let (b, t) = (2, 20);
            let seq = tokens(b * t, 3, cfg.vocab_size);
            let seq = Tensor::from_vec(seq, (b, t), &Device::Cpu).unwrap();
            let mut state = KvState::new(&stages).unwrap();
            // Prefill 5 then 3 positions, then one at a time.
            let mut pos = 0;
            let mut worst = 0f32;
            let mut moved = 0f32;
            let mut previous: Option<Tensor> = None;
            for n in [5, 3].into_iter().chain(std::iter::repeat(1)) {
                if pos + n > t {
                    break;
                }
                let cached =
                    forward_cached(&stages, &mut state, &seq.narrow(1, pos, n).unwrap()).unwrap();
                pos += n;
                assert_eq!(state.len(), pos);
                let full = last_logits(&stages, &seq.narrow(1, 0, pos).unwrap()).unwrap();
                assert_eq!(cached.dims(), &[b, cfg.vocab_size]);
                let e = rel_diff(&cached, &full);
                assert!(
                    e < 5e-5,
                    "{:?} stages, position {pos}: cached vs full {e:e}",
                    cfg.stages
                );
                worst = worst.max(e);
                if let Some(p) = previous {
                    moved = moved.max(rel_diff(&cached, &p));
                }
                previous = Some(cached);
            }
            assert_eq!(pos, t);
            // The logits change from position to position by far more than the tolerance.
            assert!(
                moved > 0.1,
                "{:?}: logits hardly move ({moved})",
                cfg.stages
            );
            eprintln!("{:?}: cached vs full, worst {worst:e}", cfg.stages);
        }
    }

    /// A failed call leaves the caches as they were; positions past max_seq_len are refused.
    #[test]
    fn cached_forward_errors_leave_the_state_alone() {
        let cfg = ModelConfig {
            max_seq_len: 8,
            ..sharp(ModelConfig::tiny())
        };
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let mut state = KvState::new(&stages).unwrap();
        let seq = Tensor::from_vec(tokens(8, 1, 64), (1, 8), &Device::Cpu).unwrap();
        forward_cached(&stages, &mut state, &seq.narrow(1, 0, 6).unwrap()).unwrap();
        let bad = Tensor::from_vec(vec![3u32, 64], (1, 2), &Device::Cpu).unwrap();
        assert!(matches!(
            forward_cached(&stages, &mut state, &bad),
            Err(ModelError::TokenOutOfRange { id: 64, .. })
        ));
        assert_eq!(state.len(), 6);
        let too_long = Tensor::from_vec(tokens(3, 2, 64), (1, 3), &Device::Cpu).unwrap();
        assert!(forward_cached(&stages, &mut state, &too_long).is_err());
        assert_eq!(state.len(), 6);
        let two = Tensor::from_vec(tokens(2, 2, 64), (2, 1), &Device::Cpu).unwrap();
        assert!(
            forward_cached(&stages, &mut state, &two).is_err(),
            "batch changed"
        );
        let rest = forward_cached(&stages, &mut state, &seq.narrow(1, 6, 2).unwrap()).unwrap();
        let full = last_logits(&stages, &seq).unwrap();
        assert!(rel_diff(&rest, &full) < 5e-5);
    }

    /// Greedy decoding repeats itself and picks, at every step, the argmax of the full
    /// forward's logits for the text so far.
    #[test]
    fn greedy_is_deterministic_and_follows_the_full_forward() {
        for cfg in configs() {
            let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
            let prompt = tokens(4, 9, cfg.vocab_size);
            let opts = GenerateOptions::greedy(16);
            let a = generate_tokens(&stages, &prompt, &opts).unwrap();
            let b = generate_tokens(&stages, &prompt, &opts).unwrap();
            assert_eq!(a, b);
            assert_eq!(a.tokens.len(), 16);
            assert_eq!(a.finish, Finish::Length);
            let mut text = prompt.clone();
            for next in &a.tokens {
                let t = Tensor::from_vec(text.clone(), (1, text.len()), &Device::Cpu).unwrap();
                let full = rows(&last_logits(&stages, &t).unwrap()).remove(0);
                assert_eq!(*next, argmax(&full), "{:?} after {text:?}", cfg.stages);
                text.push(*next);
            }
            // Not a constant: the model's choices depend on the text.
            let distinct: std::collections::BTreeSet<_> = a.tokens.iter().collect();
            assert!(distinct.len() > 1, "{:?}", a.tokens);
        }
    }

    #[test]
    fn same_seed_same_sample_and_seeds_differ() {
        let cfg = sharp(ModelConfig::tiny());
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let prompt = tokens(3, 4, cfg.vocab_size);
        let run = |seed, temperature, top_p| {
            generate_tokens(
                &stages,
                &prompt,
                &GenerateOptions::sampled(24, temperature, top_p, seed),
            )
            .unwrap()
            .tokens
        };
        let greedy = generate_tokens(&stages, &prompt, &GenerateOptions::greedy(24))
            .unwrap()
            .tokens;
        for (temperature, top_p) in [(1.0, 1.0), (1.5, 0.9)] {
            let first = run(7, temperature, top_p);
            assert_eq!(first, run(7, temperature, top_p), "same seed, same tokens");
            assert_ne!(first, greedy, "sampling is not greedy");
            let others: Vec<_> = (8..12).map(|s| run(s, temperature, top_p)).collect();
            assert!(
                others.iter().all(|o| *o != first),
                "another seed gave the same 24 tokens"
            );
        }
        // A nucleus of (almost) nothing keeps only the most likely token: greedy, any seed.
        for seed in 0..4 {
            assert_eq!(run(seed, 1.0, 1e-9), greedy);
        }
    }

    /// The nucleus holds the most likely tokens up to top_p of the mass and nothing else, and
    /// draws within it by probability.
    #[test]
    fn nucleus_sampling_keeps_exactly_the_top_mass() {
        // Probabilities 0.1, 0.5, 0.15, 0.25 at temperature 1.
        let p = [0.1f64, 0.5, 0.15, 0.25];
        let logits: Vec<f32> = p.iter().map(|x| x.ln() as f32).collect();
        let count = |top_p: f64| {
            let mut rng = SplitMix64::new(5);
            let opts = GenerateOptions::sampled(1, 1.0, top_p, 0);
            let mut c = [0usize; 4];
            for _ in 0..20_000 {
                c[sample(&logits, &opts, &mut rng).unwrap() as usize] += 1;
            }
            c
        };
        // 0.5 + 0.25 = 0.75 reaches 0.7: tokens 1 and 3, in the ratio 2:1.
        let c = count(0.7);
        assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
        let share = c[1] as f64 / 20_000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.02, "{c:?}");
        // 0.75 does not reach 0.8: token 2 joins.
        let c = count(0.8);
        assert_eq!(c[0], 0, "{c:?}");
        assert!(c[2] > 0, "{c:?}");
        // All of it: every token, by probability.
        let c = count(1.0);
        for (i, pi) in p.iter().enumerate() {
            assert!((c[i] as f64 / 20_000.0 - pi).abs() < 0.02, "{c:?}");
        }
        // Temperature 0 is the argmax, whatever the nucleus.
        let mut rng = SplitMix64::new(1);
        let g = GenerateOptions::sampled(1, 0.0, 0.3, 0);
        assert_eq!(sample(&logits, &g, &mut rng).unwrap(), 1);
        assert!(
            sample(
                &logits,
                &GenerateOptions::sampled(1, -1.0, 1.0, 0),
                &mut rng
            )
            .is_err()
        );
        assert!(sample(&logits, &GenerateOptions::sampled(1, 1.0, 0.0, 0), &mut rng).is_err());
        assert!(sample(&[f32::NAN, 0.0], &g, &mut rng).is_err());
    }

    #[test]
    fn generation_stops_at_the_stop_token() {
        let cfg = sharp(ModelConfig::tiny());
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let prompt = tokens(4, 9, cfg.vocab_size);
        let all = generate_tokens(&stages, &prompt, &GenerateOptions::greedy(16))
            .unwrap()
            .tokens;
        let stop = all[5];
        let first = all.iter().position(|t| *t == stop).unwrap();
        let g = generate_tokens(
            &stages,
            &prompt,
            &GenerateOptions {
                stop_token: Some(stop),
                ..GenerateOptions::greedy(16)
            },
        )
        .unwrap();
        assert_eq!(g.tokens, all[..first]);
        assert_eq!(g.finish, Finish::Stop);
    }

    #[test]
    fn context_length_is_refused_or_truncated() {
        let cfg = ModelConfig {
            max_seq_len: 12,
            ..sharp(ModelConfig::tiny())
        };
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let prompt = tokens(10, 2, cfg.vocab_size);
        let err = generate_tokens(&stages, &prompt, &GenerateOptions::greedy(4)).unwrap_err();
        assert!(err.to_string().contains("max_seq_len 12"), "{err}");
        // Exactly full is fine.
        let g = generate_tokens(&stages, &prompt, &GenerateOptions::greedy(2)).unwrap();
        assert_eq!(g.tokens.len(), 2);
        let truncating = GenerateOptions {
            truncate_prompt: true,
            ..GenerateOptions::greedy(4)
        };
        let g = generate_tokens(&stages, &prompt, &truncating).unwrap();
        assert_eq!(g.prompt_tokens_dropped, 2);
        assert_eq!(g.tokens.len(), 4);
        let same = generate_tokens(&stages, &prompt[2..], &GenerateOptions::greedy(4)).unwrap();
        assert_eq!(g.tokens, same.tokens);
        // No room for any prompt token, and no prompt at all.
        let none = GenerateOptions {
            truncate_prompt: true,
            ..GenerateOptions::greedy(12)
        };
        assert!(generate_tokens(&stages, &prompt, &none).is_err());
        assert!(generate_tokens(&stages, &[], &GenerateOptions::greedy(1)).is_err());
    }

    /// The held-out loss is the token mean over all windows (batches of unequal size weigh by
    /// their tokens), equal to the pipeline's loss of one batch of them all.
    #[test]
    fn held_out_loss_is_the_token_mean() {
        let cfg = ModelConfig::tiny();
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let g = GrammarCorpus::new(1, 16).unwrap();
        let ids = [100u64, 101, 102, 103, 104];
        let h = held_out_loss(&stages, &g, &ids, 2).unwrap();
        assert_eq!(h.tokens, 5 * 16);
        let p = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let b = make_batch(&g, &ids, &Device::Cpu).unwrap();
        let all = p.eval_loss(&b.inputs, &b.targets).unwrap();
        assert!((h.loss - all).abs() < 1e-5, "{} vs {all}", h.loss);
        assert!((h.perplexity - all.exp()).abs() < 1e-3 * all.exp());
        // The unweighted mean of the three batch means differs: the weighting is real.
        let means: Vec<f32> = ids
            .chunks(2)
            .map(|c| {
                let b = make_batch(&g, c, &Device::Cpu).unwrap();
                p.eval_loss(&b.inputs, &b.targets).unwrap()
            })
            .collect();
        let unweighted = means.iter().sum::<f32>() / 3.0;
        assert!((unweighted - all).abs() > 1e-4, "{means:?}");
        assert!(held_out_loss(&stages, &g, &[], 2).is_err());
    }
}
