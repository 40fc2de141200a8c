//! The cache policy as plain bookkeeping (no I/O, no threads, no clock but its own), so every
//! rule can be tested on its own: which slot holds which (layer, expert), which entries are
//! pinned, and which one to evict.
//!
//! - **Hotness** is a decayed routing counter per (layer, expert), kept for every expert, cached
//!   or not (an expert evicted and routed again comes back as hot as it was): each routing adds
//!   1, and the counter halves every `half_life` steps. A step is one pass through the layers
//!   (one token in decode, one chunk in prefill); it begins when a layer is asked for that is
//!   not after the previous one.
//! - **Eviction** takes the coldest unpinned, ready, non-permanent entry; ties (equal hotness,
//!   e.g. never routed) go to the least recently used. Entries held for a look-ahead prefetch
//!   are taken only when nothing else is left (a demand read), never by another prefetch.
//! - **Pins**: experts selected for the current call and experts being read cannot be evicted;
//!   permanent entries (`--resident-layers`) never are.
//!
//! Decay without touching every counter each step: hotness `h` set at step `t` is worth
//! `h·2^(-(now-t)/H)` at step `now`, so `log2(h) + t/H` orders entries the same way at every
//! `now`, and it changes only when the entry is routed. That is the stored `score`.

use std::collections::HashMap;

/// A routed expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub layer: u32,
    pub expert: u32,
}

