//! The eviction policies a user chooses among (`--sdq-policy`), by name.

use super::freq_auto::FreqAuto;
use super::policy::{Freq, Lru, Plan, Policy};

/// The policies there are, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Freq with shares, without, reuse or LRU, whichever has been hitting more (`FreqAuto`).
    #[default]
    FreqAuto,
    /// Frequency with aging, each layer within its share of its slot class
    /// (`Freq::with_shares`).
    FreqShares,
    /// Frequency with aging, aware of the layer cycle, over the whole class (`Freq`).
    Freq,
    /// Least recently used.
    Lru,
    /// Freq over the whole class, keeping the experts likeliest to be used
    /// within the tokens the arena holds (`Freq::with_reuse`).
    Reuse,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 5] = [PolicyKind::FreqAuto, PolicyKind::FreqShares, PolicyKind::Freq, PolicyKind::Lru, PolicyKind::Reuse];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Freq => "freq",
            PolicyKind::FreqShares => "freq-shares",
            PolicyKind::FreqAuto => "freq-auto",
            PolicyKind::Reuse => "reuse",
        }
    }

    /// The policy called `name`, or an error listing the names there are.
    pub fn parse(name: &str) -> Result<PolicyKind, String> {
        let name = name.trim();
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown policy '{name}' (one of: {})", PolicyKind::ALL.map(|k| k.name()).join(", ")))
    }

    /// A fresh policy of this kind over the slots of `plan`.
    pub fn build(self, plan: &Plan) -> Box<dyn Policy> {
        let n_slots = plan.classes.iter().map(|c| c.end).max().unwrap_or(0);
        match self {
            PolicyKind::Lru => Box::new(Lru::new(n_slots)),
            PolicyKind::Freq => Box::new(Freq::new(n_slots)),
            PolicyKind::FreqShares => Box::new(Freq::with_shares(n_slots, plan)),
            PolicyKind::FreqAuto => Box::new(FreqAuto::new(plan)),
            PolicyKind::Reuse => Box::new(Freq::with_reuse(n_slots, plan)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_are_listed() {
        assert_eq!(PolicyKind::parse("LRU"), Ok(PolicyKind::Lru));
        assert_eq!(PolicyKind::parse("freq"), Ok(PolicyKind::Freq));
        assert_eq!(PolicyKind::default(), PolicyKind::FreqAuto);
        assert_eq!(PolicyKind::parse("freq-shares"), Ok(PolicyKind::FreqShares));
        assert_eq!(PolicyKind::parse("reuse"), Ok(PolicyKind::Reuse));
        let e = PolicyKind::parse("fifo").unwrap_err();
        assert!(e.contains("'fifo'") && e.contains("lru"), "{e}");
    }
}
