//! `cargo xtask soak`.

use anyhow::Result;

pub(crate) fn soak(_args: &[String]) -> Result<()> {
    anyhow::bail!("not yet")
}
