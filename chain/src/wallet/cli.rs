//! `wallet` subcommands with btcli's flag names, for the `iota` binary to mount.
//!
//! ```text
//! iota wallet new-coldkey  [--wallet.name N] [--wallet.path P] [--n-words 12] [--overwrite] [--no-password]
//! iota wallet new-hotkey   [--wallet.name N] [--wallet.hotkey H] [--n-words 12] [--overwrite] [--use-password]
//! iota wallet regen-coldkey [--mnemonic WORDS… | --seed 0x…] [--overwrite] [--no-password]
//! iota wallet regen-hotkey  [--mnemonic WORDS… | --seed 0x…] [--overwrite] [--use-password]
//! iota wallet list [--wallet.path P]
//! iota wallet show [--wallet.name N] [--wallet.hotkey H]
//! ```
//!
//! Passwords come from the keyfile's `BT_PW_…` variable or a no-echo prompt. A mnemonic that is
//! not passed with `--mnemonic` is read without echo from the terminal, or as one line from
//! stdin when stdin is not a terminal, which keeps it out of shell history.

use std::io::{BufRead as _, IsTerminal as _, Write};
use std::path::PathBuf;

use zeroize::Zeroizing;

use super::{
    DEFAULT_HOTKEY_NAME, DEFAULT_N_WORDS, DEFAULT_WALLET_NAME, DEFAULT_WALLET_PATH, Keypair,
    MNEMONIC_WORD_COUNTS, PasswordSource, Wallet, WalletError, list_wallets,
};

/// Selects a wallet and hotkey (`--wallet.name`, `--wallet.hotkey`, `--wallet.path`).
///
/// Binaries that sign with a wallet can `#[command(flatten)]` this.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct WalletArgs {
    /// Wallet name: the directory under --wallet.path.
    #[arg(long = "wallet.name", env = "BT_WALLET_NAME", default_value = DEFAULT_WALLET_NAME)]
    pub name: String,
    /// Hotkey name: the file under <wallet>/hotkeys/.
    #[arg(long = "wallet.hotkey", env = "BT_WALLET_HOTKEY", default_value = DEFAULT_HOTKEY_NAME)]
    pub hotkey: String,
    /// Directory that holds the wallets.
    #[arg(long = "wallet.path", env = "BT_WALLET_PATH", default_value = DEFAULT_WALLET_PATH)]
    pub path: PathBuf,
}

impl WalletArgs {
    /// The selected wallet.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidName`].
    pub fn wallet(&self) -> Result<Wallet, WalletError> {
        Wallet::new(&self.path, self.name.clone(), self.hotkey.clone())
    }
}

/// Only the wallet directory, for commands that look at every wallet.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct WalletPathArgs {
    /// Directory that holds the wallets.
    #[arg(long = "wallet.path", env = "BT_WALLET_PATH", default_value = DEFAULT_WALLET_PATH)]
    pub path: PathBuf,
}

/// Options for generating a key.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct NewKeyArgs {
    /// Number of mnemonic words: 12, 15, 18, 21 or 24.
    #[arg(long = "n-words", default_value_t = DEFAULT_N_WORDS, value_parser = parse_n_words)]
    pub n_words: usize,
    /// Replace existing key files.
    #[arg(long)]
    pub overwrite: bool,
}

/// Where a regenerated key comes from.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RegenArgs {
    /// Mnemonic, quoted or as separate words. Prefer leaving it out to be prompted: arguments
    /// end up in shell history and process listings.
    #[arg(long, num_args = 1.., value_name = "WORDS", conflicts_with = "seed")]
    pub mnemonic: Option<Vec<String>>,
    /// 32-byte mini-secret seed in hex (`0x…`), instead of a mnemonic.
    #[arg(long, value_name = "HEX")]
    pub seed: Option<String>,
    /// Replace existing key files.
    #[arg(long)]
    pub overwrite: bool,
}

/// Wallet management commands.
#[derive(Debug, Clone, PartialEq, Eq, clap::Subcommand)]
pub enum WalletCommand {
    /// Create a coldkey from a new mnemonic; it is encrypted unless --no-password is given.
    NewColdkey {
        #[command(flatten)]
        wallet: WalletArgs,
        #[command(flatten)]
        key: NewKeyArgs,
        /// Store the coldkey unencrypted (not recommended outside tests).
        #[arg(long)]
        no_password: bool,
    },
    /// Create a hotkey from a new mnemonic; unencrypted unless --use-password is given.
    NewHotkey {
        #[command(flatten)]
        wallet: WalletArgs,
        #[command(flatten)]
        key: NewKeyArgs,
        /// Encrypt the hotkey (miners and validators then need its password to start).
        #[arg(long)]
        use_password: bool,
    },
    /// Restore a coldkey from its mnemonic or seed.
    RegenColdkey {
        #[command(flatten)]
        wallet: WalletArgs,
        #[command(flatten)]
        regen: RegenArgs,
        /// Store the coldkey unencrypted (not recommended outside tests).
        #[arg(long)]
        no_password: bool,
    },
    /// Restore a hotkey from its mnemonic or seed.
    RegenHotkey {
        #[command(flatten)]
        wallet: WalletArgs,
        #[command(flatten)]
        regen: RegenArgs,
        /// Encrypt the hotkey.
        #[arg(long)]
        use_password: bool,
    },
    /// List wallets, their coldkey addresses and hotkeys.
    List {
        #[command(flatten)]
        path: WalletPathArgs,
    },
    /// Show one wallet's coldkey and selected hotkey.
    Show {
        #[command(flatten)]
        wallet: WalletArgs,
    },
}

