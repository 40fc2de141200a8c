//! The cache policy on its own: pinning, eviction order (decayed hotness, then least recently
//! used), hotness decay, look-ahead holds, permanent entries and failed reads.

use experts::policy::{Key, Policy, SlotState, Want};

fn k(layer: usize, expert: usize) -> Key {
    Key::new(layer, expert)
}

/// Caches `key` in a fresh slot and marks it read.
fn fill(p: &mut Policy, key: Key) -> usize {
    let s = p.take_slots(1, Want::Demand);
    assert_eq!(s.len(), 1, "no slot for {key:?}");
    p.insert(key, s[0], false);
    p.set_ready(s[0]);
    s[0]
}

/// The entry the next eviction takes (its slot is kept out of use afterwards).
fn victim(p: &mut Policy) -> Option<Key> {
    let before = p.keys();
    p.take_slots(1, Want::Demand);
    let gone: Vec<Key> = before
        .into_iter()
        .filter(|x| !p.keys().contains(x))
        .collect();
    assert!(gone.len() <= 1);
    gone.first().copied()
}

#[test]
fn free_slots_are_used_before_anything_is_evicted() {
    let mut p = Policy::new(3, 2, 4, 8.0);
    fill(&mut p, k(0, 0));
    fill(&mut p, k(0, 1));
    let s = p.take_slots(5, Want::Demand);
    // One free slot plus the two (unpinned, ready) entries.
    assert_eq!(s.len(), 3);
    assert!(p.keys().is_empty());
}

#[test]
fn colder_entries_go_first() {
    let mut p = Policy::new(3, 1, 8, 8.0);
    for e in 0..3 {
        fill(&mut p, k(0, e));
    }
    p.begin_call(0);
    for _ in 0..3 {
        p.touch(k(0, 0));
    }
    p.touch(k(0, 1));
    p.touch(k(0, 2));
    p.touch(k(0, 2));
    // Hotness 3, 1, 2: expert 1 goes, then 2, then 0.
    assert_eq!(victim(&mut p), Some(k(0, 1)));
    assert_eq!(victim(&mut p), Some(k(0, 2)));
    assert_eq!(victim(&mut p), Some(k(0, 0)));
}

#[test]
fn ties_go_to_the_least_recently_used() {
    let mut p = Policy::new(3, 1, 8, 8.0);
    for e in [5, 6, 7] {
        fill(&mut p, k(0, e));
    }
    p.begin_call(0);
    // Each routed once in the same step: equal hotness, used in the order 6, 7, 5.
    p.touch(k(0, 6));
    p.touch(k(0, 7));
    p.touch(k(0, 5));
    assert_eq!(victim(&mut p), Some(k(0, 6)));
    assert_eq!(victim(&mut p), Some(k(0, 7)));
    // Never routed at all (hotness 0) ties too and is evicted before any routed entry.
    let mut q = Policy::new(2, 1, 8, 8.0);
    fill(&mut q, k(0, 1));
    fill(&mut q, k(0, 2));
    q.begin_call(0);
    q.touch(k(0, 1));
    assert_eq!(victim(&mut q), Some(k(0, 2)));
}

#[test]
fn hotness_decays_by_half_life_and_old_heat_loses_to_recent_use() {
    let mut p = Policy::new(2, 2, 4, 4.0);
    // A step begins each time layer 0 comes again.
    p.begin_call(0);
    p.touch(k(0, 0));
    p.touch(k(0, 0));
    assert_eq!(p.hotness(k(0, 0)), 2.0);
    for _ in 0..4 {
        p.begin_call(1);
        p.begin_call(0);
    }
    assert_eq!(p.step(), 4);
    assert!(
        (p.hotness(k(0, 0)) - 1.0).abs() < 1e-12,
        "one half-life halves it"
    );
    for _ in 0..4 {
        p.begin_call(0);
    }
    assert!((p.hotness(k(0, 0)) - 0.5).abs() < 1e-12);
    // Routed twice long ago vs once now: the recent one is hotter (0.5 < 1).
    fill(&mut p, k(0, 0));
    fill(&mut p, k(1, 3));
    p.touch(k(1, 3));
    assert_eq!(victim(&mut p), Some(k(0, 0)));
    // Decay continues from the decayed value: 1·2^(-1) + 1.
    for _ in 0..4 {
        p.begin_call(0);
    }
    p.touch(k(1, 3));
    assert!((p.hotness(k(1, 3)) - 1.5).abs() < 1e-12);
}

#[test]
fn hotness_survives_eviction() {
    let mut p = Policy::new(1, 1, 4, 8.0);
    p.begin_call(0);
    for _ in 0..5 {
        p.touch(k(0, 2));
    }
    fill(&mut p, k(0, 2));
    assert_eq!(victim(&mut p), Some(k(0, 2)));
    assert_eq!(p.hotness(k(0, 2)), 5.0);
}

