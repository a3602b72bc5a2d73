//! Blob descriptors: how an object in the store is named and checked.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Element type of a tensor blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BlobDtype {
    /// 32-bit float.
    F32,
    /// Signed 8-bit integer (quantised boundary tensors, with one f32 scale per row).
    I8,
    /// Signed 4-bit integers, two a byte (quantised boundary tensors, with one bf16 scale per
    /// row); the descriptor's shape is the tensor's, not its bytes'.
    I4,
}

/// An object in the store, with everything needed to check it after download.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BlobDescriptor {
    /// Object key in the store.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Element type of the main tensor (`values`).
    pub dtype: BlobDtype,
    /// Shape of the main tensor.
    pub shape: Vec<u64>,
    /// BLAKE3 of the bytes, 64 lowercase hex digits.
    pub blake3: String,
    /// A presigned download URL when the store serves bytes directly; otherwise the bytes come
    /// from `GET /v1/blobs/{key}` on the orchestrator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

impl BlobDescriptor {
    /// Checks downloaded bytes against the descriptor's size and hash.
    pub fn check_bytes(&self, bytes: &[u8]) -> Result<(), String> {
        if bytes.len() as u64 != self.size {
            return Err(format!(
                "{}: {} bytes, descriptor says {}",
                self.key,
                bytes.len(),
                self.size
            ));
        }
        let got = blake3::hash(bytes).to_hex();
        if got.as_str() != self.blake3 {
            return Err(format!(
                "{}: BLAKE3 {got}, descriptor says {}",
                self.key, self.blake3
            ));
        }
        Ok(())
    }
}

/// Lowercase-hex BLAKE3 of `bytes`.
pub fn blake3_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// True when `text` looks like a BLAKE3 hex digest.
pub fn is_blake3_hex(text: &str) -> bool {
    text.len() == 64
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blake3_digest_is_64_lowercase_hex_digits() {
        let digest = blake3_hex(b"tensor");
        assert!(is_blake3_hex(&digest));
        assert!(is_blake3_hex(&"0123456789abcdef".repeat(4)));
        for bad in [
            &digest[..63],
            &format!("{digest}0"),
            &digest.to_uppercase(),
            &format!("{}g", &digest[..63]),
            &format!("{}/", &digest[..63]),
            "",
        ] {
            assert!(!is_blake3_hex(bad), "{bad:?}");
        }
    }

    #[test]
    fn downloaded_bytes_must_match_size_and_hash() {
        let bytes = b"sixteen bytes ok";
        let blob = BlobDescriptor {
            key: "k".into(),
            size: bytes.len() as u64,
            dtype: BlobDtype::I8,
            shape: vec![16],
            blake3: blake3_hex(bytes),
            url: None,
        };
        assert_eq!(blob.check_bytes(bytes), Ok(()));
        let tampered = b"sixteen bytes OK";
        let err = blob.check_bytes(tampered).expect_err("other bytes");
        assert!(err.contains("BLAKE3"), "{err}");
        let err = blob.check_bytes(&bytes[..15]).expect_err("short");
        assert!(err.contains("15 bytes"), "{err}");
    }
}