impl Key {
    pub fn new(layer: usize, expert: usize) -> Key {
        Key {
            layer: layer as u32,
            expert: expert as u32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// A read into the slot is queued or running.
    Reading,
    Ready,
    /// The read failed; the slot is freed when the last pin goes.
    Failed,
}

#[derive(Clone, Debug)]
struct Entry {
    key: Key,
    state: SlotState,
    pins: u32,
    permanent: bool,
    /// The layer a look-ahead prefetch read or kept this entry for.
    held_for: Option<u32>,
    /// Read by a prefetch and not asked for since.
    prefetched: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct Hotness {
    hot: f64,
    step: u64,
    last_use: u64,
}

impl Hotness {
    fn score(&self, half_life: f64) -> f64 {
        if self.hot > 0.0 {
            self.hot.log2() + self.step as f64 / half_life
        } else {
            f64::NEG_INFINITY
        }
    }
}

/// Who wants a slot: a demand read may take held entries as a last resort, a prefetch may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    Demand,
    Prefetch,
}

pub struct Policy {
    slots: Vec<Option<Entry>>,
    map: HashMap<Key, usize>,
    free: Vec<usize>,
    /// Slots that may carry a hold (checked when holds are released).
    held: Vec<usize>,
    n_expert: usize,
    hotness: Vec<Hotness>,
    half_life: f64,
    step: u64,
    last_layer: Option<usize>,
    clock: u64,
}

impl Policy {
    /// `n_slots` slots for a model of `n_layer` layers of up to `n_expert` experts; hotness
    /// halves every `half_life` steps.
    pub fn new(n_slots: usize, n_layer: usize, n_expert: usize, half_life: f64) -> Policy {
        assert!(half_life > 0.0, "half-life must be positive");
        Policy {
            slots: vec![None; n_slots],
            map: HashMap::new(),
            // Popped from the back: slot 0 is used first.
            free: (0..n_slots).rev().collect(),
            held: Vec::new(),
            n_expert,
            hotness: vec![Hotness::default(); n_layer * n_expert],
            half_life,
            step: 0,
            last_layer: None,
            clock: 0,
        }
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// Slots holding an entry (any state).
    pub fn n_used(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    fn hot_index(&self, k: Key) -> usize {
        k.layer as usize * self.n_expert + k.expert as usize
    }

    /// Starts a call for `layer`: a new step when `layer` is not after the previous call's.
    /// Releases holds for `layer` (the call now pins what it uses) and for earlier layers
    /// (predictions whose call did not come); holds for later layers stay, including those the
    /// look-ahead made for the next layer just before this call.
    pub fn begin_call(&mut self, layer: usize) {
        let new_step = self.last_layer.is_some_and(|l| layer <= l);
        if new_step {
            self.step += 1;
        }
        self.last_layer = Some(layer);
        let slots = &mut self.slots;
        self.held.retain(|&s| match slots[s].as_mut() {
            Some(e) if e.held_for.is_some_and(|l| l as usize <= layer) => {
                e.held_for = None;
                false
            }
            Some(e) => e.held_for.is_some(),
            None => false,
        });
    }

    /// Records that `k` was routed now.
    pub fn touch(&mut self, k: Key) {
        let (step, half_life, clock) = (self.step, self.half_life, self.clock);
        let i = self.hot_index(k);
        let h = &mut self.hotness[i];
        let decayed = h.hot * (-((step - h.step) as f64) / half_life).exp2();
        *h = Hotness {
            hot: decayed + 1.0,
            step,
            last_use: clock,
        };
        self.clock += 1;
    }

    /// Seeds `k`'s hotness (from a saved profile), as of the current step.
    pub fn seed(&mut self, k: Key, hot: f64) {
        let i = self.hot_index(k);
        self.hotness[i].hot = hot;
        self.hotness[i].step = self.step;
    }

    /// `k`'s hotness as of the current step.
    pub fn hotness(&self, k: Key) -> f64 {
        let h = &self.hotness[self.hot_index(k)];
        h.hot * (-((self.step - h.step) as f64) / self.half_life).exp2()
    }

    pub fn lookup(&self, k: Key) -> Option<(usize, SlotState)> {
        self.map.get(&k).map(|&s| {
            let e = self.slots[s].as_ref().expect("mapped slots hold an entry");
            (s, e.state)
        })
    }

    pub fn key_of(&self, slot: usize) -> Option<Key> {
        self.slots[slot].as_ref().map(|e| e.key)
    }

    pub fn state(&self, slot: usize) -> Option<SlotState> {
        self.slots[slot].as_ref().map(|e| e.state)
    }

    pub fn pins(&self, slot: usize) -> u32 {
        self.slots[slot].as_ref().map_or(0, |e| e.pins)
    }

    fn evictable(e: &Entry) -> bool {
        e.state == SlotState::Ready && e.pins == 0 && !e.permanent
    }

    /// Up to `n` slots for new entries: free ones first, then victims in eviction order (the
    /// victims' entries are dropped). Fewer when too many entries are pinned or being read.
    pub fn take_slots(&mut self, n: usize, want: Want) -> Vec<usize> {
        self.take_slots_sparing(n, want, None)
    }

    /// [`Policy::take_slots`], evicting nothing of layer `spare` (the layer about to be asked
    /// for while a look-ahead for the next one reads; its experts are not pinned yet).
    pub fn take_slots_sparing(&mut self, n: usize, want: Want, spare: Option<usize>) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            match self.free.pop() {
                Some(s) => out.push(s),
                None => break,
            }
        }
        if out.len() == n {
            return out;
        }
        let hl = self.half_life;
        let mut victims: Vec<(bool, f64, u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(s, e)| {
                let e = e.as_ref()?;
                if !Self::evictable(e)
                    || (want == Want::Prefetch && e.held_for.is_some())
                    || spare.is_some_and(|l| e.key.layer as usize == l)
                {
                    return None;
                }
                let h = &self.hotness[self.hot_index(e.key)];
                Some((e.held_for.is_some(), h.score(hl), h.last_use, s))
            })
            .collect();
        let need = n - out.len();
        let order = |a: &(bool, f64, u64, usize), b: &(bool, f64, u64, usize)| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        };
        if victims.len() > need {
            victims.select_nth_unstable_by(need, order);
            victims.truncate(need);
        }
        victims.sort_by(order);
        for (_, _, _, s) in victims {
            let e = self.slots[s].take().expect("victims hold entries");
            self.map.remove(&e.key);
            out.push(s);
        }
        out
    }

    /// Returns slots taken but not used.
    pub fn give_back(&mut self, slots: impl IntoIterator<Item = usize>) {
        for s in slots {
            debug_assert!(self.slots[s].is_none());
            self.free.push(s);
        }
    }

    /// Puts `k` in `slot` (from [`Policy::take_slots`]) as `Reading`, unpinned.
    pub fn insert(&mut self, k: Key, slot: usize, prefetched: bool) {
        assert!(self.slots[slot].is_none(), "slot {slot} is in use");
        let old = self.map.insert(k, slot);
        assert!(old.is_none(), "{k:?} is already cached");
        self.slots[slot] = Some(Entry {
            key: k,
            state: SlotState::Reading,
            pins: 0,
            permanent: false,
            held_for: None,
            prefetched,
        });
    }

    fn entry(&mut self, slot: usize) -> &mut Entry {
        self.slots[slot].as_mut().expect("slot holds an entry")
    }

    pub fn pin(&mut self, slot: usize) {
        self.entry(slot).pins += 1;
    }

    /// Drops one pin; a failed entry's slot is freed with its last pin.
    pub fn unpin(&mut self, slot: usize) {
        let e = self.entry(slot);
        assert!(e.pins > 0, "unpinning an unpinned slot");
        e.pins -= 1;
        if e.pins == 0 && e.state == SlotState::Failed {
            self.slots[slot] = None;
            self.free.push(slot);
        }
    }

    pub fn make_permanent(&mut self, slot: usize) {
        self.entry(slot).permanent = true;
    }

    /// Keeps the entry for a coming call for `layer` (a look-ahead prediction).
    pub fn hold(&mut self, slot: usize, layer: usize) {
        let e = self.entry(slot);
        if e.held_for.replace(layer as u32).is_none() {
            self.held.push(slot);
        }
    }

    /// Whether the entry is held for a coming call.
    pub fn is_held(&self, slot: usize) -> bool {
        self.slots[slot]
            .as_ref()
            .is_some_and(|e| e.held_for.is_some())
    }

    /// Whether the entry was brought in by a prefetch and not asked for since (and clears
    /// that mark: the prefetch was useful).
    pub fn take_prefetched(&mut self, slot: usize) -> bool {
        std::mem::take(&mut self.entry(slot).prefetched)
    }

    pub fn set_ready(&mut self, slot: usize) {
        let e = self.entry(slot);
        debug_assert_eq!(e.state, SlotState::Reading);
        e.state = SlotState::Ready;
    }

    /// Marks a read failed: the key is forgotten at once (a later call reads it again), the
    /// slot is freed when no one waits on it.
    pub fn set_failed(&mut self, slot: usize) {
        let e = self.entry(slot);
        e.state = SlotState::Failed;
        let (k, pins) = (e.key, e.pins);
        self.map.remove(&k);
        if pins == 0 {
            self.slots[slot] = None;
            self.free.push(slot);
        }
    }

    /// Cached keys (any state), in slot order.
    pub fn keys(&self) -> Vec<Key> {
        self.slots.iter().flatten().map(|e| e.key).collect()
    }
}
