//! Where NCCL's PyPI wheel may be installed, found by looking at directories only (see
//! [`WheelSearch`]): a library starts no process of its own, so Python is never run to ask where
//! its packages are.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where NCCL's PyPI wheel is looked for (`site-packages/nvidia/nccl/lib/libnccl.so.2`, the
/// layout of `nvidia-nccl-cu*`, which PyTorch and JAX install): the environment variables the
/// search reads (`None` = unset). Nothing is run; the places Python itself looks are listed, in
/// this order:
///
/// 1. the active virtual environment (`VIRTUAL_ENV`) and conda environment (`CONDA_PREFIX`):
///    `lib/python3*/site-packages`;
/// 2. every directory of `PYTHONPATH`;
/// 3. the installation of each Python on `PATH` (a directory of `PATH` holding `python3` or
///    `python`: its parent's `lib/python3*/{site,dist}-packages`, as for a venv's, conda's,
///    pyenv's or the system's `bin`);
/// 4. the user's site (`~/.local/lib/python3*/site-packages`);
/// 5. the system's: `/usr/local/lib/python3*/{dist,site}-packages` and
///    `/usr/lib/python3*/{dist,site}-packages` (`python3*` includes Debian's `python3`).
///
/// Within one directory the `python3*` versions are tried newest first. A library found twice
/// (the same file through two paths) is listed once.
///
/// ```no_run
/// // Where this process would find NCCL's wheel, in the order it is tried.
/// for library in ppnrt::nccl::WheelSearch::from_env().libraries() {
///     println!("{library}");
/// }
/// ```
#[derive(Debug, Clone, Default)]
pub struct WheelSearch {
    /// `VIRTUAL_ENV`.
    pub virtual_env: Option<OsString>,
    /// `CONDA_PREFIX`.
    pub conda_prefix: Option<OsString>,
    /// `PYTHONPATH`.
    pub pythonpath: Option<OsString>,
    /// `PATH`.
    pub path: Option<OsString>,
    /// `HOME`.
    pub home: Option<OsString>,
    /// The system's directories (`/usr/local/lib`, `/usr/lib`); others in tests.
    pub system_lib_dirs: Vec<PathBuf>,
}

/// Where the wheel's library lies inside a site directory.
const WHEEL_LIBRARY: &str = "nvidia/nccl/lib/libnccl.so.2";

impl WheelSearch {
    /// The search this process's environment asks for.
    pub fn from_env() -> WheelSearch {
        let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
        WheelSearch {
            virtual_env: var("VIRTUAL_ENV"),
            conda_prefix: var("CONDA_PREFIX"),
            pythonpath: var("PYTHONPATH"),
            path: var("PATH"),
            home: var("HOME"),
            system_lib_dirs: vec![PathBuf::from("/usr/local/lib"), PathBuf::from("/usr/lib")],
        }
    }

    /// The site directories to look in, in the order above (some may not exist).
    pub fn sites(&self) -> Vec<PathBuf> {
        let mut sites = Vec::new();
        for prefix in [&self.virtual_env, &self.conda_prefix].into_iter().flatten() {
            sites.extend(versioned(&Path::new(prefix).join("lib"), &["site-packages"]));
        }
        if let Some(pythonpath) = &self.pythonpath {
            sites.extend(std::env::split_paths(pythonpath).filter(|dir| !dir.as_os_str().is_empty()));
        }
        if let Some(path) = &self.path {
            for bin in std::env::split_paths(path) {
                let has_python = ["python3", "python"].iter().any(|name| bin.join(name).is_file());
                if let (true, Some(prefix)) = (has_python, bin.parent()) {
                    sites.extend(versioned(&prefix.join("lib"), &["site-packages", "dist-packages"]));
                }
            }
        }
        if let Some(home) = &self.home {
            sites.extend(versioned(&Path::new(home).join(".local/lib"), &["site-packages"]));
        }
        for lib in &self.system_lib_dirs {
            sites.extend(versioned(lib, &["dist-packages", "site-packages"]));
        }
        sites
    }

