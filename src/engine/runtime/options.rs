//! sdq's options on every tool: `--ram-budget SIZE` (or `--ram-budget-mb N`),
//! `--sdq-reserve SIZE`, `--sdq-stats FILE`, `--sdq-policy NAME`,
//! `--sdq-trace FILE`, `--sdq-hotset FILE`, and their environment variables
//! `SDQ_RAM_BUDGET`, `SDQ_RESERVE_MB`, `SDQ_STATS_FILE`, `SDQ_POLICY`,
//! `SDQ_TRACE_FILE`, `SDQ_HOTSET_FILE`. They
//! are taken out of argv before upstream's parser sees it; flags win over
//! the environment.

use crate::error::{Error, Result};
use crate::units::{parse_size, MIB};
use std::ffi::OsString;
use std::path::PathBuf;

/// What the user asked of sdq. No budget: stock llama.cpp.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    pub budget: Option<u64>,
    /// The budget is `auto`: the arena also yields to falling MemAvailable.
    pub budget_auto: bool,
    pub reserve: Option<u64>,
    pub stats_file: Option<PathBuf>,
    /// Faults to inject into expert reads (`SDQ_FAULT_READ`, for tests).
    pub faults: crate::engine::pager::io::FaultPlan,
    /// Reader threads (`SDQ_READERS`: expert parts read at once).
    pub readers: Option<usize>,
    /// More tries for a read that failed with a transient error
    /// (`SDQ_READ_RETRIES`, default 3) and the first wait, doubled each
    /// time (`SDQ_READ_BACKOFF_MS`, default 100).
    pub read_retries: Option<u32>,
    pub read_backoff_ms: Option<u64>,
    /// Read the next layer's predicted experts ahead (`SDQ_PREFETCH`); None:
    /// while the arena holds at least two token cycles.
    pub prefetch: Option<bool>,
    /// At most this many ubatches of a prompt computed together, layer by
    /// layer (`SDQ_GROUP`; 1 computes them one at a time, as stock). None:
    /// all of a decode's, where the arena holds a layer's experts.
    pub group: Option<u32>,
    /// Whether a prompt group's first ubatch computes each layer's experts
    /// for the whole group (`SDQ_GROUP_SHARE`); None: where the arena holds
    /// fewer than a layer's experts.
    pub group_share: Option<bool>,
    /// Read experts with O_DIRECT where the file system allows (`SDQ_DIRECT_IO`, default on).
    pub direct_io: Option<bool>,
    /// When the arena's pages are faulted in (`SDQ_POPULATE`: 0, 1, idle or ahead).
    pub populate: Option<crate::engine::pager::Populate>,
    /// Which pages the arena asks for (`SDQ_HUGEPAGES`: auto, 0 or hugetlb).
    pub pages: Option<crate::engine::pager::PageChoice>,
    /// Read every expert in the background when the arena holds them all
    /// (`SDQ_PRELOAD`, default on).
    pub preload: Option<bool>,
    /// Which slot to evict (`--sdq-policy`, `SDQ_POLICY`).
    pub policy: Option<crate::engine::pager::PolicyKind>,
    /// Where to record the routing (`--sdq-trace`, `SDQ_TRACE_FILE`).
    pub trace_file: Option<PathBuf>,
    /// The hot set to start from and save at exit (`--sdq-hotset`, `SDQ_HOTSET_FILE`).
    pub hotset_file: Option<PathBuf>,
    /// The projector the tool loads (upstream's `--mmproj`/`-mm`, or
    /// `LLAMA_ARG_MMPROJ`), read but left for the tool: its weights and compute
    /// buffers are counted before the arena is sized.
    pub mmproj: Option<PathBuf>,
    /// Of the reserve, the bytes the tool's own growth is planned to take
    /// (llama-server's and llama-cli's prompt cache and checkpoints; see
    /// `memory::growth`): set by the drop-in tools, not an option.
    pub planned_growth: u64,
}

/// The help section printed after upstream's `--help`.
pub const HELP: &str = "\
----- sdq (routed experts paged from the model file) -----

--ram-budget SIZE        RAM budget for the whole process: routed-expert weights stay in the
                         file and are paged into an arena of (budget - resident - reserve).
                         SIZE is bytes or a number with K/M/G/T (binary units): 8G, 8GiB, 6144M,
                         or auto: the tightest of the memory cgroup's limit, MemAvailable and
                         RLIMIT_AS (env: SDQ_RAM_BUDGET; no budget = stock llama.cpp)
