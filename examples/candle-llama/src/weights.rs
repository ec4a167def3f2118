//! Random weights from a fixed seed, each tensor from its own name: any split of the layers over
//! stages, and candle-transformers' `Llama`, load the same values.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use half::bf16;

/// Elements generated from one sub-seed: the values do not depend on how many threads make them.
const CHUNK: usize = 1 << 20;

/// A `VarBuilder` whose every tensor is made from `seed` and its name, in bf16, on `device`.
pub fn var_builder(seed: u64, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(SeededWeights { seed }), DType::BF16, device.clone())
}

/// The `i`th prompt token of `seed`, below `vocab`.
pub fn token(seed: u64, i: usize, vocab: usize) -> u32 {
    (split_mix(&mut (seed ^ 0x70_6f_6d_70_74 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))) % vocab as u64) as u32
}

struct SeededWeights {
    seed: u64,
}

impl SimpleBackend for SeededWeights {
    fn get(&self, shape: Shape, name: &str, _init: Init, dtype: DType, device: &Device) -> Result<Tensor> {
        let n = shape.elem_count();
        let fan_in = *shape.dims().last().unwrap_or(&1);
        // Norm scales near 1; embeddings of unit size; matrices scaled by their fan-in, so that
        // the residual stream neither vanishes nor explodes over the layers.
        let (offset, scale) = if name.contains("norm") {
            (1.0, 0.1)
        } else if name.contains("embed_tokens") {
            (0.0, 1.0)
        } else {
            (0.0, (3.0 / fan_in as f32).sqrt())
        };
        let name_seed = self.seed ^ fnv1a(name);
        let mut values = vec![bf16::ZERO; n];
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
        let per_thread = n.div_ceil(CHUNK).div_ceil(threads) * CHUNK;
        std::thread::scope(|scope| {
            for (t, part) in values.chunks_mut(per_thread.max(1)).enumerate() {
                scope.spawn(move || {
                    for (c, chunk) in part.chunks_mut(CHUNK).enumerate() {
                        let index = (t * per_thread / CHUNK + c) as u64;
                        let mut state = name_seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03);
                        for v in chunk {
                            let unit = (split_mix(&mut state) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                            *v = bf16::from_f32(offset + scale * unit);
                        }
                    }
                });
            }
        });
        Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _device: &Device) -> Result<Tensor> {
        candle_core::bail!("seeded weights: {name} has no shape of its own; ask for it with one")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

fn split_mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
