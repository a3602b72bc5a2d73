//! Wallets on disk: files written by the Python `bittensor-wallet`, files we write, and every
//! way a keyfile can be wrong.
//!
//! Fixtures in `tests/fixtures/btwallet/` are throwaway keys generated with
//! `bittensor-wallet` 4.1.1 from PyPI, password `correct horse`:
//!
//! ```python
//! w = Wallet(name="fixture", hotkey="default", path=".../wallets")
//! w.regenerate_coldkey(mnemonic=COLD, use_password=True, coldkey_password="correct horse")
//! w.regenerate_hotkey(mnemonic=HOT, use_password=False)
//! open("ansible_coldkey", "wb").write(legacy_encrypt_keyfile_data(
//!     serialized_keypair_to_keyfile_data(w.get_coldkey(password="correct horse")), "correct horse"))
//! ```
//!
//! Each NaCl encryption or decryption runs Argon2i with 512 MiB and 8 passes, so the tests
//! that need one are few.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use iota_chain::wallet::cli::{WalletCommand, run_with_password};
use iota_chain::wallet::password::{encode_env_password, env_var_name};
use iota_chain::wallet::{
    Keyfile, KeyfileEncryption, Keypair, PasswordSource, Wallet, WalletError,
};
use tempfile::TempDir;

const PASSWORD: &str = "correct horse";
const COLD_MNEMONIC: &str =
    "actual note object bunker scare voice rib life endless ahead trap give";
const COLD_SS58: &str = "5ChZYomNX9nFhKBThkdMUhsneWcAkrdBH5cJh27Q6SBxkzmR";
const HOT_MNEMONIC: &str =
    "soldier text human urge tourist art curtain alone final grid water jungle";
const HOT_SS58: &str = "5D2g2u69Da1vNXREBnv2evyTmvUMzTA8Zn9eTNcJHGXT2vhi";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/btwallet")
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("create fixture copy dir");
    for entry in fs::read_dir(from).expect("read fixture dir") {
        let entry = entry.expect("fixture dir entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("fixture file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), &target).expect("copy fixture");
            fs::set_permissions(&target, fs::Permissions::from_mode(0o600))
                .expect("chmod fixture copy");
        }
    }
}

/// A private copy of the Python-made wallets, so tests never touch the checked-in files.
fn python_wallets() -> (TempDir, Wallet) {
    let dir = TempDir::new().expect("temp dir");
    copy_dir(&fixtures(), dir.path());
    let wallet =
        Wallet::new(dir.path().join("wallets"), "fixture", "default").expect("fixture wallet");
    (dir, wallet)
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("stat").permissions().mode() & 0o777
}

fn names_path(err: &WalletError, path: &Path) -> bool {
    err.to_string().contains(&path.display().to_string())
}

// ---------------------------------------------------------------------------------------------
// Files written by bittensor-wallet
// ---------------------------------------------------------------------------------------------

#[test]
fn reads_a_wallet_written_by_python_btwallet() {
    let (_dir, wallet) = python_wallets();
    assert_eq!(wallet.coldkeypub().unwrap().ss58(), COLD_SS58);
    assert_eq!(wallet.hotkeypub().unwrap().ss58(), HOT_SS58);

    // Unencrypted hotkey: no password is asked for.
    let hotkey = wallet.hotkey(&PasswordSource::EnvOnly).unwrap();
    assert_eq!(hotkey.ss58(), HOT_SS58);
    assert_eq!(hotkey.mnemonic(), Some(HOT_MNEMONIC));

    // `$NACL` coldkey (Argon2i + XSalsa20-Poly1305).
    assert_eq!(
        wallet.coldkey_file().encryption().unwrap(),
        KeyfileEncryption::Nacl
    );
    let coldkey = wallet.coldkey(&PasswordSource::given(PASSWORD)).unwrap();
    assert_eq!(coldkey.ss58(), COLD_SS58);
    assert_eq!(coldkey.mnemonic(), Some(COLD_MNEMONIC));
    let sig = coldkey.sign(b"iota");
    assert!(wallet.coldkeypub().unwrap().verify(b"iota", &sig));
}

