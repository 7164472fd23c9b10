//! A map that keeps what was used recently, within a fixed size.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

/// A map of at most `2 × per_generation` entries that keeps the recent ones.
///
/// Entries go into the current generation. When it is full it becomes the
/// old one, and the old one is dropped whole. Inserting a key that is in
/// the old generation moves it to the current one. So an entry inserted
/// again at least once every `per_generation` insertions is never dropped,
/// and eviction costs nothing per operation (no recency list to keep up).
///
/// A map made [`Generations::weighed`] also counts a weight per entry (its
/// bytes, say): a generation is full, too, once its entries weigh the
/// limit, so the map holds at most twice that, plus the one entry that
/// crossed it.
pub struct Generations<K, V, S = foldhash::fast::RandomState> {
    current: HashMap<K, (V, usize), S>,
    old: HashMap<K, (V, usize), S>,
    per_generation: usize,
    /// Most weight of one generation.
    weight_per_generation: usize,
    /// The weight of the current generation's entries, and of the old's.
    current_weight: usize,
    old_weight: usize,
    /// Whether entries were ever dropped.
    dropped: bool,
}

impl<K: Hash + Eq, V, S: BuildHasher + Default> Generations<K, V, S> {
    /// An empty map whose generations hold `per_generation` entries each
    /// (at least one).
    pub fn new(per_generation: usize) -> Self {
        Self::weighed(per_generation, usize::MAX)
    }

    /// An empty map whose generations hold `per_generation` entries each,
    /// and entries of at most `weight_per_generation` in all (see
    /// [`Generations::insert_weighed`]).
    pub fn weighed(per_generation: usize, weight_per_generation: usize) -> Self {
        Self {
            current: HashMap::default(),
            old: HashMap::default(),
            per_generation: per_generation.max(1),
            weight_per_generation,
            current_weight: 0,
            old_weight: 0,
            dropped: false,
        }
    }

    /// Makes room in the current generation for an entry of `weight`: a
    /// full one becomes the old one. The old one's table, emptied, is the
    /// new current one, so a generation does not grow its table again
    /// (rehashing all the way) after every rotation.
    fn rotate_if_full(&mut self, weight: usize) {
        let heavy = self.current_weight.saturating_add(weight) > self.weight_per_generation;
        if self.current.len() >= self.per_generation || (heavy && !self.current.is_empty()) {
            self.dropped |= !self.old.is_empty();
            self.old.clear();
            std::mem::swap(&mut self.old, &mut self.current);
            self.old_weight = self.current_weight;
            self.current_weight = 0;
        }
    }

