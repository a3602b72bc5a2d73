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

/// The `count` values packed in `bytes` (`ceil(count / 2)` of them), each in `[-7, 7]`, with
/// an odd count's padding nibble 0.
pub(super) fn unpack(bytes: &[u8], count: usize) -> Result<Vec<i8>, TensorError> {
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
    let values: Vec<i8> = bytes
        .iter()
        .flat_map(|b| [((b << 4) as i8) >> 4, (*b as i8) >> 4])
        .take(count)
        .collect();
    if values.contains(&-8) {
        return Err(TensorError::NonFinite(
            "values (-8 is outside [-7, 7])".into(),
        ));
    }
    Ok(values)
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
    }
}
