//! Build script: provides the driver bindings and the helper kernels' PTX in `OUT_DIR`.
//!
//! An ordinary build copies the committed, generated files (`src/sys/driver_bindings.rs`,
//! `kernels/ptx/*.ptx`) and looks at nothing else: whatever CUDA toolkit, headers or libclang the
//! machine has, the crate is built from the same sources, and nothing is printed.
//!
//! Regeneration happens only on request, with the `regenerate` feature (which brings in bindgen
//! and the `cc` crate): bindgen over `wrapper.h` and nvcc over `kernels/*.cu`, from the toolkit
//! found through `CUDA_PATH`, `CUDA_HOME`, `nvcc` on `PATH`, `/usr/local/cuda` or the PyPI wheel
//! layout (`site-packages/nvidia/cu13`, through `VIRTUAL_ENV` or `python3`), with
//! `PPNRT_PTX_ARCH` (default: the toolkit's lowest architecture) and `LIBCLANG_PATH`. With
//! `PPNRT_UPDATE_GENERATED=1` the fresh files are also written over the committed copies (CI does
//! that with the pinned toolkit and fails when `git diff` shows a difference). A requested
//! regeneration that cannot run says why in a cargo warning and uses the committed copies.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const COMMITTED_BINDINGS: &str = "src/sys/driver_bindings.rs";
const COMMITTED_NCCL_BINDINGS: &str = "src/sys/nccl_bindings.rs";
const COMMITTED_PTX_DIR: &str = "kernels/ptx";
#[cfg(feature = "regenerate")]
const KERNEL_DIR: &str = "kernels";

fn main() {
    println!("cargo:rerun-if-env-changed=PPNRT_UPDATE_GENERATED");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={COMMITTED_BINDINGS}");
    println!("cargo:rerun-if-changed={COMMITTED_NCCL_BINDINGS}");
    println!("cargo:rerun-if-changed={COMMITTED_PTX_DIR}");

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let update_committed = env::var("PPNRT_UPDATE_GENERATED").is_ok_and(|v| v == "1");

    #[cfg(feature = "regenerate")]
    {
        regenerate::run(&manifest_dir, &out_dir, update_committed);
    }
    #[cfg(not(feature = "regenerate"))]
    {
        if update_committed {
            println!(
                "cargo:warning=ppnrt: PPNRT_UPDATE_GENERATED=1 needs the `regenerate` feature \
                 (cargo build --features regenerate); the committed bindings and PTX were used"
            );
        }
        copy_committed(&manifest_dir, &out_dir);
    }
}

/// The committed PTX files, by kernel name.
fn committed_ptx(manifest_dir: &Path) -> Vec<(String, PathBuf)> {
    let dir = manifest_dir.join(COMMITTED_PTX_DIR);
    let mut files: Vec<(String, PathBuf)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "ptx"))
        .map(|path| (path.file_stem().expect("a file has a stem").to_string_lossy().into_owned(), path))
        .collect();
    files.sort();
    files
}

/// Copies the committed bindings and PTX into `OUT_DIR`.
#[cfg_attr(feature = "regenerate", allow(dead_code))]
fn copy_committed(manifest_dir: &Path, out_dir: &Path) {
    copy_file(&manifest_dir.join(COMMITTED_BINDINGS), &out_dir.join("driver_bindings.rs"));
    copy_file(&manifest_dir.join(COMMITTED_NCCL_BINDINGS), &out_dir.join("nccl_bindings.rs"));
    for (stem, path) in committed_ptx(manifest_dir) {
        copy_file(&path, &out_dir.join(format!("{stem}.ptx")));
    }
}

fn copy_file(from: &Path, to: &Path) {
    let text = fs::read_to_string(from).unwrap_or_else(|e| panic!("cannot read {}: {e}", from.display()));
    write_if_changed(to, &text);
}