    /// The wheel's libraries found in [`sites`](Self::sites), each once, in order.
    pub fn libraries(&self) -> Vec<String> {
        let mut seen: Vec<PathBuf> = Vec::new();
        let mut found = Vec::new();
        for site in self.sites() {
            let library = site.join(WHEEL_LIBRARY);
            if !library.is_file() {
                continue;
            }
            let same = std::fs::canonicalize(&library).unwrap_or_else(|_| library.clone());
            if !seen.contains(&same) {
                seen.push(same);
                found.push(library.to_string_lossy().into_owned());
            }
        }
        found
    }
}

/// `lib/python3*/{leaf}` for each leaf, the versions newest first (by their numbers).
fn versioned(lib: &Path, leaves: &[&str]) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(lib) else { return Vec::new() };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let version = name.strip_prefix("python3")?;
            let numbers = std::iter::once(3)
                .chain(version.trim_start_matches('.').split('.').filter_map(|part| part.parse().ok()))
                .collect();
            Some((numbers, entry.path()))
        })
        .collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions.into_iter().flat_map(|(_, dir)| leaves.iter().map(move |leaf| dir.join(leaf))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of this test process.
    fn root(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ppnrt-wheel-search-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A fake wheel library in `site`; its path.
    fn wheel(site: &Path) -> String {
        let lib = site.join("nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not a library").unwrap();
        lib.join("libnccl.so.2").to_string_lossy().into_owned()
    }

    #[test]
    fn every_place_python_looks_is_searched_in_order() {
        let root = root("order");
        let venv = wheel(&root.join("venv/lib/python3.12/site-packages"));
        let conda = wheel(&root.join("conda/lib/python3.11/site-packages"));
        let pythonpath = wheel(&root.join("extra"));
        // A Python on PATH: its bin holds `python3`, its lib the packages.
        std::fs::create_dir_all(root.join("pyenv/bin")).unwrap();
        std::fs::write(root.join("pyenv/bin/python3"), b"").unwrap();
        let on_path = wheel(&root.join("pyenv/lib/python3.10/site-packages"));
        // A bin without Python: its lib is not searched.
        std::fs::create_dir_all(root.join("tools/bin")).unwrap();
        wheel(&root.join("tools/lib/python3.10/site-packages"));
        let user = wheel(&root.join("home/.local/lib/python3.9/site-packages"));
        let system_new = wheel(&root.join("usr/lib/python3.13/dist-packages"));
        let system_old = wheel(&root.join("usr/lib/python3.9/dist-packages"));
        let debian = wheel(&root.join("usr/lib/python3/dist-packages"));
        let search = WheelSearch {
            virtual_env: Some(root.join("venv").into()),
            conda_prefix: Some(root.join("conda").into()),
            pythonpath: Some(std::env::join_paths([root.join("extra"), root.join("absent")]).unwrap()),
            path: Some(std::env::join_paths([root.join("tools/bin"), root.join("pyenv/bin")]).unwrap()),
            home: Some(root.join("home").into()),
            system_lib_dirs: vec![root.join("usr/local/lib"), root.join("usr/lib")],
        };
        assert_eq!(
            search.libraries(),
            [venv, conda, pythonpath, on_path, user, system_new, system_old, debian],
            "{:#?}",
            search.sites()
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_library_reached_twice_is_listed_once_and_nothing_set_finds_nothing() {
        let root = root("twice");
        let venv = wheel(&root.join("venv/lib/python3.12/site-packages"));
        std::fs::create_dir_all(root.join("venv/bin")).unwrap();
        std::fs::write(root.join("venv/bin/python"), b"").unwrap();
        let search = WheelSearch {
            virtual_env: Some(root.join("venv").into()),
            path: Some(root.join("venv/bin").into()),
            pythonpath: Some(root.join("venv/lib/python3.12/site-packages").into()),
            ..WheelSearch::default()
        };
        assert_eq!(search.libraries(), [venv]);
        assert!(WheelSearch::default().libraries().is_empty());
        std::fs::remove_dir_all(root).unwrap();
    }
}