#[test]
fn pinned_and_reading_entries_are_never_evicted() {
    let mut p = Policy::new(3, 1, 8, 8.0);
    let a = fill(&mut p, k(0, 0));
    fill(&mut p, k(0, 1));
    let c = p.take_slots(1, Want::Demand)[0];
    p.insert(k(0, 2), c, false); // still reading
    p.pin(a);
    p.pin(a);
    assert_eq!(
        p.take_slots(3, Want::Demand).len(),
        1,
        "only the unpinned ready entry"
    );
    assert_eq!(p.lookup(k(0, 1)), None);
    assert_eq!(p.lookup(k(0, 0)), Some((a, SlotState::Ready)));
    assert_eq!(p.lookup(k(0, 2)), Some((c, SlotState::Reading)));
    p.unpin(a);
    assert!(p.take_slots(1, Want::Demand).is_empty(), "one pin remains");
    p.unpin(a);
    assert_eq!(p.take_slots(1, Want::Demand), vec![a]);
}

#[test]
fn unpinning_the_last_pin_makes_an_entry_evictable() {
    let mut p = Policy::new(1, 1, 8, 8.0);
    let a = fill(&mut p, k(0, 0));
    p.pin(a);
    assert!(p.take_slots(1, Want::Demand).is_empty());
    p.unpin(a);
    assert_eq!(p.take_slots(1, Want::Demand), vec![a]);
}

#[test]
fn permanent_entries_stay() {
    let mut p = Policy::new(2, 1, 8, 8.0);
    let a = fill(&mut p, k(0, 0));
    p.make_permanent(a);
    fill(&mut p, k(0, 1));
    assert_eq!(p.take_slots(2, Want::Demand).len(), 1);
    assert_eq!(p.lookup(k(0, 0)), Some((a, SlotState::Ready)));
}

#[test]
fn holds_protect_predictions_until_their_layer_is_asked_for() {
    let mut p = Policy::new(2, 3, 8, 8.0);
    p.begin_call(0);
    let a = fill(&mut p, k(1, 4));
    p.hold(a, 1);
    fill(&mut p, k(2, 5));
    // The unheld entry goes first, even though the held one is colder.
    p.touch(k(2, 5));
    assert_eq!(victim(&mut p), Some(k(2, 5)));
    // A prefetch never takes a held entry; a demand read does as a last resort.
    assert!(
        p.take_slots(1, Want::Prefetch).is_empty(),
        "only a held entry is left"
    );
    assert_eq!(p.take_slots(1, Want::Demand), vec![a]);
    let mut q = Policy::new(1, 3, 8, 8.0);
    q.begin_call(0);
    let h = fill(&mut q, k(1, 0));
    q.hold(h, 1);
    assert!(q.take_slots(1, Want::Prefetch).is_empty());
    assert_eq!(q.take_slots(1, Want::Demand), vec![h]);
    // The call for the layer releases the hold.
    let mut r = Policy::new(1, 3, 8, 8.0);
    r.begin_call(0);
    let h = fill(&mut r, k(1, 0));
    r.hold(h, 1);
    assert!(r.is_held(h));
    r.begin_call(1);
    assert!(!r.is_held(h));
    // A hold for the next layer made just before a new step's first call survives it; holds for
    // layers whose call did not come are released by the next call after them.
    let mut s = Policy::new(2, 3, 8, 8.0);
    s.begin_call(2);
    let next = fill(&mut s, k(1, 0));
    s.hold(next, 1);
    let skipped = fill(&mut s, k(0, 1));
    s.hold(skipped, 0);
    s.begin_call(0);
    assert_eq!(s.step(), 1);
    assert!(s.is_held(next));
    assert!(!s.is_held(skipped));
}

#[test]
fn failed_reads_forget_the_key_and_free_the_slot_with_the_last_pin() {
    let mut p = Policy::new(1, 1, 8, 8.0);
    let s = p.take_slots(1, Want::Demand)[0];
    p.insert(k(0, 3), s, false);
    p.pin(s);
    p.set_failed(s);
    assert_eq!(p.lookup(k(0, 3)), None);
    assert_eq!(p.state(s), Some(SlotState::Failed));
    assert!(
        p.take_slots(1, Want::Demand).is_empty(),
        "a waiter still holds it"
    );
    p.unpin(s);
    assert_eq!(p.take_slots(1, Want::Demand), vec![s]);
    // Unpinned (a prefetch): freed at once.
    let mut q = Policy::new(1, 1, 8, 8.0);
    let s = q.take_slots(1, Want::Demand)[0];
    q.insert(k(0, 3), s, true);
    q.set_failed(s);
    assert_eq!(q.n_used(), 0);
}

#[test]
fn prefetched_marks_are_taken_once() {
    let mut p = Policy::new(1, 1, 8, 8.0);
    let s = p.take_slots(1, Want::Prefetch)[0];
    p.insert(k(0, 1), s, true);
    assert!(p.take_prefetched(s));
    assert!(!p.take_prefetched(s));
}

#[test]
fn a_prefetch_spares_the_layer_about_to_be_asked_for() {
    let mut p = Policy::new(2, 3, 8, 8.0);
    p.begin_call(0);
    fill(&mut p, k(1, 0));
    fill(&mut p, k(0, 5));
    p.touch(k(0, 5));
    // Layer 1's entry is the colder, but layer 1 is routed and about to be asked for.
    let got = p.take_slots_sparing(2, Want::Prefetch, Some(1));
    assert_eq!(got.len(), 1);
    assert_eq!(p.keys(), vec![k(1, 0)]);
}
