//! Counts of live things per key (connections per address, sessions per
//! token), so that one client cannot take every slot a limit leaves.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// How many of each key are live, each bounded by the same maximum.
pub(crate) struct Quota<K: Hash + Eq + Clone> {
    counts: Arc<Mutex<HashMap<K, usize>>>,
    max: usize,
}

/// One live use of a key's quota, given back on drop.
pub(crate) struct Held<K: Hash + Eq + Clone> {
    counts: Arc<Mutex<HashMap<K, usize>>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Quota<K> {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            counts: Arc::new(Mutex::new(HashMap::new())),
            max,
        }
    }

    /// A use of `key`'s quota, or `None` when `key` already holds the maximum.
    pub(crate) fn take(&self, key: K) -> Option<Held<K>> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(key.clone()).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(Held {
            counts: Arc::clone(&self.counts),
            key,
        })
    }

    /// Keys with at least one live use (the map never holds idle keys).
    #[cfg(test)]
    fn keys(&self) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl<K: Hash + Eq + Clone> Drop for Held<K> {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_is_bounded_alone_and_released_on_drop() {
        let quota = Quota::new(2);
        let a1 = quota.take("a").unwrap();
        let _a2 = quota.take("a").unwrap();
        assert!(quota.take("a").is_none(), "a third use of one key");
        let b = quota.take("b");
        assert!(b.is_some(), "another key is not affected");
        drop(a1);
        assert!(
            quota.take("a").is_some(),
            "a released use can be taken again"
        );
        drop(b);
        assert_eq!(quota.keys(), 1, "a key with no live use is forgotten");
    }
}
