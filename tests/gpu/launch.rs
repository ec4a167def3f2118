//! Kernels as engines ship them, on the GPU: a twelve-parameter kernel (a `#[repr(C)]` struct by
//! value, `bf16`, `f16`, `bool`, 8- to 64-bit integers and floats, two slices) loaded from a fatbin
//! and from a cubin (`tests/data`, built by `scripts/build-test-kernels.sh` from
//! `tests/data/test_params.cu`), launched with a tuple and with a `KernelArgList`; every output is
//! checked bitwise against the host's arithmetic (the values are chosen so that every sum is
//! exact). A truncated image is refused before the driver reads it. Skips, saying why, without a
//! GPU (the parameter marshalling and the image checks have unit tests that run everywhere).

use crate::common;

use common::needs::{Needs, requires};
use ppnrt::{CudaError, KernelArgList, LaunchConfig, Module, bf16, by_value, f16};

static FATBIN: &[u8] = include_bytes!("../data/test_params.fatbin");
static CUBIN: &[u8] = include_bytes!("../data/test_params.cubin");

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct Shape {
    rows: u32,
    cols: u32,
    scale: f32,
}

/// The scalar parameters of one launch.
#[derive(Clone, Copy)]
struct Scalars {
    shape: Shape,
    bias: bf16,
    negate: bool,
    offset: i32,
    small: u8,
    wide: f64,
    half_term: f16,
    big: i64,
    last: u32,
}

/// What the kernel computes, on the host.
fn expected(x: &[f32], s: Scalars) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let v = v * s.shape.scale
                + s.bias.to_f32()
                + s.offset as f32
                + f32::from(s.small)
                + s.wide as f32
                + s.half_term.to_f32()
                + s.big as f32
                + s.last as f32
                + (s.shape.rows * s.shape.cols) as f32;
            if s.negate { -v } else { v }
        })
        .collect()
}

#[test]
fn a_twelve_parameter_kernel_from_a_fatbin_and_a_cubin_computes_exactly() {
    let Some(gpu) = requires("a_twelve_parameter_kernel_from_a_fatbin_and_a_cubin_computes_exactly", Needs::gpus(1))
    else {
        return;
    };
    let engine = gpu.engine(0);
    // The cubin holds sm_90 code only; the fatbin also compute_90 PTX, which later GPUs compile.
    let sm_90 = engine.device().compute_capability().unwrap() == (9, 0);
    if !sm_90 {
        common::say("the cubin case skipped: it holds sm_90 code and this GPU is another architecture");
    }
    let stream = engine.stream().unwrap();
    let n = 100_003usize;
    let xs: Vec<f32> = (0..n).map(|i| (i % 64) as f32).collect();
    let x = engine.htod(&xs).unwrap();
    let cases = [
        Scalars {
            shape: Shape { rows: 3, cols: 5, scale: 0.25 },
            bias: bf16::from_f32(1.5),
            negate: false,
            offset: -4,
            small: 200,
            wide: 0.125,
            half_term: f16::from_f32(-2.0),
            big: -(1 << 20),
            last: 9,
        },
        Scalars {
            shape: Shape { rows: 7, cols: 2, scale: -0.5 },
            bias: bf16::from_f32(-0.75),
            negate: true,
            offset: 12,
            small: 1,
            wide: -3.0,
            half_term: f16::from_f32(0.5),
            big: 1 << 22,
            last: 1000,
        },
    ];
    for (image, kind) in [(FATBIN, "fatbin"), (CUBIN, "cubin")] {
        if kind == "cubin" && !sm_90 {
            continue;
        }
        let module = Module::load_image(engine.context(), kind, image).unwrap();
        let kernel = module.function("ppnrt_test_params12").unwrap();
        if kind == "cubin" {
            // A cubin lists its kernels: refused before the driver is asked. (A fatbin's are the
            // driver's to know; asking it for a missing one is an API error a sanitizer reports.)
            assert!(matches!(module.function("no_such_kernel"), Err(CudaError::KernelNotFound { .. })));
            assert_eq!(module.entries(), ["ppnrt_test_params12"]);
        }
        for (round, s) in cases.iter().enumerate() {
            let config = LaunchConfig::for_elements(n, 264);
            // With a tuple.
            let mut y = engine.alloc::<f32>(n).unwrap();
            let args = (
                &x,
                &mut y,
                n as u64,
                by_value(s.shape),
                s.bias,
                s.negate,
                s.offset,
                s.small,
                s.wide,
                s.half_term,
                s.big,
                s.last,
            );
            // SAFETY: the arguments match `ppnrt_test_params12`'s parameters in order, size and
            // meaning; the kernel reads `n` elements of `x` and writes `n` of `y`.
            unsafe { stream.launch(&kernel, config, args) }.unwrap();
            assert!(engine.dtoh(&y).unwrap() == expected(&xs, *s), "{kind}, round {round}, tuple");
            // With a list.
            let mut z = engine.alloc::<f32>(n).unwrap();
            let list = KernelArgList::new()
                .arg(&x)
                .arg(&mut z)
                .arg(n as u64)
                .arg(by_value(s.shape))
                .arg(s.bias)
                .arg(s.negate)
                .arg(s.offset)
                .arg(s.small)
                .arg(s.wide)
                .arg(s.half_term)
                .arg(s.big)
                .arg(s.last);
            // SAFETY: as above.
            unsafe { stream.launch(&kernel, config, list) }.unwrap();
            assert!(engine.dtoh(&z).unwrap() == expected(&xs, *s), "{kind}, round {round}, list");
        }
    }
    for image in [FATBIN, CUBIN] {
        let refused = Module::load_image(engine.context(), "truncated", &image[..image.len() - 8]).unwrap_err();
        assert!(matches!(refused, CudaError::InvalidModuleImage { .. }), "{refused}");
    }
    println!(
        "a_twelve_parameter_kernel_from_a_fatbin_and_a_cubin_computes_exactly: 2 images x 2 cases x (tuple, list), {n} elements each: exact"
    );
}
