//! Element types: [`DeviceRepr`], what may live in device memory and cross the FFI boundary as
//! raw bytes, with the crate's own (the integers, floats, `bf16` and `f16`).

/// Element types that may live in device memory and cross the FFI boundary as raw bytes.
///
/// Implemented for the integers, `f32`, `f64`, and `half`'s [`bf16`](half::bf16) and
/// [`f16`](half::f16). Implement it for your own plain-old-data types (a `#[repr(C)]` struct of
/// such fields, say) to move them with this crate.
///
/// # Safety
/// - Every bit pattern of `size_of::<Self>()` bytes is a valid `Self` (copies and kernels write
///   arbitrary bytes, and fresh device memory holds arbitrary bytes).
/// - `Self` has no padding, no pointers or references, and no drop glue (`Copy` ensures the
///   last), so its bytes may be read and compared.
/// - `NAME` names the type unambiguously: `rx` compares it with the type `tx` sent.
///
/// ```no_run
/// /// A token and its position, as the kernels' `struct { int id; int pos; }`.
/// #[derive(Clone, Copy, Debug, Default, PartialEq)]
/// #[repr(C)]
/// struct TokenPos {
///     id: i32,
///     pos: i32,
/// }
///
/// // SAFETY: two i32 fields: no padding, every bit pattern valid, no pointers; the name is unique.
/// unsafe impl ppnrt::DeviceRepr for TokenPos {
///     const NAME: &'static str = "my_engine::TokenPos";
/// }
///
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let x = engine.htod(&[TokenPos { id: 7, pos: 0 }, TokenPos { id: 9, pos: 1 }])?;
/// assert_eq!(engine.dtoh(&x)?[1], TokenPos { id: 9, pos: 1 });
/// # Ok(()) }
/// ```
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {
    /// The type's name, used in error messages and to match `rx` with `tx`.
    const NAME: &'static str;
}

macro_rules! device_repr {
    ($($t:ty => $name:literal),*) => {$(
        // SAFETY: a primitive numeric type: no padding, every bit pattern valid, no pointers.
        unsafe impl DeviceRepr for $t {
            const NAME: &'static str = $name;
        }
    )*};
}
device_repr!(
    u8 => "u8", i8 => "i8", u16 => "u16", i16 => "i16", u32 => "u32", i32 => "i32", u64 => "u64", i64 => "i64",
    f32 => "f32", f64 => "f64", half::bf16 => "bf16", half::f16 => "f16"
);
