//! Signed 4-bit values two a byte, low nibble first: the int4 boundary rows and the 4-bit
//! values of sparse vectors share this packing and its checks.

use super::TensorError;

/// Packs values in `[-8, 7]` two a byte; an odd count's last high nibble is 0.
pub(super) fn pack(values: &[i8]) -> impl Iterator<Item = u8> + '_ {
    values.chunks(2).map(|pair| {
        let hi = pair.get(1).copied().unwrap_or(0);
        (pair[0] as u8 & 0x0f) | ((hi as u8 & 0x0f) << 4)
    })
}

/// Checks that `bytes` hold exactly `count` packed values (`ceil(count / 2)` bytes), each in
/// `[-7, 7]`, with an odd count's padding nibble 0, without unpacking them.
pub(super) fn check(bytes: &[u8], count: usize) -> Result<(), TensorError> {
    if bytes.len() != count.div_ceil(2) {
        return Err(TensorError::Layout(format!(
            "{} bytes hold {count} 4-bit values, expected {}",
            bytes.len(),
            count.div_ceil(2)
        )));
    }
    if count % 2 == 1 && bytes.last().is_some_and(|b| b >> 4 != 0) {
        return Err(TensorError::Layout(
            "the padding nibble after the last value is not 0".into(),
        ));
    }
    // -8 is nibble 0x8; a padding nibble is 0, so every byte can be checked whole.
    if bytes.iter().any(|b| b & 0x0f == 0x08 || b >> 4 == 0x08) {
        return Err(TensorError::NonFinite(
            "values (-8 is outside [-7, 7])".into(),
        ));
    }
    Ok(())
}

/// The `count` values packed in `bytes`, after [`check`].
pub(super) fn unpack(bytes: &[u8], count: usize) -> Result<Vec<i8>, TensorError> {
    check(bytes, count)?;
    Ok(bytes
        .iter()
        .flat_map(|b| [((b << 4) as i8) >> 4, (*b as i8) >> 4])
        .take(count)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_bad_nibbles_are_refused() {
        let values = [7, -5, 0, 7, -7];
        let packed: Vec<u8> = pack(&values).collect();
        assert_eq!(packed, [0xb7, 0x70, 0x09]);
        assert_eq!(unpack(&packed, 5).unwrap(), values);
        assert_eq!(unpack(&packed[..2], 4).unwrap(), values[..4]);
        // -8 in either nibble, a padding nibble that is not 0, a wrong byte count.
        assert!(unpack(&[0x08], 1).is_err());
        assert!(unpack(&[0x81], 2).is_err());
        assert!(unpack(&[0x11], 1).is_err());
        assert!(unpack(&packed, 7).is_err());
        assert!(unpack(&packed, 3).is_err());
        // Every byte as a one- and a two-value row: refused exactly when a value nibble is
        // 0x8 or, for one value, the padding nibble is not 0.
        for byte in 0..=u8::MAX {
            let (lo, hi) = (byte & 0x0f, byte >> 4);
            assert_eq!(check(&[byte], 2).is_ok(), lo != 8 && hi != 8, "{byte:#04x}");
            assert_eq!(check(&[byte], 1).is_ok(), lo != 8 && hi == 0, "{byte:#04x}");
        }
        assert!(check(&[0x77, 0x80], 4).is_err());
    }
}
