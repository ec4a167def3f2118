//! One stage's part of the decoder: the embedding (first stage), its decoder layers, the final
//! norm and the head (last stage). The layers compute as `candle_transformers::models::llama`'s
//! (private) blocks do, op for op and with the same candle kernels, so that the logits can be
//! compared bit for bit with candle-transformers' `Llama`.

use std::ops::Range;

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_transformers::models::llama::Config;
use candle_transformers::models::with_tracing::{linear_no_bias, Linear, RmsNorm};
use candle_transformers::utils::{build_causal_mask, repeat_kv};

use crate::weights;

const RMS_NORM_EPS: f64 = 1e-5;
const ROPE_THETA: f32 = 10_000.0;

/// The decoder's sizes.
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub max_positions: usize,
}

impl Default for Shape {
    fn default() -> Shape {
        Shape {
            layers: 16,
            hidden: 2048,
            intermediate: 5632,
            heads: 32,
            kv_heads: 4,
            vocab: 32_000,
            max_positions: 1024,
        }
    }
}

impl Shape {
    /// Refuses sizes the decoder cannot have, naming the setting.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (name, value) in [
            ("--layers", self.layers),
            ("--hidden", self.hidden),
            ("--intermediate", self.intermediate),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--vocab", self.vocab),
        ] {
            if value == 0 {
                return Err(format!("{name}: 0; it must be at least 1"));
            }
        }
        if self.hidden % self.heads != 0 || (self.hidden / self.heads) % 2 != 0 {
            return Err(format!("--hidden {} over --heads {}: each head needs an even size", self.hidden, self.heads));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(format!("--heads {} is not a multiple of --kv-heads {}", self.heads, self.kv_heads));
        }
        if self.vocab > u32::MAX as usize {
            return Err(format!("--vocab {}: token ids are u32", self.vocab));
        }
        Ok(())
    }

    /// candle-transformers' configuration of the same decoder.
    pub fn config(&self) -> Config {
        Config {
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            vocab_size: self.vocab,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            use_flash_attn: false,
            rms_norm_eps: RMS_NORM_EPS,
            rope_theta: ROPE_THETA,
            bos_token_id: None,
            eos_token_id: None,
            rope_scaling: None,
            max_position_embeddings: self.max_positions,
            tie_word_embeddings: false,
        }
    }

    /// The parameter count.
    pub fn parameters(&self) -> usize {
        let head = self.hidden / self.heads;
        let attention = 2 * self.hidden * self.hidden + 2 * self.hidden * head * self.kv_heads;
        let layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden;
        self.layers * layer + 2 * self.vocab * self.hidden + self.hidden
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// A stage's layers and its share of the decoder's state (its layers' KV cache).
pub struct StagePart {
    cuda: CudaDevice,
    device: Device,
    embed: Option<Embedding>,
    blocks: Vec<Block>,
    head: Option<(RmsNorm, Linear)>,
    cos: Tensor,
    sin: Tensor,
}

impl StagePart {
    /// Loads `layers` (their global indices) on `cuda`, with the embedding when `first` and the
    /// final norm and head when `last`.
    pub fn load(
        seed: u64,
        shape: &Shape,
        layers: Range<usize>,
        first: bool,
        last: bool,
        cuda: CudaDevice,
    ) -> Result<StagePart> {
        let device = Device::Cuda(cuda.clone());
        let vb = weights::var_builder(seed, &device);
        let embed = if first {
            Some(candle_nn::embedding(shape.vocab, shape.hidden, vb.pp("model.embed_tokens"))?)
        } else {
            None
        };
        let blocks = layers.map(|i| Block::load(vb.pp(format!("model.layers.{i}")), shape)).collect::<Result<_>>()?;
        let head = if last {
            Some((
                RmsNorm::new(shape.hidden, RMS_NORM_EPS, vb.pp("model.norm"))?,
                linear_no_bias(shape.hidden, shape.vocab, vb.pp("lm_head"))?,
            ))
        } else {
            None
        };
        let (cos, sin) = rotary_tables(shape, &device)?;
        Ok(StagePart { cuda, device, embed, blocks, head, cos, sin })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn cuda_device(&self) -> &CudaDevice {
        &self.cuda
    }

    /// The first stage's embedding of `tokens` (1 × sequence).
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        match &self.embed {
            Some(embed) => embed.forward(tokens),
            None => candle_core::bail!("only the first stage embeds tokens"),
        }
    }

    /// The stage's layers on `x` (1 × sequence × hidden) at `position`; on the last stage, the
    /// logits of the sequence's last token in f32.
    pub fn forward(&mut self, x: &Tensor, position: usize) -> Result<Tensor> {
        let (_, seq_len, _) = x.dims3()?;
        let mut x = x.clone();
        for block in &mut self.blocks {
            x = block.forward(&x, position, &self.cos, &self.sin)?;
        }
        let Some((norm, head)) = &self.head else { return Ok(x) };
        let x = norm.forward(&x)?;
        let x = x.i((.., seq_len - 1, ..))?.contiguous()?;
        head.forward(&x)?.to_dtype(DType::F32)
    }
}

/// The rotary embedding's cos and sin tables, as candle-transformers' `llama::Cache` makes them.
fn rotary_tables(shape: &Shape, device: &Device) -> Result<(Tensor, Tensor)> {
    let head_dim = shape.head_dim();
    let inverse_frequencies: Vec<f32> =
        (0..head_dim).step_by(2).map(|i| 1f32 / ROPE_THETA.powf(i as f32 / head_dim as f32)).collect();
    let theta = Tensor::new(inverse_frequencies, device)?;
    let angles = Tensor::arange(0, shape.max_positions as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((shape.max_positions, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?))
}

/// One decoder layer with its KV cache.
struct Block {
    input_norm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_norm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cache: Option<(Tensor, Tensor)>,
}

impl Block {
    fn load(vb: candle_nn::VarBuilder, shape: &Shape) -> Result<Block> {
        let head_dim = shape.head_dim();
        let (q_size, kv_size) = (head_dim * shape.heads, head_dim * shape.kv_heads);
        let attention = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        Ok(Block {
            input_norm: RmsNorm::new(shape.hidden, RMS_NORM_EPS, vb.pp("input_layernorm"))?,
            q_proj: linear_no_bias(shape.hidden, q_size, attention.pp("q_proj"))?,
            k_proj: linear_no_bias(shape.hidden, kv_size, attention.pp("k_proj"))?,
            v_proj: linear_no_bias(shape.hidden, kv_size, attention.pp("v_proj"))?,
            o_proj: linear_no_bias(q_size, shape.hidden, attention.pp("o_proj"))?,
            post_attention_norm: RmsNorm::new(shape.hidden, RMS_NORM_EPS, vb.pp("post_attention_layernorm"))?,
            gate_proj: linear_no_bias(shape.hidden, shape.intermediate, mlp.pp("gate_proj"))?,
            up_proj: linear_no_bias(shape.hidden, shape.intermediate, mlp.pp("up_proj"))?,
            down_proj: linear_no_bias(shape.intermediate, shape.hidden, mlp.pp("down_proj"))?,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            head_dim,
            cache: None,
        })
    }

    fn forward(&mut self, x: &Tensor, position: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let residual = x;
        let h = self.input_norm.forward(x)?;
        let h = (self.attention(&h, position, cos, sin)? + residual)?;
        let residual = &h;
        let normed = self.post_attention_norm.forward(&h)?;
        let gated = (candle_nn::ops::silu(&self.gate_proj.forward(&normed)?)? * self.up_proj.forward(&normed)?)?;
        self.down_proj.forward(&gated)? + residual
    }

    fn attention(&mut self, x: &Tensor, position: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (batch, seq_len, hidden) = x.dims3()?;
        let q = self.q_proj.forward(x)?;
        let k = self.k_proj.forward(x)?;
        let v = self.v_proj.forward(x)?;
        let q = q.reshape((batch, seq_len, self.heads, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let k = k.reshape((batch, seq_len, self.kv_heads, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let mut v = v.reshape((batch, seq_len, self.kv_heads, self.head_dim))?.transpose(1, 2)?;
        let (cos, sin) = (cos.narrow(0, position, seq_len)?, sin.narrow(0, position, seq_len)?);
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        let mut k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
        if let Some((cached_k, cached_v)) = &self.cache {
            k = Tensor::cat(&[cached_k, &k], 2)?.contiguous()?;
            v = Tensor::cat(&[cached_v, &v], 2)?.contiguous()?;
        }
        self.cache = Some((k.clone(), v.clone()));
        let k = repeat_kv(k, self.heads / self.kv_heads)?;
        let v = repeat_kv(v, self.heads / self.kv_heads)?;
        let q = q.to_dtype(DType::F32)?;
        let k = k.to_dtype(DType::F32)?;
        let v = v.to_dtype(DType::F32)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let scores = if seq_len == 1 {
            scores
        } else {
            let mask = build_causal_mask(seq_len, position, x.device())?.broadcast_as(scores.shape())?;
            let minus_infinity = Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(mask.shape().dims())?;
            mask.where_cond(&minus_infinity, &scores)?
        };
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let y = weights.matmul(&v.contiguous()?)?.to_dtype(DType::BF16)?;
        let y = y.transpose(1, 2)?.reshape(&[batch, seq_len, hidden])?;
        self.o_proj.forward(&y)
    }
}
