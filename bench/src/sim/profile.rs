//! The measured cost profile (`cleave bench profile` output). The type and its invariants live
//! in the planner crate, which predicts with it too; this module reads and writes the file.

use std::path::Path;

pub use cleave_planner::profile::{decode_axes, DecodePoint, MixedPoint, PrefillPoint, Profile, PROFILE_VERSION};

use crate::error::{BenchError, Result};

/// Reads and validates a profile file.
pub fn load(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let p: Profile = serde_json::from_str(&text)?;
    p.validate().map_err(|e| BenchError::Profile(format!("{}: {e}", path.display())))?;
    Ok(p)
}

/// Writes the profile as pretty JSON.
pub fn save(p: &Profile, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(p)?;
    std::fs::write(path, text + "\n").map_err(|e| BenchError::io(path, e))
}
