//! Durable storage for weight commits waiting to be revealed.
//!
//! A commit is only a hash on chain; revealing it needs the exact uids, values, salt and version
//! key. Losing them (a crash, a restart) forfeits the reveal, so they are saved *before* the
//! commit is submitted and removed once revealed. [`JsonFileCommitStore`] keeps them in a JSON
//! file replaced atomically; a validator with a database implements [`CommitStore`] on it.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::calls::Call;
use crate::client::{Subtensor, TxOptions, TxOutcome};
use crate::error::ChainError;
use crate::metagraph::Hyperparams;
use crate::wallet::{Keypair, PublicKey};

/// A commit whose reveal is still to come.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingCommit {
    /// The hotkey that committed.
    #[serde(serialize_with = "ser_key", deserialize_with = "de_key")]
    pub hotkey: PublicKey,
    /// The subnet.
    pub netuid: u16,
    /// Uids as they will be revealed.
    pub uids: Vec<u16>,
    /// Weights as they will be revealed.
    pub values: Vec<u16>,
    /// The random salt mixed into the hash.
    pub salt: Vec<u16>,
    /// Version key included in the hash.
    pub version_key: u64,
    /// The committed hash.
    #[serde(serialize_with = "ser_hash", deserialize_with = "de_hash")]
    pub hash: [u8; 32],
    /// Best block when the commit was submitted.
    pub submitted_block: u64,
    /// Block the commit landed in, once known.
    pub commit_block: Option<u64>,
    /// Epoch in which the reveal is accepted.
    pub reveal_epoch: u64,
    /// Set for a drand-timelocked commit (commit-reveal v3/v4), which the chain reveals itself:
    /// `uids`, `values` and `version_key` are what was sealed, `salt` is empty and `hash` is the
    /// blake2-256 of the ciphertext (as the chain's commit event names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timelock: Option<TimelockedCommit>,
}

/// What a timelocked commit was sealed to, for watching the chain reveal it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimelockedCommit {
    /// The drand round whose pulse opens it.
    pub reveal_round: u64,
    /// The epoch it was made in (the key the chain keeps it under).
    pub commit_epoch: u64,
    /// The first block of its reveal epoch, as predicted when it was made.
    pub reveal_from_block: u64,
}

impl PendingCommit {
    /// The hash as `0x…` hex.
    pub fn hash_hex(&self) -> String {
        format!("0x{}", hex::encode(self.hash))
    }
}

fn ser_key<S: Serializer>(key: &PublicKey, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&key.ss58())
}

fn de_key<'de, D: Deserializer<'de>>(d: D) -> Result<PublicKey, D::Error> {
    let text = String::deserialize(d)?;
    PublicKey::from_ss58(&text).map_err(serde::de::Error::custom)
}

fn ser_hash<S: Serializer>(hash: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("0x{}", hex::encode(hash)))
}

fn de_hash<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
    let text = String::deserialize(d)?;
    let bytes = hex::decode(text.trim_start_matches("0x")).map_err(serde::de::Error::custom)?;
    bytes
        .try_into()
        .map_err(|_| serde::de::Error::custom("hash must be 32 bytes"))
}

/// Where pending commits are kept between commit and reveal.
///
/// Implementations must make `save` durable before returning: the client submits the commit
/// only after it succeeds.
pub trait CommitStore: Send + Sync {
    /// Inserts `commit`, or replaces the one with the same hash.
    fn save(&self, commit: &PendingCommit) -> impl Future<Output = Result<(), ChainError>> + Send;

    /// Every pending commit of `hotkey`, oldest first.
    fn pending(
        &self,
        hotkey: &PublicKey,
    ) -> impl Future<Output = Result<Vec<PendingCommit>, ChainError>> + Send;

    /// Forgets the commit with `hash` (revealed, expired or rejected).
    fn remove(&self, hash: &[u8; 32]) -> impl Future<Output = Result<(), ChainError>> + Send;
}

/// Pending commits in process memory only: for tests and callers that accept losing them on
/// restart.
#[derive(Clone, Debug, Default)]
pub struct MemoryCommitStore {
    commits: Arc<std::sync::Mutex<Vec<PendingCommit>>>,
}

impl MemoryCommitStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<PendingCommit>) -> R) -> R {
        let mut guard = self
            .commits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut guard)
    }
}

impl CommitStore for MemoryCommitStore {
    async fn save(&self, commit: &PendingCommit) -> Result<(), ChainError> {
        self.with(|all| upsert(all, commit.clone()));
        Ok(())
    }

    async fn pending(&self, hotkey: &PublicKey) -> Result<Vec<PendingCommit>, ChainError> {
        Ok(self.with(|all| {
            all.iter()
                .filter(|c| &c.hotkey == hotkey)
                .cloned()
                .collect()
        }))
    }

    async fn remove(&self, hash: &[u8; 32]) -> Result<(), ChainError> {
        self.with(|all| all.retain(|c| &c.hash != hash));
        Ok(())
    }
}