fn write_if_changed(path: &Path, text: &str) {
    if fs::read_to_string(path).is_ok_and(|old| old == text) {
        return;
    }
    fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

/// Regeneration from a CUDA toolkit, on request only.
#[cfg(feature = "regenerate")]
mod regenerate {
    use std::env;
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use super::{COMMITTED_BINDINGS, COMMITTED_NCCL_BINDINGS, COMMITTED_PTX_DIR, KERNEL_DIR, write_if_changed};

    pub(super) fn run(manifest_dir: &Path, out_dir: &Path, update_committed: bool) {
        for var in ["CUDA_PATH", "CUDA_HOME", "NCCL_HOME", "PATH", "VIRTUAL_ENV", "PPNRT_PTX_ARCH", "LIBCLANG_PATH"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        println!("cargo:rerun-if-changed=wrapper.h");
        println!("cargo:rerun-if-changed=nccl_wrapper.h");
        println!("cargo:rerun-if-changed={KERNEL_DIR}");
        let toolkit = Toolkit::find();
        bindings(manifest_dir, out_dir, &toolkit, update_committed);
        nccl_bindings(manifest_dir, out_dir, &toolkit, update_committed);
        kernels(manifest_dir, out_dir, &toolkit, update_committed);
    }

    /// Writes `OUT_DIR/nccl_bindings.rs` from `nccl_wrapper.h`: fresh from bindgen when it can
    /// (nccl.h from `NCCL_HOME/include` or the PyPI wheel layout `site-packages/nvidia/nccl/include`,
    /// plus the CUDA headers it includes), else the committed copy.
    fn nccl_bindings(manifest_dir: &Path, out_dir: &Path, toolkit: &Toolkit, update_committed: bool) {
        let committed = manifest_dir.join(COMMITTED_NCCL_BINDINGS);
        let out = out_dir.join("nccl_bindings.rs");
        let mut roots: Vec<PathBuf> = env::var_os("NCCL_HOME").map(PathBuf::from).into_iter().collect();
        roots.extend(site_packages().into_iter().map(|site| site.join("nvidia").join("nccl")));
        let nccl_include = roots.iter().map(|root| root.join("include")).find(|dir| dir.join("nccl.h").is_file());
        let fresh = match (&nccl_include, &toolkit.include_dir) {
            (None, _) => Err("no nccl.h was found (set NCCL_HOME or install nvidia-nccl-cu13)".to_string()),
            (_, None) => Err("no CUDA headers (cuda_runtime.h, which nccl.h includes) were found".to_string()),
            (Some(nccl), Some(cuda)) => generate_nccl_bindings(manifest_dir, nccl, cuda),
        };
        emit(fresh, &out, &committed, update_committed, "NCCL bindings");
    }

    fn generate_nccl_bindings(manifest_dir: &Path, nccl_include: &Path, cuda_include: &Path) -> Result<String, String> {
        let header = manifest_dir.join("nccl_wrapper.h");
        let builder = bindgen::Builder::default()
            .header(header.to_string_lossy())
            .clang_arg(format!("-I{}", nccl_include.display()))
            .clang_arg(format!("-I{}", cuda_include.display()))
            // The point-to-point, group, communicator and error surface a pipeline boundary needs,
            // and the configured (non-blocking) join.
            .allowlist_function(
                "nccl(GetVersion|GetUniqueId|CommInitRank|CommInitRankConfig|CommFinalize|CommDestroy|CommAbort|\
                 CommGetAsyncError|CommCount|CommCuDevice|CommUserRank|GetErrorString|GetLastError|Send|Recv|\
                 GroupStart|GroupEnd)",
            )
            .allowlist_type("nccl(Result_t|UniqueId|Comm_t|DataType_t|Config_t)")
            .allowlist_var("NCCL_(MAJOR|MINOR|PATCH|VERSION_CODE|UNIQUE_ID_BYTES)");
        let generated = generate_dynamic(builder, "NcclApi");
        let version = fs::read_to_string(nccl_include.join("nccl.h")).ok().and_then(|header| {
            let value = |name: &str| {
                header.lines().find_map(|l| l.strip_prefix(&format!("#define {name} ")).map(|v| v.trim().to_string()))
            };
            Some(format!("{}.{}.{}", value("NCCL_MAJOR")?, value("NCCL_MINOR")?, value("NCCL_PATCH")?))
        });
        generated.map(|bindings| {
            format!(
                "// Generated by bindgen from nccl_wrapper.h (NCCL {}); do not edit. Regenerate with\n\
                 // `PPNRT_UPDATE_GENERATED=1 cargo build --features regenerate`.\n{}",
                version.unwrap_or_else(|| "unknown".into()),
                bindings
            )
        })
    }

    /// Where the CUDA headers and `nvcc` were found (either may be missing).
    struct Toolkit {
        include_dir: Option<PathBuf>,
        nvcc: Option<PathBuf>,
    }

    impl Toolkit {
        fn find() -> Toolkit {
            let roots = candidate_roots();
            let include_dir = roots.iter().map(|root| root.join("include")).find(|dir| dir.join("cuda.h").is_file());
            let nvcc = roots.iter().map(|root| root.join("bin").join("nvcc")).find(|path| path.is_file());
            Toolkit { include_dir, nvcc }
        }
    }

    /// Toolkit roots in the order they are tried; each holds `include/` and/or `bin/nvcc`.
    fn candidate_roots() -> Vec<PathBuf> {
        let mut roots = Vec::new();
        for var in ["CUDA_PATH", "CUDA_HOME"] {
            if let Some(dir) = env::var_os(var) {
                roots.push(PathBuf::from(dir));
            }
        }
        if let Some(path) = env::var_os("PATH") {
            for dir in env::split_paths(&path) {
                if dir.join("nvcc").is_file() {
                    if let Some(root) = dir.parent() {
                        roots.push(root.to_path_buf());
                    }
                }
            }
        }
        roots.push(PathBuf::from("/usr/local/cuda"));
        // The PyPI wheels (nvidia-cuda-runtime, -nvcc, -crt, nvidia-nvvm 13.x) install into
        // site-packages/nvidia/cu13/{include,bin,nvvm}.
        for site in site_packages() {
            roots.push(site.join("nvidia").join("cu13"));
        }
        roots
    }

    /// Python's site-packages directories: the virtual environment's (`VIRTUAL_ENV`), then the
    /// one `python3` reports.
    fn site_packages() -> Vec<PathBuf> {
        let mut site_dirs = Vec::new();
        if let Some(venv) = env::var_os("VIRTUAL_ENV") {
            if let Ok(entries) = fs::read_dir(Path::new(&venv).join("lib")) {
                for entry in entries.flatten() {
                    site_dirs.push(entry.path().join("site-packages"));
                }
            }
        }
        if let Ok(out) =
            Command::new("python3").args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).output()
        {
            if out.status.success() {
                site_dirs.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
            }
        }
        site_dirs
    }

    /// Writes `OUT_DIR/driver_bindings.rs`: fresh from bindgen when it can, else the committed copy.
    fn bindings(manifest_dir: &Path, out_dir: &Path, toolkit: &Toolkit, update_committed: bool) {
        let committed = manifest_dir.join(COMMITTED_BINDINGS);
        let out = out_dir.join("driver_bindings.rs");
        let fresh = match &toolkit.include_dir {
            None => Err("no CUDA headers (cuda.h) were found".to_string()),
            Some(include_dir) => generate_bindings(manifest_dir, include_dir),
        };
        emit(fresh, &out, &committed, update_committed, "driver bindings");
    }

    fn generate_bindings(manifest_dir: &Path, include_dir: &Path) -> Result<String, String> {
        let header = manifest_dir.join("wrapper.h");
        let builder = bindgen::Builder::default()
            .header(header.to_string_lossy())
            .clang_arg(format!("-I{}", include_dir.display()))
            .allowlist_function("cu[A-Z].*")
            .allowlist_type("CU.*|cudaError_enum|cudaStream_t|cudaEvent_t|cudaError_t|cudaError")
            .allowlist_var("CU_.*|CUDA_VERSION");
        generate_dynamic(builder, "DriverApi").map(|bindings| {
            format!(
                "// Generated by bindgen from wrapper.h (CUDA {}); do not edit. Regenerate with\n\
                 // `PPNRT_UPDATE_GENERATED=1 cargo build`.\n{}",
                cuda_version_of(include_dir).unwrap_or_else(|| "unknown".into()),
                bindings
            )
        })
    }

    /// Runs bindgen with the settings every binding of this crate shares: C enums as
    /// `#[repr(transparent)]` newtypes (a code the Rust side does not know is then a value, never
    /// undefined behaviour) and a run-time loaded library struct `library` with one `Result` per
    /// entry point.
    fn generate_dynamic(builder: bindgen::Builder, library: &str) -> Result<String, String> {
        use bindgen::{EnumVariation, Formatter};
        let builder = builder
            .default_enum_style(EnumVariation::NewType { is_bitfield: false, is_global: false })
            .dynamic_library_name(library)
            .dynamic_link_require_all(false)
            .layout_tests(false)
            .derive_default(true)
            .derive_debug(true)
            .generate_comments(false)
            .formatter(Formatter::Prettyplease)
            .rust_target(bindgen::RustTarget::stable(85, 0).map_err(|e| e.to_string())?);
        // bindgen panics when it cannot load libclang; that is the fallback case, not a build failure.
        let previous_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let generated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
        std::panic::set_hook(previous_hook);
        match generated {
            Ok(Ok(bindings)) => Ok(bindings.to_string()),
            Ok(Err(e)) => Err(format!("bindgen failed: {e}")),
            Err(_) => Err("libclang could not be loaded (install libclang-dev or set LIBCLANG_PATH)".into()),
        }
    }

    fn cuda_version_of(include_dir: &Path) -> Option<String> {
        let header = fs::read_to_string(include_dir.join("cuda.h")).ok()?;
        let line = header.lines().find(|l| l.starts_with("#define CUDA_VERSION "))?;
        let raw: u32 = line.split_whitespace().nth(2)?.parse().ok()?;
        Some(format!("{}.{}", raw / 1000, (raw % 1000) / 10))
    }

    /// Writes `OUT_DIR/<name>.ptx` for each `kernels/<name>.cu`: fresh from nvcc when it can, else
    /// the committed copy.
    fn kernels(manifest_dir: &Path, out_dir: &Path, toolkit: &Toolkit, update_committed: bool) {
        let kernel_dir = manifest_dir.join(KERNEL_DIR);
        let mut sources: Vec<PathBuf> = fs::read_dir(&kernel_dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", kernel_dir.display()))
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
            .collect();
        sources.sort();
        for source in &sources {
            println!("cargo:rerun-if-changed={}", source.display());
        }
        for header in fs::read_dir(&kernel_dir).into_iter().flatten().flatten() {
            if header.path().extension().is_some_and(|ext| ext == "cuh") {
                println!("cargo:rerun-if-changed={}", header.path().display());
            }
        }
        let arch = env::var("PPNRT_PTX_ARCH").ok();
        for source in &sources {
            let stem = source.file_stem().expect("a .cu file has a stem").to_string_lossy().into_owned();
            let committed = manifest_dir.join(COMMITTED_PTX_DIR).join(format!("{stem}.ptx"));
            let out = out_dir.join(format!("{stem}.ptx"));
            let fresh = match &toolkit.nvcc {
                None => Err("nvcc was not found".to_string()),
                Some(nvcc) => compile_ptx(nvcc, source, out_dir, arch.as_deref()),
            };
            emit(fresh, &out, &committed, update_committed, &format!("PTX for {stem}"));
        }
    }

    fn compile_ptx(nvcc: &Path, source: &Path, out_dir: &Path, arch: Option<&str>) -> Result<String, String> {
        let arch = match arch {
            Some(arch) => arch.to_string(),
            None => lowest_arch(nvcc)?,
        };
        let stem = source.file_stem().expect("a .cu file has a stem").to_string_lossy().into_owned();
        let target = out_dir.join(format!("{stem}.fresh.ptx"));
        let host_compiler = cc::Build::new().cpp(true).get_compiler();
        let output = Command::new(nvcc)
            .arg("-ptx")
            .arg(format!("-arch={arch}"))
            .arg("-O3")
            .arg("-std=c++17")
            .arg("-ccbin")
            .arg(host_compiler.path())
            .arg(source)
            .arg("-o")
            .arg(&target)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        if !output.status.success() {
            // A kernel that does not compile is a real error, not a reason to fall back silently.
            panic!(
                "nvcc failed on {}:\n{}{}",
                source.display(),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        fs::read_to_string(&target).map_err(|e| format!("cannot read {}: {e}", target.display()))
    }

    /// The lowest virtual architecture (`compute_XX`) the toolkit can target.
    fn lowest_arch(nvcc: &Path) -> Result<String, String> {
        let output = Command::new(nvcc)
            .arg("--list-gpu-arch")
            .output()
            .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        let list = String::from_utf8_lossy(&output.stdout);
        list.lines()
            .filter_map(|l| l.trim().strip_prefix("compute_"))
            .filter_map(|n| n.parse::<u32>().ok())
            .min()
            .map(|n| format!("compute_{n}"))
            .ok_or_else(|| format!("`nvcc --list-gpu-arch` listed no architecture: {list}"))
    }

    /// Writes the fresh output (and, when asked, over the committed copy), or, when it could not be
    /// made, the committed copy with a cargo warning saying why.
    fn emit(fresh: Result<String, String>, out: &Path, committed: &Path, update_committed: bool, what: &str) {
        match fresh {
            Ok(text) => {
                write_if_changed(out, &text);
                if update_committed {
                    write_if_changed(committed, &text);
                }
            }
            Err(why) => {
                println!(
                    "cargo:warning=ppnrt: regeneration was requested, but the committed {what} ({}) were used: {why}",
                    committed.display()
                );
                let text = fs::read_to_string(committed)
                    .unwrap_or_else(|e| panic!("cannot read the committed {what} {}: {e}", committed.display()));
                write_if_changed(out, &text);
            }
        }
    }
}
