//! A hot set as `--sdq-hotset` reads it (hotset.rs): whatever reads must
//! write back to the same text's meaning, and the model check must answer.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz-hot.txt");
    let Ok(set) = sdq::engine::routing::hotset::HotSet::read(path, data) else { return };
    let again = sdq::engine::routing::hotset::HotSet::read(path, set.to_text().as_bytes()).expect("a saved hot set reads back");
    assert_eq!(again.layers, set.layers);
    assert_eq!(again.experts.len(), set.experts.len());
    for (a, b) in again.experts.iter().zip(&set.experts) {
        assert_eq!((a.key, a.held), (b.key, b.held));
        assert!(a.count == b.count, "count {} read back as {}", b.count, a.count);
    }
    assert!(set.check_model(path, &set.layers).is_ok());
    let mut other = set.layers.clone();
    if let Some(g) = other.values_mut().next() {
        g.0 += 1;
        assert!(set.check_model(path, &other).is_err());
    }
});