--ram-budget-mb N        the same in MiB
--sdq-reserve SIZE       memory kept out of the arena for compute buffers and growth
                         (env: SDQ_RESERVE_MB, in MiB; default budget/16 within 128 MiB..1 GiB)
--sdq-stats FILE         write the pager's figures as JSON at exit (env: SDQ_STATS_FILE)
--sdq-policy NAME        which arena slot to evict: freq-auto (the default: use counts with
                         aging, each layer within its share of the arena or not, a chance
                         of reuse learned as it runs, or LRU, whichever has been hitting
                         more), freq-shares, freq, lru or reuse (env: SDQ_POLICY)
--sdq-trace FILE         record the routing as CSV, one row per selected expert, for
                         `sdq replay` (env: SDQ_TRACE_FILE)
--sdq-hotset FILE        warm start: read the experts FILE lists (and the policy's counts)
                         back while no step is computed, and save the arena's to it at
                         exit (env: SDQ_HOTSET_FILE; a missing FILE is a cold start)
SDQ_READERS=N            reader threads: expert parts read at once (default 8, 1..=64)
SDQ_READ_RETRIES=N       more tries for an expert read that failed with EIO, EAGAIN or an early
                         end of file (default 3, 0..=10); SDQ_READ_BACKOFF_MS=MS waits MS before
                         the first, doubling each time (default 100: 0.7 s for all three)
SDQ_PREFETCH=0|1         read the next layer's likely experts while decoding (default: while the arena holds 2+ token
                         cycles and 85 % of the predicted experts are used)
SDQ_DIRECT_IO=0|1        read experts with O_DIRECT, straight into the arena (default 1)
SDQ_POPULATE=0|1|idle|ahead  fault the arena in: 1 all before the first token, 0 as slots
                         fill, idle slot by slot on a background thread at idle priority,
                         ahead (default) the same but no more than 256 MiB per slot class
                         beyond the slots filled so far
SDQ_PRELOAD=0|1          read every expert in the background when the arena holds them all (default 1)
SDQ_HUGEPAGES=auto|0|hugetlb  the arena on 2 MiB transparent huge pages where the system offers
                         them (auto, the default), on 4 KiB pages (0), or on reserved hugetlb
                         pages (vm.nr_hugepages), falling back to auto
";

fn policy_of(flag: &str, value: &str) -> Result<crate::engine::pager::PolicyKind> {
    crate::engine::pager::PolicyKind::parse(value).map_err(|e| Error::flag(flag, format!("{flag}: {e}")))
}

fn size_of(flag: &str, value: &str) -> Result<u64> {
    parse_size(value).map_err(|e| Error::flag(flag, format!("{flag}: {e}")))
}

fn is_auto(value: &str) -> bool {
    value.trim().eq_ignore_ascii_case("auto")
}

/// A budget value: a size, or `auto` (what this process may use, see `auto_budget`).
fn budget_of(flag: &str, value: &str) -> Result<u64> {
    if is_auto(value) {
        let (bytes, source) = crate::engine::memory::budget::auto_budget()
            .ok_or_else(|| Error::flag(flag, format!("{flag} auto: no memory limit, MemAvailable or RLIMIT_AS could be read")))?;
        stderr_line!("sdq: {flag} auto = {} ({source})", crate::units::human(bytes));
        return Ok(bytes);
    }
    size_of(flag, value)
}

/// An on/off environment variable: 1/on/true or 0/off/false.
fn switch(env: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<bool>> {
    match env(name).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => match v.trim() {
            "1" | "on" | "true" => Ok(Some(true)),
            "0" | "off" | "false" => Ok(Some(false)),
            _ => Err(Error::flag(name, format!("{name}: '{v}' is not 0 or 1"))),
        },
    }
}

fn mib_of(flag: &str, value: &str) -> Result<u64> {
    match value.trim().parse::<u64>() {
        Ok(n) if n > 0 && n < (1 << 43) => Ok(n * MIB),
        _ => Err(Error::flag(flag, format!("{flag}: '{value}' is not a positive number of MiB"))),
    }
}

