//! Read-only memory maps of token shards: the one place in the data code that needs `unsafe`.

#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;

use crate::error::{ModelError, Result};

/// A whole file mapped read-only (an empty file maps to no bytes).
#[derive(Debug)]
pub(crate) struct MappedFile(Option<memmap2::Mmap>);

impl MappedFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = f.metadata().map_err(|e| ModelError::io(path, e))?.len();
        if len == 0 {
            return Ok(Self(None));
        }
        // SAFETY: the map is read-only and private to this process. Shards are written once and
        // renamed into place, never modified; a file truncated by someone else while mapped
        // would fault, which is why shards are verified against the manifest when first used.
        let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::io(path, e))?;
        Ok(Self(Some(m)))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}