fn parse_n_words(text: &str) -> Result<usize, String> {
    let n: usize = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if MNEMONIC_WORD_COUNTS.contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "{n} words is not a mnemonic length; use 12, 15, 18, 21 or 24"
        ))
    }
}

/// Runs `cmd`, writing results to `out`; passwords come from `BT_PW_…` or a prompt.
///
/// # Errors
///
/// Any [`WalletError`]; nothing is overwritten unless `--overwrite` was given.
pub fn run(cmd: &WalletCommand, out: &mut dyn Write) -> Result<(), WalletError> {
    run_with_password(cmd, out, &PasswordSource::EnvOrPrompt)
}

/// As [`run`], with an explicit password source (for embedding programs and tests).
///
/// # Errors
///
/// As [`run`].
pub fn run_with_password(
    cmd: &WalletCommand,
    out: &mut dyn Write,
    password: &PasswordSource,
) -> Result<(), WalletError> {
    match cmd {
        WalletCommand::NewColdkey {
            wallet,
            key,
            no_password,
        } => {
            let wallet = wallet.wallet()?;
            let password = (!no_password).then_some(password);
            let keypair = wallet.create_coldkey(key.n_words, password, key.overwrite)?;
            report_new_key(
                out,
                "coldkey",
                &wallet.coldkey_file(),
                &keypair,
                password.is_some(),
                true,
            )
        }
        WalletCommand::NewHotkey {
            wallet,
            key,
            use_password,
        } => {
            let wallet = wallet.wallet()?;
            let password = use_password.then_some(password);
            let keypair = wallet.create_hotkey(key.n_words, password, key.overwrite)?;
            report_new_key(
                out,
                "hotkey",
                &wallet.hotkey_file(),
                &keypair,
                password.is_some(),
                true,
            )
        }
        WalletCommand::RegenColdkey {
            wallet,
            regen,
            no_password,
        } => {
            let wallet = wallet.wallet()?;
            let (secret, public) = (wallet.coldkey_file(), wallet.coldkeypub_file());
            // Refuse before asking for the mnemonic.
            secret.check_writable(regen.overwrite)?;
            public.check_writable(regen.overwrite)?;
            let keypair = regen_keypair(regen)?;
            let password = (!no_password).then_some(password);
            wallet.set_coldkey(&keypair, password, regen.overwrite)?;
            report_new_key(out, "coldkey", &secret, &keypair, password.is_some(), false)
        }
        WalletCommand::RegenHotkey {
            wallet,
            regen,
            use_password,
        } => {
            let wallet = wallet.wallet()?;
            let (secret, public) = (wallet.hotkey_file(), wallet.hotkeypub_file());
            secret.check_writable(regen.overwrite)?;
            public.check_writable(regen.overwrite)?;
            let keypair = regen_keypair(regen)?;
            let password = use_password.then_some(password);
            wallet.set_hotkey(&keypair, password, regen.overwrite)?;
            report_new_key(out, "hotkey", &secret, &keypair, password.is_some(), false)
        }
        WalletCommand::List { path } => list(out, path),
        WalletCommand::Show { wallet } => show(out, &wallet.wallet()?),
    }
}

fn regen_keypair(regen: &RegenArgs) -> Result<Keypair, WalletError> {
    if let Some(seed) = &regen.seed {
        return Keypair::from_seed_hex(seed);
    }
    let phrase = match &regen.mnemonic {
        Some(words) => Zeroizing::new(words.join(" ")),
        None => read_secret_line("Enter mnemonic: ")?,
    };
    Keypair::from_mnemonic(&phrase)
}

/// A no-echo prompt on a terminal, or one line of piped stdin.
fn read_secret_line(prompt: &str) -> Result<Zeroizing<String>, WalletError> {
    if std::io::stdin().is_terminal() {
        return rpassword::prompt_password(prompt)
            .map(Zeroizing::new)
            .map_err(WalletError::Terminal);
    }
    let mut line = Zeroizing::new(String::new());
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(WalletError::Terminal)?;
    Ok(line)
}