    /// Inserts `value` under `key` into the current generation and returns
    /// the value it replaces, from either generation.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.insert_weighed(key, value, 0)
    }

    /// [`Generations::insert`] of an entry that weighs `weight`.
    pub fn insert_weighed(&mut self, key: K, value: V, weight: usize) -> Option<V> {
        // Taken out first, from either generation, so that an entry that
        // grows goes through the rotation as a new one does: replaced in
        // place, the current generation could outgrow its weight.
        let replaced = match self.current.remove(&key) {
            Some((v, w)) => {
                self.current_weight -= w;
                Some(v)
            }
            None => self.take_old(&key).map(|(_, (v, _))| v),
        };
        self.rotate_if_full(weight);
        self.current.insert(key, (value, weight));
        self.current_weight += weight;
        replaced
    }

    /// Removes `key` from the old generation, with its weight.
    fn take_old<Q>(&mut self, key: &Q) -> Option<(K, (V, usize))>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let entry = self.old.remove_entry(key)?;
        self.old_weight -= (entry.1).1;
        Some(entry)
    }

    /// The value under `key`, moved into the current generation if it was
    /// in the old one (kept as if inserted again).
    pub fn renew<Q>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if !self.current.contains_key(key) {
            let (k, (v, weight)) = self.take_old(key)?;
            self.rotate_if_full(weight);
            self.current.insert(k, (v, weight));
            self.current_weight += weight;
        }
        self.current.get(key).map(|(v, _)| v)
    }

    /// Takes the entry under `key` out, from either generation.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some((v, weight)) = self.current.remove(key) {
            self.current_weight -= weight;
            return Some(v);
        }
        self.take_old(key).map(|(_, (v, _))| v)
    }

    /// Whether an entry was ever dropped (so a key not found may have been
    /// kept once).
    pub fn dropped_any(&self) -> bool {
        self.dropped
    }

    /// The value under `key`, if it is still kept.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.current
            .get(key)
            .or_else(|| self.old.get(key))
            .map(|(v, _)| v)
    }

    /// The keys kept, in no order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.current.keys().chain(self.old.keys())
    }

    /// The values kept, in no order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.current
            .values()
            .chain(self.old.values())
            .map(|(v, _)| v)
    }

    /// Number of entries kept.
    pub fn len(&self) -> usize {
        self.current.len() + self.old.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weight of the entries kept.
    pub fn weight(&self) -> usize {
        self.current_weight + self.old_weight
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_inserted_again_each_generation_stays() {
        let mut m: Generations<u32, u32> = Generations::new(4);
        for i in 0..100 {
            m.insert(1000, i);
            m.insert(i, i);
            m.insert(i + 1, i);
            m.insert(i + 2, i);
        }
        assert_eq!(m.get(&1000), Some(&99));
        assert!(m.len() <= 8, "{}", m.len());
        assert_eq!(m.get(&0), None, "old keys are dropped");
        assert!(m.dropped_any());
    }

    #[test]
    fn a_renewed_key_stays_like_one_inserted_again() {
        let mut m: Generations<u32, &str> = Generations::new(2);
        m.insert(1, "one");
        m.insert(2, "two");
        m.insert(3, "three"); // 1 and 2 are the old generation now
        assert!(!m.dropped_any(), "nothing dropped yet");
        assert_eq!(m.renew(&1), Some(&"one"));
        m.insert(4, "four"); // rotates: 3 and 1 old, 2 dropped
        assert_eq!(m.get(&2), None);
        assert!(m.dropped_any());
        assert_eq!(m.renew(&1), Some(&"one"));
        assert_eq!(m.renew(&9), None);
        m.insert(5, "five");
        m.insert(6, "six");
        assert_eq!(m.get(&1), Some(&"one"), "renewed, so kept");
        assert_eq!(m.get(&3), None, "not renewed, so dropped");
    }

    proptest! {
        /// A weighed map never holds more than two generations' weight and
        /// the entry that crossed the limit, keeps the entry inserted last,
        /// and its weight is the sum of what it holds.
        #[test]
        fn a_weighed_map_stays_within_its_weight(
            limit in 1usize..64,
            ops in proptest::collection::vec((0u8..24, 0usize..32, any::<bool>()), 0..200),
        ) {
            let mut m: Generations<u8, usize> = Generations::weighed(usize::MAX, limit);
            let mut heaviest = 0;
            for (k, w, remove) in ops {
                if remove {
                    m.remove(&k);
                } else {
                    m.insert_weighed(k, w, w);
                    heaviest = heaviest.max(w);
                    prop_assert_eq!(m.get(&k), Some(&w));
                }
                prop_assert_eq!(m.weight(), m.values().sum::<usize>());
                prop_assert!(m.weight() <= 2 * limit + 2 * heaviest, "{} > {}", m.weight(), limit);
            }
        }

        /// Against a model that remembers everything: what is kept holds
        /// the latest value; every key inserted within the last
        /// `per_generation` insertions is kept; never more than two
        /// generations.
        #[test]
        fn keeps_the_latest_insertions_and_no_more_than_two_generations(
            per_generation in 1usize..8,
            ops in proptest::collection::vec((0u8..24, any::<u16>()), 0..200),
        ) {
            let mut m: Generations<u8, u16> = Generations::new(per_generation);
            let mut latest = std::collections::HashMap::new();
            let mut order: Vec<u8> = Vec::new();
            for (k, v) in ops {
                let replaced = m.insert(k, v);
                if let Some(r) = replaced {
                    prop_assert_eq!(Some(&r), latest.get(&k));
                }
                latest.insert(k, v);
                order.push(k);
                prop_assert!(m.len() <= 2 * per_generation);
                for (key, value) in &latest {
                    if let Some(kept) = m.get(key) {
                        prop_assert_eq!(kept, value);
                    }
                }
                for key in order.iter().rev().take(per_generation) {
                    prop_assert_eq!(m.get(key), latest.get(key));
                }
            }
        }
    }
}