fn upsert(all: &mut Vec<PendingCommit>, commit: PendingCommit) {
    match all.iter_mut().find(|c| c.hash == commit.hash) {
        Some(slot) => *slot = commit,
        None => all.push(commit),
    }
}

#[derive(Default, Serialize, Deserialize)]
struct FileContents {
    version: u32,
    commits: Vec<PendingCommit>,
}

/// Pending commits in a JSON file. Every change rewrites the file through a temporary file,
/// fsync and rename, so a crash leaves either the old or the new contents, never a torn file.
/// The file is created 0600: the salts let anyone test guesses against the public hashes.
#[derive(Clone, Debug)]
pub struct JsonFileCommitStore {
    path: PathBuf,
    // Serialises read-modify-write cycles within this process.
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl JsonFileCommitStore {
    /// A store at `path` (created on first save).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, reason: impl std::fmt::Display) -> ChainError {
        ChainError::CommitStore {
            path: self.path.display().to_string(),
            reason: reason.to_string(),
        }
    }

    async fn modify(
        &self,
        f: impl FnOnce(&mut Vec<PendingCommit>) + Send + 'static,
    ) -> Result<(), ChainError> {
        let _guard = self.lock.lock().await;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let _file_lock = lock_file(&path, true)?;
            let mut contents = read_file(&path)?;
            f(&mut contents.commits);
            contents.version = FILE_VERSION;
            write_atomic(&path, &contents)
        })
        .await
        .map_err(|e| self.err(e))?
        .map_err(|e| self.err(e))
    }

    async fn load(&self) -> Result<Vec<PendingCommit>, ChainError> {
        let _guard = self.lock.lock().await;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let _file_lock = lock_file(&path, false)?;
            read_file(&path)
        })
        .await
        .map_err(|e| self.err(e))?
        .map(|c| c.commits)
        .map_err(|e| self.err(e))
    }
}

/// The file format this client reads and writes.
const FILE_VERSION: u32 = 1;

/// Takes the store's lock file (`<file>.lock` beside it; the data file itself is replaced on
/// every write, so it cannot carry the lock): exclusive for a read-modify-write, shared for a
/// read. Held until the returned file is dropped, so two processes sharing a store (a validator
/// and `iota chain reveal`) cannot lose each other's commits.
fn lock_file(path: &Path, exclusive: bool) -> Result<std::fs::File, String> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    let lock_path = path.with_file_name(name);
    if let Some(dir) = lock_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let file = options
        .open(&lock_path)
        .map_err(|e| format!("lock file {}: {e}", lock_path.display()))?;
    if exclusive {
        file.lock()
    } else {
        file.lock_shared()
    }
    .map_err(|e| format!("cannot lock {}: {e}", lock_path.display()))?;
    Ok(file)
}

fn read_file(path: &Path) -> Result<FileContents, String> {
    let contents: FileContents = match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map_err(|e| format!("not a commit file: {e}"))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(FileContents::default()),
        Err(e) => return Err(e.to_string()),
    };
    if contents.version != FILE_VERSION {
        // Rewriting a newer format with this one could drop what it added (and the salts with it).
        return Err(format!(
            "commit file version {} is not the version {FILE_VERSION} this client reads; leaving it untouched",
            contents.version
        ));
    }
    Ok(contents)
}

fn write_atomic(path: &Path, contents: &FileContents) -> Result<(), String> {
    use std::io::Write as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "commits".to_owned());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let bytes = serde_json::to_vec_pretty(contents).map_err(|e| e.to_string())?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(&tmp).map_err(|e| e.to_string())?;
    file.write_all(&bytes).map_err(|e| e.to_string())?;
    file.sync_all().map_err(|e| e.to_string())?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())?;
    // Make the rename itself durable.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

impl CommitStore for JsonFileCommitStore {
    async fn save(&self, commit: &PendingCommit) -> Result<(), ChainError> {
        let commit = commit.clone();
        self.modify(move |all| upsert(all, commit)).await
    }

    async fn pending(&self, hotkey: &PublicKey) -> Result<Vec<PendingCommit>, ChainError> {
        let hotkey = *hotkey;
        Ok(self
            .load()
            .await?
            .into_iter()
            .filter(|c| c.hotkey == hotkey)
            .collect())
    }

    async fn remove(&self, hash: &[u8; 32]) -> Result<(), ChainError> {
        let hash = *hash;
        self.modify(move |all| all.retain(|c| c.hash != hash)).await
    }
}