fn report_new_key(
    out: &mut dyn Write,
    kind: &str,
    file: &super::Keyfile,
    keypair: &Keypair,
    encrypted: bool,
    show_mnemonic: bool,
) -> Result<(), WalletError> {
    let state = if encrypted {
        "encrypted"
    } else {
        "unencrypted"
    };
    let mut text = format!(
        "Wrote {kind} {} ({state})\nss58 address: {}\n",
        file.path().display(),
        keypair.ss58()
    );
    if let (true, Some(mnemonic)) = (show_mnemonic, keypair.mnemonic()) {
        text.push_str(&format!(
            "Mnemonic (anyone who has it controls this key; store it offline):\n  {mnemonic}\n"
        ));
    }
    let text = Zeroizing::new(text);
    out.write_all(text.as_bytes()).map_err(WalletError::Output)
}

/// One line describing a key's public address, or why it could not be read.
fn describe(public: Result<super::PublicKey, WalletError>) -> String {
    match public {
        Ok(public) => public.ss58(),
        Err(WalletError::NotFound { .. }) => "(no public key file)".to_owned(),
        Err(e) => format!("(unreadable: {e})"),
    }
}

fn list(out: &mut dyn Write, args: &WalletPathArgs) -> Result<(), WalletError> {
    let root = super::expand_tilde(&args.path);
    let mut text = format!("Wallets in {}\n", root.display());
    let names = list_wallets(&root)?;
    if names.is_empty() {
        text.push_str("  (none)\n");
    }
    for name in names {
        // A directory whose name is not a valid wallet name is not a wallet; skip it.
        let Ok(wallet) = Wallet::new(&root, name.clone(), DEFAULT_HOTKEY_NAME) else {
            continue;
        };
        text.push_str(&format!(
            "{name}  coldkey {}\n",
            describe(wallet.coldkeypub())
        ));
        for hotkey in wallet.hotkey_names()? {
            let Ok(selected) = wallet.with_hotkey(hotkey.clone()) else {
                continue;
            };
            text.push_str(&format!(
                "  hotkey {hotkey}  {}\n",
                describe(selected.hotkeypub())
            ));
        }
    }
    out.write_all(text.as_bytes()).map_err(WalletError::Output)
}

fn show(out: &mut dyn Write, wallet: &Wallet) -> Result<(), WalletError> {
    let encryption = |file: &super::Keyfile| match file.encryption() {
        Ok(e) if e.is_encrypted() => format!("{} encrypted", e.name()),
        Ok(_) => "unencrypted".to_owned(),
        Err(WalletError::NotFound { .. }) => "missing".to_owned(),
        Err(e) => format!("unreadable: {e}"),
    };
    let text = format!(
        "wallet   {}\ndir      {}\ncoldkey  {} ({})\nhotkey   {} {} ({})\n",
        wallet.name(),
        wallet.dir().display(),
        describe(wallet.coldkeypub()),
        encryption(&wallet.coldkey_file()),
        wallet.hotkey_name(),
        describe(wallet.hotkeypub()),
        encryption(&wallet.hotkey_file()),
    );
    out.write_all(text.as_bytes()).map_err(WalletError::Output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: WalletCommand,
    }

    #[test]
    fn flags_use_btcli_names() {
        let cli = Cli::try_parse_from([
            "iota",
            "new-coldkey",
            "--wallet.name",
            "alice",
            "--wallet.path",
            "/tmp/w",
            "--n-words",
            "24",
            "--overwrite",
            "--no-password",
        ])
        .unwrap();
        let WalletCommand::NewColdkey {
            wallet,
            key,
            no_password,
        } = cli.cmd
        else {
            panic!("wrong subcommand: {:?}", cli.cmd);
        };
        assert_eq!(wallet.name, "alice");
        assert_eq!(wallet.path, PathBuf::from("/tmp/w"));
        assert_eq!(key.n_words, 24);
        assert!(key.overwrite && no_password);
    }

    #[test]
    fn bad_word_counts_are_rejected_by_the_parser() {
        let err = Cli::try_parse_from(["iota", "new-hotkey", "--n-words", "13"]).unwrap_err();
        assert!(err.to_string().contains("13"), "{err}");
    }

    #[test]
    fn mnemonic_accepts_quoted_or_split_words() {
        let cli = Cli::try_parse_from(["iota", "regen-hotkey", "--mnemonic", "a b", "c"]).unwrap();
        let WalletCommand::RegenHotkey { regen, .. } = cli.cmd else {
            panic!("wrong subcommand")
        };
        assert_eq!(
            regen.mnemonic.map(|w| w.join(" ")),
            Some("a b c".to_owned())
        );
        assert!(
            Cli::try_parse_from(["iota", "regen-hotkey", "--mnemonic", "a", "--seed", "0x00"])
                .is_err()
        );
    }
}