#[test]
fn reads_a_legacy_ansible_vault_coldkey() {
    let (dir, _) = python_wallets();
    let file = Keyfile::new(dir.path().join("ansible_coldkey"));
    assert_eq!(file.encryption().unwrap(), KeyfileEncryption::AnsibleVault);
    let key = file.keypair(&PasswordSource::given(PASSWORD)).unwrap();
    assert_eq!(key.ss58(), COLD_SS58);

    let err = file
        .keypair(&PasswordSource::given("wrong horse"))
        .unwrap_err();
    assert!(
        matches!(&err, WalletError::WrongPassword { path } if path == file.path()),
        "{err}"
    );
}

#[test]
fn wrong_password_fails_and_leaves_the_file_untouched() {
    let (_dir, wallet) = python_wallets();
    let path = wallet.coldkey_file().path().to_path_buf();
    let before = fs::read(&path).unwrap();

    let err = wallet
        .coldkey(&PasswordSource::given("battery staple"))
        .unwrap_err();
    assert!(
        matches!(&err, WalletError::WrongPassword { path: p } if *p == path),
        "{err}"
    );
    assert!(names_path(&err, &path), "{err}");
    assert_eq!(fs::read(&path).unwrap(), before);
}

#[test]
fn no_password_source_is_a_clear_error() {
    let (_dir, wallet) = python_wallets();
    let file = wallet.coldkey_file();
    // EnvOnly with no BT_PW_ variable set fails before any key derivation.
    let err = wallet.coldkey(&PasswordSource::EnvOnly).unwrap_err();
    match &err {
        WalletError::PasswordUnavailable { path, env_var, .. } => {
            assert_eq!(path, file.path());
            assert_eq!(*env_var, env_var_name(file.path()));
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(err.to_string().contains("BT_PW_"), "{err}");
}

/// Runs in a child process that has the `BT_PW_…` variable set (see the next test); in a normal
/// test run the marker variable is absent and it does nothing.
#[test]
fn env_password_child() {
    let Some(root) = std::env::var_os("IOTA_WALLET_ENV_CHILD_ROOT") else {
        return;
    };
    let wallet = Wallet::new(PathBuf::from(root), "fixture", "default").unwrap();
    let coldkey = wallet.coldkey(&PasswordSource::EnvOnly).unwrap();
    assert_eq!(coldkey.ss58(), COLD_SS58);
}

#[test]
fn password_is_read_from_the_bt_pw_environment_variable() {
    let (dir, wallet) = python_wallets();
    let var = wallet.coldkey_file().env_var_name();
    assert!(
        var.starts_with("BT_PW_") && var.ends_with("_FIXTURE_COLDKEY"),
        "{var}"
    );
    // Setting variables in this process would need `unsafe`; a child process gets its own.
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "wallet::env_password_child",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("IOTA_WALLET_ENV_CHILD_ROOT", dir.path().join("wallets"))
        .env(&var, encode_env_password(&var, PASSWORD))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}

// ---------------------------------------------------------------------------------------------
// Files we write
// ---------------------------------------------------------------------------------------------

#[test]
fn encrypted_coldkey_round_trips_with_private_permissions() {
    let dir = TempDir::new().unwrap();
    let wallet = Wallet::new(dir.path().join("wallets"), "alice", "default").unwrap();
    let created = wallet
        .create_coldkey(12, Some(&PasswordSource::given(PASSWORD)), false)
        .unwrap();
    assert_eq!(created.mnemonic().unwrap().split(' ').count(), 12);

    let secret = wallet.coldkey_file();
    let raw = fs::read(secret.path()).unwrap();
    assert!(raw.starts_with(b"$NACL"));
    assert!(!String::from_utf8_lossy(&raw).contains(created.mnemonic().unwrap()));
    assert_eq!(mode(secret.path()), 0o600);
    assert_eq!(mode(wallet.coldkeypub_file().path()), 0o600);
    assert_eq!(mode(&wallet.dir()), 0o700);

    assert_eq!(wallet.coldkeypub().unwrap(), created.public());
    let loaded = wallet.coldkey(&PasswordSource::given(PASSWORD)).unwrap();
    assert_eq!(loaded.public(), created.public());
    assert_eq!(loaded.mnemonic(), created.mnemonic());
    assert_eq!(loaded.seed(), created.seed());

    // No temporary files are left next to the keys.
    let leftovers: Vec<_> = fs::read_dir(wallet.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn hotkeys_are_plain_json_with_btwallet_fields() {
    let dir = TempDir::new().unwrap();
    let wallet = Wallet::new(dir.path(), "bob", "miner1").unwrap();
    let created = wallet.create_hotkey(15, None, false).unwrap();
    let path = wallet.hotkey_file().path().to_path_buf();
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&dir.path().join("bob/hotkeys")), 0o700);

    let json: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    let public_hex = created.public().to_hex();
    assert_eq!(json["accountId"], public_hex.as_str());
    assert_eq!(json["publicKey"], public_hex.as_str());
    assert_eq!(json["ss58Address"], created.ss58().as_str());
    assert_eq!(json["secretPhrase"], created.mnemonic().unwrap());
    let seed_hex = format!("0x{}", hex::encode(created.seed().unwrap()));
    assert_eq!(json["secretSeed"], seed_hex.as_str());
    assert_eq!(json["privateKey"].as_str().unwrap().len(), 2 + 128);
    // btwallet 4.0.x rejects non-string fields, so cryptoType is not written.
    assert!(json.get("cryptoType").is_none());

    let public: serde_json::Value =
        serde_json::from_slice(&fs::read(wallet.hotkeypub_file().path()).unwrap()).unwrap();
    assert_eq!(public["ss58Address"], created.ss58().as_str());
    assert!(public.get("privateKey").is_none() && public.get("secretPhrase").is_none());

    assert_eq!(
        wallet.hotkey(&PasswordSource::EnvOnly).unwrap().public(),
        created.public()
    );
    assert_eq!(wallet.hotkey_names().unwrap(), ["miner1"]);
}

#[test]
fn hotkey_files_load_phrase_then_seed_then_private_key() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("hk");
    let by_phrase = Keypair::from_mnemonic(HOT_MNEMONIC).unwrap();
    let by_seed = Keypair::from_seed([5; 32]);
    let by_private = Keypair::from_seed([6; 32]);
    let seed = format!("0x{}", hex::encode([5_u8; 32]));
    let private = format!("0x{}", hex::encode(by_private.private_key().as_slice()));
    let cases = [
        (
            serde_json::json!({"secretPhrase": HOT_MNEMONIC, "secretSeed": seed, "privateKey": private}),
            by_phrase.public(),
        ),
        (
            serde_json::json!({"secretSeed": seed, "privateKey": private}),
            by_seed.public(),
        ),
        (
            serde_json::json!({"privateKey": private}),
            by_private.public(),
        ),
    ];
    for (json, expected) in cases {
        fs::write(&path, json.to_string()).unwrap();
        let key = Keyfile::new(&path)
            .keypair(&PasswordSource::EnvOnly)
            .unwrap();
        assert_eq!(key.public(), expected, "{json}");
    }
    // A privateKey-only key cannot hand out a seed but still signs verifiably.
    let key = Keyfile::new(&path)
        .keypair(&PasswordSource::EnvOnly)
        .unwrap();
    assert!(key.seed().is_none());
    assert!(by_private.public().verify(b"m", &key.sign(b"m")));

    // Public fields only: readable as a public key, refused as a signing key.
    fs::write(&path, format!("{{\"ss58Address\":\"{HOT_SS58}\"}}")).unwrap();
    let file = Keyfile::new(&path);
    assert_eq!(file.public_key().unwrap().ss58(), HOT_SS58);
    let err = file.keypair(&PasswordSource::EnvOnly).unwrap_err();
    assert!(
        matches!(&err, WalletError::PublicOnly { path: p } if *p == path),
        "{err}"
    );
}

#[test]
fn overwrite_needs_an_explicit_flag() {
    let dir = TempDir::new().unwrap();
    let wallet = Wallet::new(dir.path(), "carol", "default").unwrap();
    wallet.create_coldkey(12, None, false).unwrap();
    let first_hot = wallet.create_hotkey(12, None, false).unwrap();
    let cold_before = fs::read(wallet.coldkey_file().path()).unwrap();
    let hot_before = fs::read(wallet.hotkey_file().path()).unwrap();

    let err = wallet.create_coldkey(12, None, false).unwrap_err();
    assert!(
        matches!(&err, WalletError::AlreadyExists { path } if path == wallet.coldkey_file().path()),
        "{err}"
    );
    assert!(err.to_string().contains("--overwrite"), "{err}");
    let err = wallet
        .set_hotkey(&Keypair::generate(12).unwrap(), None, false)
        .unwrap_err();
    assert!(matches!(err, WalletError::AlreadyExists { .. }), "{err}");
    assert_eq!(fs::read(wallet.coldkey_file().path()).unwrap(), cold_before);
    assert_eq!(fs::read(wallet.hotkey_file().path()).unwrap(), hot_before);

    // A leftover pub file alone also blocks a new key, so the pair never disagrees.
    let other = wallet.with_hotkey("second").unwrap();
    fs::create_dir_all(other.hotkeypub_file().path().parent().unwrap()).unwrap();
    fs::write(other.hotkeypub_file().path(), b"{}").unwrap();
    assert!(matches!(
        other.create_hotkey(12, None, false),
        Err(WalletError::AlreadyExists { .. })
    ));
    assert!(!other.hotkey_file().exists());

    let second_hot = wallet.create_hotkey(12, None, true).unwrap();
    assert_ne!(second_hot.public(), first_hot.public());
    assert_eq!(wallet.hotkeypub().unwrap(), second_hot.public());
    assert_eq!(mode(wallet.hotkey_file().path()), 0o600);
}

// ---------------------------------------------------------------------------------------------
// Broken and missing files
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_wallet_is_not_found_with_path() {
    let dir = TempDir::new().unwrap();
    let wallet = Wallet::new(dir.path(), "nobody", "default").unwrap();
    for err in [
        wallet.coldkey(&PasswordSource::EnvOnly).unwrap_err(),
        wallet.coldkeypub().unwrap_err(),
        wallet.hotkey(&PasswordSource::EnvOnly).unwrap_err(),
        wallet.hotkeypub().unwrap_err(),
    ] {
        assert!(matches!(err, WalletError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("nobody"), "{err}");
    }
}

#[test]
fn corrupt_and_truncated_files_name_the_path() {
    let (dir, wallet) = python_wallets();

    // A $NACL file cut inside its nonce: reported as corrupt, without running Argon2.
    let coldkey = wallet.coldkey_file();
    let full = fs::read(coldkey.path()).unwrap();
    fs::write(coldkey.path(), &full[..20]).unwrap();
    let err = wallet
        .coldkey(&PasswordSource::given(PASSWORD))
        .unwrap_err();
    assert!(
        matches!(&err, WalletError::Corrupt { path, .. } if path == coldkey.path()),
        "{err}"
    );
    assert!(names_path(&err, coldkey.path()), "{err}");

    // A plain hotkey cut mid-JSON.
    let hotkey = wallet.hotkey_file();
    let text = fs::read(hotkey.path()).unwrap();
    fs::write(hotkey.path(), &text[..text.len() / 2]).unwrap();
    let err = wallet.hotkey(&PasswordSource::EnvOnly).unwrap_err();
    assert!(
        matches!(&err, WalletError::Corrupt { path, .. } if path == hotkey.path()),
        "{err}"
    );
    assert!(names_path(&err, hotkey.path()), "{err}");

    // Empty, garbage, wrong field types, and a damaged mnemonic.
    let path = dir.path().join("bad");
    for content in [
        &b""[..],
        b"\x00\x01\x02garbage",
        b"{\"secretPhrase\": 12}",
        b"{\"secretSeed\": \"0xnothex\"}",
        b"{\"secretPhrase\": \"actual note object bunker scare voice rib life endless ahead trap notaword\"}",
    ] {
        fs::write(&path, content).unwrap();
        let err = Keyfile::new(&path).keypair(&PasswordSource::EnvOnly).unwrap_err();
        assert!(matches!(&err, WalletError::Corrupt { .. }), "{content:?}: {err}");
        assert!(names_path(&err, &path), "{err}");
    }

    // A truncated Ansible Vault file.
    let vault = dir.path().join("ansible_coldkey");
    let full = fs::read(&vault).unwrap();
    fs::write(&vault, &full[..full.len() / 2]).unwrap();
    let err = Keyfile::new(&vault)
        .keypair(&PasswordSource::given(PASSWORD))
        .unwrap_err();
    assert!(
        matches!(
            &err,
            WalletError::Corrupt { .. } | WalletError::WrongPassword { .. }
        ),
        "{err}"
    );
    assert!(names_path(&err, &vault), "{err}");

    // The oldest (Fernet) format is recognised and refused by name.
    fs::write(&path, b"gAAAAABkexample").unwrap();
    let err = Keyfile::new(&path)
        .keypair(&PasswordSource::given(PASSWORD))
        .unwrap_err();
    assert!(
        matches!(err, WalletError::UnsupportedEncryption { .. }),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// CLI
// ---------------------------------------------------------------------------------------------

fn run_cli(args: &[&str]) -> Result<String, WalletError> {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: WalletCommand,
    }
    let cli = Cli::try_parse_from(std::iter::once("iota").chain(args.iter().copied()))
        .expect("valid command line");
    let mut out = Vec::new();
    run_with_password(&cli.cmd, &mut out, &PasswordSource::EnvOnly)?;
    Ok(String::from_utf8(out).expect("UTF-8 output"))
}

#[test]
fn cli_creates_lists_shows_and_regenerates() {
    let dir = TempDir::new().unwrap();
    let root = dir.path().to_str().unwrap();

    let out = run_cli(&[
        "new-coldkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w1",
        "--no-password",
    ])
    .unwrap();
    assert!(
        out.contains("unencrypted") && out.contains("Mnemonic"),
        "{out}"
    );
    let out = run_cli(&[
        "new-hotkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w1",
        "--wallet.hotkey",
        "h1",
        "--n-words",
        "24",
    ])
    .unwrap();
    let words = out.lines().last().unwrap().split_whitespace().count();
    assert_eq!(words, 24, "{out}");

    let wallet = Wallet::new(dir.path(), "w1", "h1").unwrap();
    let cold = wallet.coldkeypub().unwrap().ss58();
    let hot = wallet.hotkeypub().unwrap().ss58();
    let out = run_cli(&["list", "--wallet.path", root]).unwrap();
    assert!(
        out.contains("w1") && out.contains(&cold) && out.contains("h1") && out.contains(&hot),
        "{out}"
    );
    let out = run_cli(&[
        "show",
        "--wallet.path",
        root,
        "--wallet.name",
        "w1",
        "--wallet.hotkey",
        "h1",
    ])
    .unwrap();
    assert!(out.contains(&cold) && out.contains(&hot), "{out}");

    // Regenerating over an existing key needs --overwrite.
    let regen = [
        "regen-hotkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w1",
        "--wallet.hotkey",
        "h1",
    ];
    let mut args = regen.to_vec();
    args.extend(["--mnemonic", HOT_MNEMONIC]);
    let err = run_cli(&args).unwrap_err();
    assert!(matches!(err, WalletError::AlreadyExists { .. }), "{err}");
    args.push("--overwrite");
    let out = run_cli(&args).unwrap();
    assert!(out.contains(HOT_SS58) && !out.contains("Mnemonic"), "{out}");
    assert_eq!(wallet.hotkeypub().unwrap().ss58(), HOT_SS58);

    // A coldkey needs a password unless --no-password; EnvOnly has none, so nothing is written.
    let err = run_cli(&[
        "regen-coldkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w2",
        "--mnemonic",
        COLD_MNEMONIC,
    ])
    .unwrap_err();
    assert!(
        matches!(err, WalletError::PasswordUnavailable { .. }),
        "{err}"
    );
    assert!(!dir.path().join("w2/coldkey").exists());
    let out = run_cli(&[
        "regen-coldkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w2",
        "--no-password",
        "--mnemonic",
        COLD_MNEMONIC,
    ])
    .unwrap();
    assert!(out.contains(COLD_SS58), "{out}");

    let err = run_cli(&[
        "regen-hotkey",
        "--wallet.path",
        root,
        "--wallet.name",
        "w3",
        "--seed",
        "0x1234",
    ])
    .unwrap_err();
    assert!(matches!(err, WalletError::InvalidSecret { .. }), "{err}");
}
