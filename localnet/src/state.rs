//! The chain's key-value state. A persistent ordered map: every block keeps its own post-state at
//! the cost of the changed paths only, so reads "at block hash" and prefix iteration are exact.

use im::OrdMap;
use std::ops::Bound;

#[derive(Clone, Debug, Default)]
pub struct State {
    map: OrdMap<Vec<u8>, Vec<u8>>,
}

impl State {
    pub fn get(&self, key: &[u8]) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.map.insert(key, value);
    }

    pub fn delete(&mut self, key: &[u8]) {
        self.map.remove(key);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Keys starting with `prefix`, in order, strictly after `start_after` when given.
    pub fn keys_with_prefix<'a>(
        &'a self,
        prefix: &'a [u8],
        start_after: Option<&[u8]>,
    ) -> impl Iterator<Item = &'a Vec<u8>> + 'a {
        let lower = match start_after {
            Some(start) if start > prefix => Bound::Excluded(start.to_vec()),
            _ => Bound::Included(prefix.to_vec()),
        };
        self.map
            .range((lower, Bound::Unbounded))
            .map(|(k, _)| k)
            .take_while(move |k| k.starts_with(prefix))
    }

    /// Removes every key under `prefix`.
    pub fn clear_prefix(&mut self, prefix: &[u8]) {
        let keys: Vec<Vec<u8>> = self.keys_with_prefix(prefix, None).cloned().collect();
        for key in keys {
            self.map.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_iteration_is_ordered_and_paged() {
        let mut s = State::default();
        for k in [
            b"ab1".to_vec(),
            b"ab3".to_vec(),
            b"ab2".to_vec(),
            b"ac".to_vec(),
            b"aa".to_vec(),
        ] {
            s.put(k, vec![1]);
        }
        let all: Vec<_> = s.keys_with_prefix(b"ab", None).cloned().collect();
        assert_eq!(all, vec![b"ab1".to_vec(), b"ab2".to_vec(), b"ab3".to_vec()]);
        let after: Vec<_> = s.keys_with_prefix(b"ab", Some(b"ab1")).cloned().collect();
        assert_eq!(after, vec![b"ab2".to_vec(), b"ab3".to_vec()]);
        s.clear_prefix(b"ab");
        assert_eq!(s.len(), 2);
    }
}