impl Subtensor {
    /// Saves `pending` (durable before the commit exists on chain, so a crash cannot strand it),
    /// sends `call`, and saves it again with the block it landed in and that block's epoch.
    /// Returns the block. A refused commit is removed from the store (it will never need
    /// revealing); one whose fate is unknown (timeout, lost connection) is kept, so a later
    /// reveal pass can still settle it.
    pub(crate) async fn send_commit<S: CommitStore>(
        &self,
        call: &Call,
        hotkey: &Keypair,
        hp: &Hyperparams,
        pending: &mut PendingCommit,
        store: &S,
        tx: &TxOptions,
    ) -> Result<u64, ChainError> {
        store.save(pending).await?;
        let receipt = match self.submit(call, hotkey, tx).await {
            Ok(TxOutcome::Included(r)) => r,
            Ok(TxOutcome::DryRun { .. }) => {
                store.remove(&pending.hash).await?;
                return Err(ChainError::Rpc("unexpected dry run".into()));
            }
            Err(e) => {
                if e.is_dispatch_error() || matches!(e, ChainError::InvalidTransaction(_)) {
                    store.remove(&pending.hash).await?;
                }
                return Err(e);
            }
        };
        let block = receipt.block_number;
        pending.commit_block = Some(block);
        let at = self.at_best().await?;
        let commit_epoch = self.epoch_index_at(&at, hp.netuid, hp.tempo, block).await?;
        pending.reveal_epoch = commit_epoch + hp.reveal_period_epochs;
        if let Some(sealed) = pending.timelock.as_mut() {
            sealed.commit_epoch = commit_epoch;
        }
        store.save(pending).await?;
        Ok(block)
    }
}

/// Groups commits by netuid (used when revealing).
pub(crate) fn by_netuid(commits: Vec<PendingCommit>) -> BTreeMap<u16, Vec<PendingCommit>> {
    let mut out: BTreeMap<u16, Vec<PendingCommit>> = BTreeMap::new();
    for c in commits {
        out.entry(c.netuid).or_default().push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(hash: u8) -> PendingCommit {
        PendingCommit {
            hotkey: PublicKey::from_bytes([7; 32]),
            netuid: 1,
            uids: vec![0, 1],
            values: vec![65535, 100],
            salt: vec![1, 2, 3],
            version_key: 4,
            hash: [hash; 32],
            submitted_block: 10,
            commit_block: Some(11),
            reveal_epoch: 2,
            timelock: None,
        }
    }

    #[tokio::test]
    async fn json_store_survives_reopen_and_removes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/commits.json");
        let store = JsonFileCommitStore::new(&path);
        store.save(&sample(1)).await.expect("save");
        store.save(&sample(2)).await.expect("save");
        let mut updated = sample(1);
        updated.commit_block = Some(12);
        store.save(&updated).await.expect("replace");

        let reopened = JsonFileCommitStore::new(&path);
        let pending = reopened
            .pending(&PublicKey::from_bytes([7; 32]))
            .await
            .expect("load");
        assert_eq!(pending, vec![updated, sample(2)]);
        assert!(
            reopened
                .pending(&PublicKey::from_bytes([8; 32]))
                .await
                .expect("load")
                .is_empty()
        );
        reopened.remove(&[1; 32]).await.expect("remove");
        assert_eq!(
            store
                .pending(&PublicKey::from_bytes([7; 32]))
                .await
                .expect("load"),
            vec![sample(2)]
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // No temporary files are left behind: the data file and its lock file only.
        let mut names: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("list")
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["commits.json", "commits.json.lock"]);
    }

    #[tokio::test]
    async fn corrupt_file_is_an_error_not_an_empty_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("commits.json");
        std::fs::write(&path, b"{not json").expect("write");
        let store = JsonFileCommitStore::new(&path);
        let err = store
            .pending(&PublicKey::from_bytes([7; 32]))
            .await
            .expect_err("corrupt");
        assert!(matches!(err, ChainError::CommitStore { .. }), "{err}");
        // And a save does not silently overwrite it.
        assert!(store.save(&sample(1)).await.is_err());
        assert_eq!(std::fs::read(&path).expect("read"), b"{not json");
    }

    #[tokio::test]
    async fn another_version_is_refused_and_left_untouched() {
        let dir = std::env::temp_dir().join(format!("iota-commit-version-{}", std::process::id()));
        let path = dir.join("commits.json");
        std::fs::create_dir_all(&dir).unwrap();
        let newer = r#"{"version": 2, "commits": [], "salts_v2": {}}"#;
        std::fs::write(&path, newer).unwrap();
        let store = JsonFileCommitStore::new(&path);
        let err = store.save(&sample(1)).await.unwrap_err().to_string();
        assert!(err.contains("version 2"), "{err}");
        assert!(store.pending(&sample(1).hotkey).await.is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), newer);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn two_stores_on_one_file_lose_no_commit() {
        // Two handles with separate in-process locks stand for two processes: only the file lock
        // keeps their read-modify-write cycles apart.
        let dir = std::env::temp_dir().join(format!("iota-commit-lock-{}", std::process::id()));
        let path = dir.join("commits.json");
        let writers: Vec<_> = (0..2u8)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    let store = JsonFileCommitStore::new(&path);
                    rt.block_on(async {
                        for i in 0..25u8 {
                            store.save(&sample(w * 100 + i)).await.unwrap();
                        }
                    });
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let all = rt.block_on(JsonFileCommitStore::new(&path).load()).unwrap();
        assert_eq!(all.len(), 50);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