impl Options {
    /// Reads the environment, then removes sdq's flags from `args` (argv
    /// without the program name is `args[1..]`) and applies them.
    pub fn from_args_and_env(args: &mut Vec<OsString>, env: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let mut o = Options::default();
        if let Some(v) = env("SDQ_RAM_BUDGET").filter(|v| !v.is_empty()) {
            o.budget = Some(budget_of("SDQ_RAM_BUDGET", &v)?);
            o.budget_auto = is_auto(&v);
        }
        if let Some(v) = env("SDQ_RESERVE_MB").filter(|v| !v.is_empty()) {
            o.reserve = Some(mib_of("SDQ_RESERVE_MB", &v)?);
        }
        if let Some(v) = env("SDQ_READERS").filter(|v| !v.is_empty()) {
            o.readers = Some(match v.trim().parse::<usize>() {
                Ok(n) if (1..=64).contains(&n) => n,
                _ => return Err(Error::flag("SDQ_READERS", format!("SDQ_READERS: '{v}' is not a number of reader threads from 1 to 64"))),
            });
        }
        if let Some(v) = env("SDQ_READ_RETRIES").filter(|v| !v.is_empty()) {
            o.read_retries = Some(match v.trim().parse::<u32>() {
                Ok(n) if n <= 10 => n,
                _ => return Err(Error::flag("SDQ_READ_RETRIES", format!("SDQ_READ_RETRIES: '{v}' is not a number of retries from 0 to 10"))),
            });
        }
        if let Some(v) = env("SDQ_READ_BACKOFF_MS").filter(|v| !v.is_empty()) {
            o.read_backoff_ms = Some(match v.trim().parse::<u64>() {
                Ok(n) if n <= 10_000 => n,
                _ => return Err(Error::flag("SDQ_READ_BACKOFF_MS", format!("SDQ_READ_BACKOFF_MS: '{v}' is not milliseconds from 0 to 10000"))),
            });
        }
        o.prefetch = switch(&env, "SDQ_PREFETCH")?;
        if let Some(v) = env("SDQ_GROUP").filter(|v| !v.is_empty()) {
            o.group = Some(match v.trim().parse::<u32>() {
                Ok(n) if (1..=4096).contains(&n) => n,
                _ => return Err(Error::flag("SDQ_GROUP", format!("SDQ_GROUP: '{v}' is not a number of ubatches from 1 to 4096"))),
            });
        }
        o.group_share = switch(&env, "SDQ_GROUP_SHARE")?;
        o.direct_io = switch(&env, "SDQ_DIRECT_IO")?;
        o.populate = match env("SDQ_POPULATE").filter(|v| !v.is_empty()) {
            None => None,
            Some(v) => Some(
                crate::engine::pager::Populate::parse(&v)
                    .ok_or_else(|| Error::flag("SDQ_POPULATE", format!("SDQ_POPULATE: '{v}' is not 0, 1, idle or ahead")))?,
            ),
        };
        o.preload = switch(&env, "SDQ_PRELOAD")?;
        o.pages = match env("SDQ_HUGEPAGES").filter(|v| !v.is_empty()) {
            None => None,
            Some(v) => Some(
                crate::engine::pager::PageChoice::parse(&v)
                    .ok_or_else(|| Error::flag("SDQ_HUGEPAGES", format!("SDQ_HUGEPAGES: '{v}' is not auto, 0 or hugetlb")))?,
            ),
        };
        if let Some(v) = env("SDQ_STATS_FILE").filter(|v| !v.is_empty()) {
            o.stats_file = Some(PathBuf::from(v));
        }
        if let Some(v) = env("SDQ_POLICY").filter(|v| !v.is_empty()) {
            o.policy = Some(policy_of("SDQ_POLICY", &v)?);
        }
        if let Some(v) = env("SDQ_TRACE_FILE").filter(|v| !v.is_empty()) {
            o.trace_file = Some(PathBuf::from(v));
        }
        if let Some(v) = env("SDQ_HOTSET_FILE").filter(|v| !v.is_empty()) {
            o.hotset_file = Some(PathBuf::from(v));
        }
        if let Some(v) = env("SDQ_FAULT_READ").filter(|v| !v.is_empty()) {
            o.faults = crate::engine::pager::io::FaultPlan::parse(&v).map_err(|e| Error::flag("SDQ_FAULT_READ", format!("SDQ_FAULT_READ: {e}")))?;
        }

        o.mmproj = env("LLAMA_ARG_MMPROJ").filter(|v| !v.is_empty()).map(PathBuf::from);
        for (i, a) in args.iter().enumerate().skip(1) {
            match a.to_str() {
                Some("--mmproj" | "-mm") => o.mmproj = args.get(i + 1).map(PathBuf::from),
                Some(s) if s.starts_with("--mmproj=") => o.mmproj = Some(PathBuf::from(&s["--mmproj=".len()..])),
                _ => {}
            }
        }

        let mut kept = Vec::with_capacity(args.len());
        let mut it = std::mem::take(args).into_iter();
        if let Some(program) = it.next() {
            kept.push(program);
        }
        while let Some(arg) = it.next() {
            let Some(s) = arg.to_str() else {
                kept.push(arg);
                continue;
            };
            let (flag, inline) = match s.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (s.to_string(), None),
            };
            if !matches!(flag.as_str(), "--ram-budget" | "--ram-budget-mb" | "--sdq-reserve" | "--sdq-stats" | "--sdq-policy" | "--sdq-trace" | "--sdq-hotset")
            {
                kept.push(arg);
                continue;
            }
            let value = match inline {
                Some(v) => v,
                None => it.next().and_then(|v| v.into_string().ok()).ok_or_else(|| Error::flag(flag.clone(), format!("{flag} needs a value")))?,
            };
            match flag.as_str() {
                "--ram-budget" => {
                    o.budget = Some(budget_of(&flag, &value)?);
                    o.budget_auto = is_auto(&value);
                }
                "--ram-budget-mb" => {
                    o.budget = Some(mib_of(&flag, &value)?);
                    o.budget_auto = false;
                }
                "--sdq-reserve" => o.reserve = Some(size_of(&flag, &value)?),
                "--sdq-policy" => o.policy = Some(policy_of(&flag, &value)?),
                "--sdq-trace" => o.trace_file = Some(PathBuf::from(value)),
                "--sdq-hotset" => o.hotset_file = Some(PathBuf::from(value)),
                _ => o.stats_file = Some(PathBuf::from(value)),
            }
        }
        *args = kept;
        Ok(o)
    }

    /// An error if a flag that concerns the paged experts was given without
    /// a budget (without one, nothing is paged and the flag would do nothing).
    pub fn check_needs_budget(&self) -> Result<()> {
        for (flag, given) in [("--sdq-trace", self.trace_file.is_some()), ("--sdq-hotset", self.hotset_file.is_some())] {
            if given && self.budget.is_none() {
                return Err(Error::invalid(format!(
                    "{flag} needs --ram-budget: it concerns the experts sdq pages (a budget above the model's size keeps them all in RAM)"
                )));
            }
        }
        Ok(())
    }

    /// Environment that passes these options to child processes (llama-server's
    /// router re-executes itself without sdq's flags).
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if let Some(b) = self.budget {
            env.push(("SDQ_RAM_BUDGET", b.to_string()));
        }
        if let Some(r) = self.reserve {
            env.push(("SDQ_RESERVE_MB", r.div_ceil(MIB).to_string()));
        }
        if let Some(f) = &self.stats_file {
            env.push(("SDQ_STATS_FILE", f.to_string_lossy().into_owned()));
        }
        if let Some(p) = self.policy {
            env.push(("SDQ_POLICY", p.name().to_string()));
        }
        if let Some(f) = &self.trace_file {
            env.push(("SDQ_TRACE_FILE", f.to_string_lossy().into_owned()));
        }
        if let Some(f) = &self.hotset_file {
            env.push(("SDQ_HOTSET_FILE", f.to_string_lossy().into_owned()));
        }
        if let Some(n) = self.readers {
            env.push(("SDQ_READERS", n.to_string()));
        }
        if let Some(n) = self.read_retries {
            env.push(("SDQ_READ_RETRIES", n.to_string()));
        }
        if let Some(ms) = self.read_backoff_ms {
            env.push(("SDQ_READ_BACKOFF_MS", ms.to_string()));
        }
        if let Some(n) = self.group {
            env.push(("SDQ_GROUP", n.to_string()));
        }
        if let Some(p) = self.populate {
            env.push(("SDQ_POPULATE", p.name().to_string()));
        }
        if let Some(p) = self.pages {
            env.push(("SDQ_HUGEPAGES", p.name().to_string()));
        }
        for (name, value) in
            [("SDQ_PREFETCH", self.prefetch), ("SDQ_GROUP_SHARE", self.group_share), ("SDQ_DIRECT_IO", self.direct_io), ("SDQ_PRELOAD", self.preload)]
        {
            if let Some(on) = value {
                env.push((name, if on { "1" } else { "0" }.to_string()));
            }
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> (Result<Options>, Vec<String>) {
        let mut a: Vec<OsString> = args.iter().map(OsString::from).collect();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let o = Options::from_args_and_env(&mut a, |k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()));
        (o, a.into_iter().map(|s| s.into_string().unwrap()).collect())
    }

    #[test]
    fn flags_are_taken_out_of_argv() {
        let (o, rest) = parse(&["llama-cli", "-m", "x.gguf", "--ram-budget", "8G", "--sdq-stats=s.json", "-n", "4"], &[]);
        let o = o.unwrap();
        assert_eq!(o.budget, Some(8 * GIB));
        assert_eq!(o.stats_file, Some(PathBuf::from("s.json")));
        assert_eq!(rest, ["llama-cli", "-m", "x.gguf", "-n", "4"]);
    }

    #[test]
    fn flags_win_over_environment() {
        let (o, _) = parse(&["t", "--ram-budget-mb", "6144"], &[("SDQ_RAM_BUDGET", "2G"), ("SDQ_RESERVE_MB", "256")]);
        let o = o.unwrap();
        assert_eq!((o.budget, o.reserve), (Some(6 * GIB), Some(256 * MIB)));
        let (o, _) = parse(&["t"], &[("SDQ_RAM_BUDGET", "2G")]);
        assert_eq!(o.unwrap().budget, Some(2 * GIB));
    }

    #[test]
    fn bad_values_name_the_flag_and_value() {
        for (args, env, needle, flag) in [
            (&["t", "--ram-budget", "8X"][..], &[][..], "--ram-budget: '8X'", "--ram-budget"),
            (&["t", "--ram-budget", "0"][..], &[][..], "'0' is zero", "--ram-budget"),
            (&["t", "--ram-budget", "-1"][..], &[][..], "'-1'", "--ram-budget"),
            (&["t", "--ram-budget"][..], &[][..], "--ram-budget needs a value", "--ram-budget"),
            (&["t", "--ram-budget-mb", "1.5"][..], &[][..], "'1.5' is not a positive number of MiB", "--ram-budget-mb"),
            (&["t"][..], &[("SDQ_RESERVE_MB", "lots")][..], "SDQ_RESERVE_MB: 'lots'", "SDQ_RESERVE_MB"),
            (&["t"][..], &[("SDQ_PREFETCH", "maybe")][..], "SDQ_PREFETCH: 'maybe'", "SDQ_PREFETCH"),
            (&["t"][..], &[("SDQ_POPULATE", "later")][..], "SDQ_POPULATE: 'later'", "SDQ_POPULATE"),
            (&["t"][..], &[("SDQ_GROUP", "0")][..], "SDQ_GROUP: '0' is not a number of ubatches", "SDQ_GROUP"),
            (&["t"][..], &[("SDQ_HUGEPAGES", "1g")][..], "SDQ_HUGEPAGES: '1g' is not auto, 0 or hugetlb", "SDQ_HUGEPAGES"),
            (&["t", "--sdq-policy", "fifo"][..], &[][..], "--sdq-policy: unknown policy 'fifo'", "--sdq-policy"),
        ] {
            // A caller tells a bad flag from other errors, and which flag.
            match parse(args, env).0.unwrap_err() {
                Error::Flag { name, message } => {
                    assert_eq!(name, flag, "{args:?} {env:?}: {message}");
                    assert!(message.contains(needle), "{args:?}: {message}");
                }
                e => panic!("{args:?} {env:?}: not a flag error: {e:?}"),
            }
        }
    }

    #[test]
    fn environment_round_trips() {
        let o = Options {
            budget: Some(3 * GIB),
            reserve: Some(200 * MIB),
            stats_file: Some("f".into()),
            readers: Some(3),
            read_retries: Some(5),
            read_backoff_ms: Some(10),
            prefetch: Some(false),
            group: Some(4),
            group_share: Some(true),
            direct_io: Some(true),
            populate: Some(crate::engine::pager::Populate::Idle),
            pages: Some(crate::engine::pager::PageChoice::Small),
            preload: Some(false),
            policy: Some(crate::engine::pager::PolicyKind::Lru),
            trace_file: Some("t.csv".into()),
            hotset_file: Some("h.txt".into()),
            ..Default::default()
        };
        let env = o.to_env();
        let (back, _) = parse(&["t"], &env.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
        assert_eq!(back.unwrap(), o);
    }
}
