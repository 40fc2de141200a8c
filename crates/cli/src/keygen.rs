//! `moeshard keygen FILE`: a fresh cluster key (32 random bytes), readable by its owner only.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use anyhow::Context;
use cluster::wire::ClusterKey;

#[derive(clap::Args)]
pub struct KeygenArgs {
    /// Where to write the key (refused if it exists).
    pub file: PathBuf,
}

pub fn run(args: &KeygenArgs) -> anyhow::Result<()> {
    let key = ClusterKey::generate();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&args.file)
        .with_context(|| format!("creating {}", args.file.display()))?;
    f.write_all(key.bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", args.file.display()))?;
    eprintln!(
        "wrote a {}-byte cluster key to {} (mode 0600); give every node of the cluster a copy (--cluster-key-file)",
        key.bytes().len(),
        args.file.display()
    );
    Ok(())
}
